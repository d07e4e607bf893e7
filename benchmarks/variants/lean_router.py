"""A serving-benchmark variant of a config file: six Router replicas from the start, and every replica's
user code on Ray Serve's own event loop (`RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0`, one thread
hop less per call). Used in benchmarks/RESULTS.md ("Serving: the fused placement"). The second part
has since become the config files' default; the first stays a benchmark choice.

    python3 benchmarks/variants/lean_router.py configs/qwen3-vl-2b-gpu.yaml /tmp/v.yaml
"""

import sys

import yaml


def main(src: str, dst: str) -> None:
    conf = yaml.safe_load(open(src))
    app = conf["applications"][0]
    app["runtime_env"] = {"env_vars": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}}
    for d in app["deployments"]:
        if d["name"] == "Router":
            d["autoscaling_config"]["min_replicas"] = 6
    with open(dst, "w") as f:
        yaml.safe_dump(conf, f, sort_keys=False)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
