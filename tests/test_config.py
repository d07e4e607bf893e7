import pytest

from app.config import AppConfig


def test_defaults_validate():
    cfg = AppConfig()
    assert cfg.model == "embedded:tiny" and cfg.model_name == "tiny"
    assert cfg.media.video_fps == 2.0 and cfg.encoder.max_budget == 8192


@pytest.mark.parametrize("args,field", [
    ({"modle": "x"}, "modle"),
    ({"encoder": {"max_budgte": 3}}, "max_budgte"),
    ({"media": {"video_fps": -1}}, "video_fps"),
    ({"encoder": {"token_budgets": [100, 6]}}, "multiple of 4"),
    ({"encoder": {"min_budget": 4096, "max_budget": 256}}, "min_budget"),
    ({"media": {"video_min_frames": 10, "video_max_frames": 4}}, "video_min_frames"),
    ({"device": "tpu"}, "device"),
])
def test_wrong_fields_name_themselves(args, field):
    with pytest.raises(ValueError, match=field):
        AppConfig(**args)


def test_builder_reports_invalid_args():
    from deployments.app import build_app

    with pytest.raises(ValueError, match="max_budgte"):
        build_app({"encoder": {"max_budgte": 1}})
    with pytest.raises(ValueError, match="/no/such/checkpoint"):
        build_app({"model": "/no/such/checkpoint"})


def test_builder_options_follow_the_placement_policy():
    from deployments.app import deployment_options

    opts, pl = deployment_options(AppConfig(), 0, 2)
    assert pl.policy == "cpu" and opts["VisionEncoder"]["num_replicas"] == opts["LLM"]["num_replicas"] == 1
    assert opts["VisionEncoder"]["ray_actor_options"]["num_gpus"] == opts["LLM"]["ray_actor_options"]["num_gpus"] == 0
    # replica counts of the GPU deployments are num_replicas, so a config file can give an autoscaling_config
    assert "autoscaling_config" not in opts["VisionEncoder"] and "autoscaling_config" not in opts["LLM"]
    assert opts["Router"]["autoscaling_config"]["min_replicas"] == 1
    assert opts["MediaPreprocessor"]["autoscaling_config"]["max_replicas"] == 1  # half of 2 CPUs
    assert opts["LLM"]["request_router_config"].request_router_class == "deployments.routing:LeastLoadedRouter"
    assert opts["VisionEncoder"]["max_ongoing_requests"] == opts["LLM"]["max_ongoing_requests"] == 1024  # not 5
    sum_cpus = sum(o["ray_actor_options"]["num_cpus"] for o in opts.values())
    assert sum_cpus <= 2  # `make serve` and the tests fit a 2-core machine

    opts, pl = deployment_options(AppConfig(placement={"policy": "colocate"}), 4, 64)
    assert pl.policy == "colocate" and pl.encoder_pins_gpu
    assert opts["LLM"]["num_replicas"] == opts["VisionEncoder"]["num_replicas"] == 4
    # the Routers follow the GPUs (3 per GPU by default), capped at a quarter of the cores
    assert opts["Router"]["autoscaling_config"]["min_replicas"] == 12
    assert opts["Router"]["autoscaling_config"]["max_replicas"] == 24
    assert opts["LLM"]["ray_actor_options"]["num_gpus"] == 1 and opts["VisionEncoder"]["ray_actor_options"]["num_gpus"] == 0

    # fused: the VisionEncoder stays in the application (config files name it) with no replica
    # (Ray Serve refuses num_replicas=0; an autoscaling range starting at 0 that nothing scales up)
    opts, pl = deployment_options(AppConfig(placement={"policy": "fused"}), 2, 32)
    assert pl.fused and opts["LLM"]["num_replicas"] == 2 and opts["LLM"]["ray_actor_options"]["num_gpus"] == 1
    assert "num_replicas" not in opts["VisionEncoder"]
    assert opts["VisionEncoder"]["autoscaling_config"] == {"min_replicas": 0, "initial_replicas": 0, "max_replicas": 1}
    assert opts["Router"]["autoscaling_config"]["min_replicas"] == 6
    opts, _ = deployment_options(AppConfig(placement={"router_replicas_per_gpu": 4}), 2, 16)
    assert opts["Router"]["autoscaling_config"]["min_replicas"] == 4  # 16 cores: a quarter


def media_autoscaling(placement: dict, gpus: int, cpus: float) -> dict:
    from deployments.app import deployment_options

    return deployment_options(AppConfig(placement=placement), gpus, cpus)[0]["MediaPreprocessor"]["autoscaling_config"]


