"""benchmarks/autoscale_reaction.py's app: serve_config.yaml as Ray Serve would take it, with the variant's
metrics settings on the LLM's autoscaling and one replica for every other deployment."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.autoscale_reaction import app_config  # noqa: E402


def test_the_variant_reaches_the_llms_autoscaling_and_ray_serve_accepts_the_config():
    conf = app_config(8799, 1.0, 10.0, "/tmp/cache")
    app = conf["applications"][0]
    deps = {d["name"]: d for d in app["deployments"]}
    auto = deps["LLM"]["autoscaling_config"]
    assert (auto["metrics_interval_s"], auto["look_back_period_s"], auto["min_replicas"], auto["max_replicas"]) == \
        (1.0, 10.0, 1, 2)
    assert all(deps[n]["autoscaling_config"]["max_replicas"] == 1 for n in ("Router", "MediaPreprocessor"))
    assert app["args"]["cache_dir"] == "/tmp/cache" and conf["http_options"]["port"] == 8799
    schema = pytest.importorskip("ray.serve.schema").ServeDeploySchema.model_validate(conf)
    llm = {d.name: d for d in schema.applications[0].deployments}["LLM"]
    assert llm.autoscaling_config["metrics_interval_s"] == 1.0
