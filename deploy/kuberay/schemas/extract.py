"""Extract the `openAPIV3Schema` of one version of a KubeRay CRD into a JSON file, without its
`description` fields (they are most of the CRD's bytes and take no part in validation).

    python deploy/kuberay/schemas/extract.py ray.io_rayservices.yaml v1 > rayservice-v1.schema.json

The committed schemas were made this way from the CRDs named in README.md (next to this file).
"""

from __future__ import annotations

import json
import sys

import yaml


def strip_descriptions(node):
    """The schema without `description` keys (a property that is itself named `description` stays)."""
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key == "properties" and isinstance(value, dict):
                out[key] = {name: strip_descriptions(sub) for name, sub in value.items()}
            elif key != "description":
                out[key] = strip_descriptions(value)
        return out
    if isinstance(node, list):
        return [strip_descriptions(v) for v in node]
    return node


def extract(crd: dict, version: str) -> dict:
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            return strip_descriptions(v["schema"]["openAPIV3Schema"])
    raise SystemExit(f"{crd['metadata']['name']} has no version {version!r}")


def main(argv: list[str]) -> int:
    path, version = argv[1], argv[2]
    with open(path) as f:
        crd = yaml.safe_load(f)
    json.dump(extract(crd, version), sys.stdout, separators=(",", ":"), sort_keys=True)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