def test_media_floor_follows_the_gpus():
    # without GPUs as before: 1 to half the cores, a minute before scaling down
    assert media_autoscaling({}, 0, 2) == {"min_replicas": 1, "max_replicas": 1, "target_ongoing_requests": 2,
                                           "look_back_period_s": 15, "metrics_interval_s": 1.0, "upscale_delay_s": 3,
                                           "downscale_delay_s": 60}
    assert media_autoscaling({"media_replicas_per_gpu": 4}, 0, 16)["min_replicas"] == 1
    assert media_autoscaling({}, 0, 16)["max_replicas"] == 8
    # 4 per GPU (a fixed 4 on four H200s served 500.76 req/s, 12 replicas 764.88), within a quarter of
    # the cores, up to half the cores
    assert media_autoscaling({}, 4, 64) == {"min_replicas": 16, "max_replicas": 32, "target_ongoing_requests": 2,
                                            "look_back_period_s": 15, "metrics_interval_s": 1.0, "upscale_delay_s": 3,
                                            "downscale_delay_s": 120}
    assert media_autoscaling({"media_replicas_per_gpu": 2}, 2, 64)["min_replicas"] == 4
    assert media_autoscaling({}, 1, 16)["min_replicas"] == 4
    assert media_autoscaling({}, 5, 64)["min_replicas"] == 16  # a quarter of the cores
    # cores unknown (outside Ray): per GPU, the ceiling twice that
    assert media_autoscaling({}, 2, 0)["min_replicas"] == 8 and media_autoscaling({}, 2, 0)["max_replicas"] == 16
    with pytest.raises(ValueError, match="media_replicas_per_gpu"):
        AppConfig(placement={"media_replicas_per_gpu": 0})


def test_media_floor_is_capped_by_the_cores():
    from deployments.app import deployment_options

    # a quarter of the cores at most, at least one; the ceiling at least twice the floor
    assert media_autoscaling({}, 8, 32)["min_replicas"] == 8 and media_autoscaling({}, 8, 32)["max_replicas"] == 16
    assert media_autoscaling({}, 1, 2)["min_replicas"] == 1
    assert media_autoscaling({"media_replicas_per_gpu": 8}, 2, 24)["max_replicas"] == 12
    # the Routers' and the media floors together leave half the cores to the other replicas
    opts, _ = deployment_options(AppConfig(), 8, 32)
    assert opts["Router"]["autoscaling_config"]["min_replicas"] + opts["MediaPreprocessor"]["autoscaling_config"][
        "min_replicas"] == 16


def test_a_config_files_media_autoscaling_replaces_the_builders():
    """What `serve run` does with a config file's MediaPreprocessor entry (Ray Serve's own code, no Ray
    started): its autoscaling_config replaces the builder's whole, floor and knobs alike."""
    pytest.importorskip("ray")
    from ray.serve._private.application_state import override_deployment_info
    from ray.serve._private.deployment_info import DeploymentInfo
    from ray.serve.schema import ServeApplicationSchema

    from deployments.app import deployment_options
    from deployments.media import MediaPreprocessor

    opts, _ = deployment_options(AppConfig(), 4, 64)
    media = MediaPreprocessor.options(**opts["MediaPreprocessor"])
    info = DeploymentInfo(deployment_config=media._deployment_config, replica_config=media._replica_config,
                          start_time_ms=0, deployer_job_id="")
    assert info.deployment_config.autoscaling_config.min_replicas == 16
    user = {"min_replicas": 2, "max_replicas": 5, "target_ongoing_requests": 4}
    app = ServeApplicationSchema(import_path="deployments.app:build_app",
                                 deployments=[{"name": "MediaPreprocessor", "autoscaling_config": user}])
    scaling = override_deployment_info({"MediaPreprocessor": info}, app)["MediaPreprocessor"] \
        .deployment_config.autoscaling_config
    assert (scaling.min_replicas, scaling.max_replicas, scaling.target_ongoing_requests) == (2, 5, 4)
    # not merged: what the file leaves out is Ray Serve's default, not the builder's (15 s, 120 s)
    assert scaling.look_back_period_s != 15 and scaling.downscale_delay_s != 120
    # an application built from Python (no config file) keeps the builder's
    assert override_deployment_info({"MediaPreprocessor": info}, None)["MediaPreprocessor"] \
        .deployment_config.autoscaling_config.min_replicas == 16

