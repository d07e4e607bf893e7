"""The application deployed the way `serve run serve_config.yaml` deploys it: the repository's config
file through Ray Serve's config path, with a test's overrides (port, model cache, small budgets).
Router and MediaPreprocessor are pinned to one replica each, so that replica identities change only
when a replica restarts (never because autoscaling added or removed one)."""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator
from pathlib import Path

import yaml

from benchmarks.serve import wait_listening

ROOT = Path(__file__).resolve().parent.parent


def config_from_file(port: int, args: dict, deployments: dict[str, dict] | None = None) -> dict:
    """serve_config.yaml; `args` merged one level deep into the application's args; `deployments`
    merged into the named deployments' entries."""
    conf = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    conf["http_options"] = {"host": "127.0.0.1", "port": port}
    app = conf["applications"][0]
    for key, value in args.items():
        if isinstance(value, dict) and isinstance(app["args"].get(key), dict):
            app["args"][key].update(value)
        else:
            app["args"][key] = value
    by_name = {d["name"]: d for d in app["deployments"]}
    for name in ("Router", "MediaPreprocessor"):
        by_name[name]["autoscaling_config"].update({"min_replicas": 1, "max_replicas": 1})
        by_name[name]["ray_actor_options"] = {"num_cpus": 0.25}
    for name, opts in (deployments or {}).items():
        by_name[name].update(copy.deepcopy(opts))
    return conf


@contextlib.contextmanager
def deployed(conf: dict, metrics_port: int | None = None, num_gpus: int | None = None,
             env: dict[str, str] | None = None) -> Iterator:
    """Ray started here, the config deployed as `serve run` deploys it; yields Serve's client. `env` is
    set for the run (e.g. faster autoscaling metrics) and restored after it."""
    import ray
    from ray import serve
    from ray.serve._private import api as serve_api
    from ray.serve.schema import ServeDeploySchema

    from deployments.ray_env import apply_serve_env

    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    apply_serve_env()  # as `make serve` starts Ray
    kw = {"_metrics_export_port": metrics_port} if metrics_port else {}
    if num_gpus is not None:
        kw["num_gpus"] = num_gpus
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, **kw)
    try:
        client = serve_api.serve_start(http_options=conf["http_options"])  # what `serve run` does
        client.deploy_apps(ServeDeploySchema.model_validate(conf), _blocking=True)
        for app in conf["applications"]:  # a Router listens on its own port once it has warmed itself
            if app.get("args", {}).get("router_http_port"):
                wait_listening(app["args"]["router_http_port"])
        yield client
    finally:
        serve.shutdown()
        ray.shutdown()
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
