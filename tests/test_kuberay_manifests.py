"""deploy/kuberay/ against the KubeRay CRD schemas committed in deploy/kuberay/schemas/ (KubeRay 1.7.0; their
README says where they come from), and the application inside them against this project's own config:

- every RayService and RayJob validates against its CRD's openAPIV3Schema, strictly: a key the schema does
  not list is refused (as `kubectl apply --validate=strict` does; the API server would drop it silently);
- the RayService's serveConfigV2 is a valid Ray Serve config whose application is serve_config.yaml's (same
  import path, route, runtime env and deployments) with args that build an AppConfig, and the placement it
  asks for makes LLM replicas ask for GPUs even when the builder runs before any GPU pod has joined, so the
  autoscaler adds pods for them;
- the RayJob's entrypoint is `python -m app.batch` with arguments it accepts, and the config it reads is
  the ConfigMap mounted there, a valid BatchConfig.
"""

from __future__ import annotations

import copy
import json
import shlex
from pathlib import Path

import pytest
import yaml

jsonschema = pytest.importorskip("jsonschema")

ROOT = Path(__file__).resolve().parent.parent
KUBERAY = ROOT / "deploy" / "kuberay"
SCHEMAS = {("ray.io/v1", "RayService"): "rayservice-v1.schema.json", ("ray.io/v1", "RayJob"): "rayjob-v1.schema.json"}