@pytest.mark.parametrize("placement,gpus,want", [
    ({}, 1, ("fused", 0, 0.0, 1, 1.0, False)),  # auto: fused on GPUs (README, "Placement")
    ({"llm_replicas_per_gpu": 2}, 2, ("fused", 0, 0.0, 4, 0.5, False)),
    ({"policy": "colocate", "llm_replicas_per_gpu": 3}, 1, ("colocate", 1, 0.0, 3, 1 / 3, True)),
    ({"policy": "split", "llm_replicas_per_gpu": 2}, 3, ("split", 1, 1.0, 4, 0.5, False)),
    ({"policy": "colocate"}, 2, ("colocate", 2, 0.0, 2, 1.0, True)),
    ({"policy": "colocate", "llm_replicas": 4}, 2, ("colocate", 2, 0.0, 4, 0.5, True)),
    ({"policy": "split"}, 4, ("split", 1, 1.0, 3, 1.0, False)),
    ({"policy": "split", "encoder_gpus": 2, "llm_gpus": 1}, 4, ("split", 2, 1.0, 1, 1.0, False)),
    ({"policy": "split", "encoder_gpus": 1, "encoder_replicas": 3}, 2, ("split", 3, 1 / 3, 1, 1.0, False)),
    ({"encoder_replicas": 2, "encoder_num_gpus": 0.25}, 1, ("colocate", 2, 0.25, 1, 1.0, False)),
    ({"policy": "split"}, 0, ("cpu", 1, 0.0, 1, 0.0, False)),
    ({"policy": "fused"}, 4, ("fused", 0, 0.0, 4, 1.0, False)),
    ({"policy": "fused", "llm_replicas": 2}, 1, ("fused", 0, 0.0, 2, 0.5, False)),
    ({"policy": "fused"}, 0, ("fused", 0, 0.0, 1, 0.0, False)),  # kept on the CPU: one replica that encodes
    ({"policy": "fused", "llm_replicas_per_gpu": 2}, 0, ("fused", 0, 0.0, 1, 0.0, False)),  # no GPU to share
])
def test_placement_plans(placement, gpus, want):
    from app.serving.placement import plan

    p = plan(AppConfig(placement=placement).placement, gpus)
    assert (p.policy, p.encoder_replicas, p.encoder_num_gpus, p.llm_replicas, p.llm_num_gpus,
            p.encoder_pins_gpu) == pytest.approx(want)


@pytest.mark.parametrize("placement,gpus,match", [
    ({"policy": "split"}, 1, "at least 2 GPUs"),
    ({"policy": "split", "encoder_gpus": 2, "llm_gpus": 1}, 2, "fit"),
    ({"policy": "split", "llm_gpus": 0}, 2, "llm_gpus"),
    ({"policy": "fused", "encoder_replicas": 2}, 1, "runs no encoder replicas"),
    ({"policy": "fused", "encoder_num_gpus": 0.5}, 0, "runs no encoder replicas"),
])
def test_impossible_placements_name_themselves(placement, gpus, match):
    from app.serving.placement import plan

    with pytest.raises(ValueError, match=match):
        plan(AppConfig(placement=placement).placement, gpus)


def test_llm_replicas_sharing_a_gpu_split_its_kv_budget():
    from app.serving.placement import llm_memory_share, plan

    def share(placement, gpus):
        return llm_memory_share(0.9, plan(AppConfig(placement=placement).placement, gpus).llm_num_gpus)

    assert share({}, 2) == 0.9  # one replica per GPU: the whole fraction
    assert share({"llm_replicas_per_gpu": 2}, 2) == pytest.approx(0.45)
    assert share({"policy": "colocate", "llm_replicas": 3}, 1) == pytest.approx(0.3)
    assert share({}, 0) == 0.9  # the CPU: no GPU share


def test_pinned_gpu_takes_the_node_gpus_in_turn_by_rank():
    from app.serving.placement import pinned_gpu

    assert [pinned_gpu(r, 2, None) for r in range(4)] == ["0", "1", "0", "1"]
    assert [pinned_gpu(r, 4, "2,3") for r in range(3)] == ["2", "3", "2"]  # what the process was given
    assert pinned_gpu(0, 0, None) is None and pinned_gpu(1, 2, "") is None


def test_serve_config_args_validate():
    from pathlib import Path

    import yaml

    conf = yaml.safe_load((Path(__file__).parent.parent / "serve_config.yaml").read_text())
    app = conf["applications"][0]
    assert app["import_path"] == "deployments.app:build_app"
    AppConfig(**app["args"])
    names = {d["name"] for d in app["deployments"]}
    assert names == {"Router", "MediaPreprocessor", "VisionEncoder", "LLM"}


@pytest.mark.parametrize("name", ["qwen3-vl-2b-gpu.yaml", "qwen3-vl-8b-gpu.yaml"])
def test_gpu_presets_validate(name):
    from pathlib import Path

    import yaml

    conf = yaml.safe_load((Path(__file__).parent.parent / "configs" / name).read_text())
    app = conf["applications"][0]
    cfg = AppConfig(**app["args"])
    assert cfg.model.startswith("embedded:qwen3-vl-") and app["import_path"] == "deployments.app:build_app"
    # clients come in on the Routers' own port, the proxy keeps another one, and the Routers autoscale on
    # the requests that come in there as well
    assert cfg.router_http_port == 8000 != conf["http_options"]["port"]
    # the presets leave the Routers' autoscaling to the builder, whose floor follows the GPUs
    router = next(d for d in app["deployments"] if d["name"] == "Router")
    assert "autoscaling_config" not in router
    # and the MediaPreprocessor's: its floor follows the GPUs too
    media = next(d for d in app["deployments"] if d["name"] == "MediaPreprocessor")
    assert "autoscaling_config" not in media
    from deployments.app import deployment_options

    opts, _ = deployment_options(cfg, 2, 32)
    scaling = opts["Router"]["autoscaling_config"]
    assert scaling["policy"]["policy_function"] == "app.serving.autoscaling:RouterAutoscalingPolicy"
    assert scaling["min_replicas"] == 6
    assert opts["MediaPreprocessor"]["autoscaling_config"]["min_replicas"] == 8