def strict(schema):
    """The schema where every object that lists its properties refuses others (unless the CRD keeps unknown
    fields there: x-kubernetes-preserve-unknown-fields)."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k == "properties" else strict(v)) for k, v in schema.items()}
    if "properties" in schema:
        out["properties"] = {name: strict(sub) for name, sub in schema["properties"].items()}
        if "additionalProperties" not in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    return out


def validator(api_version: str, kind: str):
    schema = json.loads((KUBERAY / "schemas" / SCHEMAS[(api_version, kind)]).read_text())
    return jsonschema.Draft202012Validator(strict(schema))


def documents() -> list[dict]:
    docs = []
    for path in sorted(KUBERAY.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def one(kind: str) -> dict:
    found = [d for d in documents() if d["kind"] == kind]
    assert len(found) == 1, kind
    return found[0]


def errors(doc: dict) -> list[str]:
    v = validator(doc["apiVersion"], doc["kind"])
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in v.iter_errors(doc)]


def test_the_schemas_are_the_crds_v1_schemas():
    for name in SCHEMAS.values():
        schema = json.loads((KUBERAY / "schemas" / name).read_text())
        assert set(schema["properties"]) == {"apiVersion", "kind", "metadata", "spec", "status"}
        assert "description" not in schema
    readme = (KUBERAY / "schemas" / "README.md").read_text()
    assert "v1.7.0" in readme and "59d663aeec13760646da3db9c1cf8cfe883e30b7" in readme


@pytest.mark.parametrize("kind", ["RayService", "RayJob"])
def test_manifest_validates_against_the_crd_schema(kind):
    assert errors(one(kind)) == []


def test_the_strict_validation_catches_misspelt_and_mistyped_fields():
    svc = one("RayService")
    typo = copy.deepcopy(svc)
    typo["spec"]["rayClusterConfig"]["enableInTreeAutoScaling"] = typo["spec"]["rayClusterConfig"].pop(
        "enableInTreeAutoscaling")
    assert any("enableInTreeAutoScaling" in e for e in errors(typo))
    wrong = copy.deepcopy(svc)
    wrong["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplicas"] = "eight"
    assert any("maxReplicas" in e for e in errors(wrong))
    container = copy.deepcopy(svc)
    container["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["imag"] = "x"
    assert any("imag" in e for e in errors(container))
    job = copy.deepcopy(one("RayJob"))
    job["spec"]["submissionMode"] = 3
    assert errors(job)


def serve_config() -> dict:
    return yaml.safe_load(one("RayService")["spec"]["serveConfigV2"])


def test_serve_config_v2_is_this_application():
    pytest.importorskip("ray")
    from ray.serve.schema import ServeDeploySchema

    from app.config import AppConfig

    conf = serve_config()
    ServeDeploySchema.model_validate(conf)  # what Ray Serve accepts
    ours = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    app, base = conf["applications"][0], ours["applications"][0]
    for key in ("name", "route_prefix", "import_path"):
        assert app[key] == base[key], key
    # neither asks for a runtime_env: it would start a fresh Ray worker for the builder and each replica
    # (the pods' environment runs Ray Serve's low-overhead mode instead)
    assert "runtime_env" not in app and "runtime_env" not in base
    assert [d["name"] for d in app["deployments"]] == [d["name"] for d in base["deployments"]]
    assert conf["proxy_location"] == ours["proxy_location"] == "EveryNode"
    AppConfig(**app["args"])  # unknown or mistyped args fail here, with their names


def test_llm_replicas_ask_for_gpus_before_any_gpu_pod_joins():
    """The builder runs once the head is up; with no GPU in the cluster yet it must still give the LLM
    replicas a GPU each (fused), so that pending replicas make the autoscaler add GPU pods."""
    pytest.importorskip("ray")
    from app.config import AppConfig
    from app.serving.cluster import NodeResources
    from deployments.app import deployment_options

    args = serve_config()["applications"][0]["args"]
    opts, pl = deployment_options(AppConfig(**args), 0, 0.0, [0], [NodeResources(0, 0)])
    assert pl.fused and opts["LLM"]["ray_actor_options"]["num_gpus"] == 1
    # and the same once GPU pods have joined
    opts, pl = deployment_options(AppConfig(**args), 4, 64.0, [0, 1, 1, 1, 1], [NodeResources(0, 0)] +
                                  [NodeResources(1, 16)] * 4)
    assert pl.fused and opts["LLM"]["ray_actor_options"]["num_gpus"] == 1


def gpus_per_pod(group: dict) -> int:
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    return int(limits.get("nvidia.com/gpu", 0))


@pytest.mark.parametrize("kind", ["RayService", "RayJob"])
def test_cluster_shape_head_without_gpus_and_an_autoscaled_gpu_group(kind):
    doc = one(kind)
    spec = doc["spec"]["rayClusterConfig" if kind == "RayService" else "rayClusterSpec"]
    assert spec["enableInTreeAutoscaling"] is True
    head = spec["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    assert "nvidia.com/gpu" not in head["template"]["spec"]["containers"][0]["resources"]["limits"]
    groups = spec["workerGroupSpecs"]
    assert any(gpus_per_pod(g) > 0 and g["maxReplicas"] > g["minReplicas"] for g in groups)
    import ray

    assert spec["rayVersion"] == ray.__version__  # the image runs the Ray these tests run


def test_the_autoscaled_deployments_fit_the_gpu_group():
    spec = one("RayService")["spec"]["rayClusterConfig"]
    gpus = sum(gpus_per_pod(g) * g["maxReplicas"] for g in spec["workerGroupSpecs"])
    deployments = {d["name"]: d for d in serve_config()["applications"][0]["deployments"]}
    llm = deployments["LLM"]["autoscaling_config"]
    assert 1 <= llm["min_replicas"] <= llm["max_replicas"] <= gpus  # one LLM replica per GPU (llm_num_gpus 1)
    assert "autoscaling_config" in deployments["MediaPreprocessor"]
    # KubeRay's Service and readiness probe use the container port named "serve": the proxies' port
    port = serve_config()["http_options"]["port"]
    for group in spec["workerGroupSpecs"]:
        ports = {p["name"]: p["containerPort"] for p in group["template"]["spec"]["containers"][0]["ports"]}
        assert ports["serve"] == port


def test_every_node_starts_with_the_serve_environment():
    from deployments.ray_env import SERVE_ENV

    spec = one("RayService")["spec"]["rayClusterConfig"]
    pods = [spec["headGroupSpec"]] + spec["workerGroupSpecs"]
    for pod in pods:
        env = {e["name"]: e["value"] for e in pod["template"]["spec"]["containers"][0]["env"]}
        assert {k: env.get(k) for k in SERVE_ENV} == SERVE_ENV


def test_rayjob_runs_the_batch_job_with_its_mounted_config(tmp_path):
    from app.batch.__main__ import parse_args
    from app.batch.config import BatchConfig

    job = one("RayJob")
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:3] == ["python", "-m", "app.batch"]
    args = parse_args(argv[3:])
    # the --config file is the ConfigMap mounted on the head, where the driver runs
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    mounts = {m["mountPath"]: m["name"] for m in head["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in head["volumes"]}
    config_dir, config_file = args.config.rsplit("/", 1)
    config_map = volumes[mounts[config_dir]]["configMap"]["name"]
    cm = one("ConfigMap")
    assert cm["metadata"]["name"] == config_map
    (tmp_path / config_file).write_text(cm["data"][config_file])
    cfg = BatchConfig.load(str(tmp_path / config_file))
    assert cfg.app.placement.policy == "fused" and cfg.llm_pool.num_gpus == 1
    # input and output on a volume the head mounts (the driver writes the shards)
    for path in (args.input, args.output):
        assert any(path.startswith(m + "/") for m in mounts), path
    workers = job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert cfg.llm_pool.max_size <= sum(gpus_per_pod(g) * g["maxReplicas"] for g in workers)
