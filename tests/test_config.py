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


def test_placement():
    from deployments.app import placement

    cfg = AppConfig()
    enc, llm = placement(cfg, 0)
    assert enc["num_replicas"] == 1 and enc["ray_actor_options"]["num_gpus"] == 0
    enc, llm = placement(cfg, 4)
    assert enc["num_replicas"] == 3 and enc["ray_actor_options"]["num_gpus"] == 1
    assert llm["ray_actor_options"]["num_gpus"] == 1
    enc, _ = placement(AppConfig(placement={"encoder_replicas": 2, "encoder_num_gpus": 0.25}), 1)
    assert enc["num_replicas"] == 2 and enc["ray_actor_options"]["num_gpus"] == 0.25
    assert enc["max_ongoing_requests"] == llm["max_ongoing_requests"] == 1024  # not Ray Serve's 5


def test_serve_config_args_validate():
    from pathlib import Path

    import yaml

    conf = yaml.safe_load((Path(__file__).parent.parent / "serve_config.yaml").read_text())
    app = conf["applications"][0]
    assert app["import_path"] == "deployments.app:build_app"
    AppConfig(**app["args"])
    names = {d["name"] for d in app["deployments"]}
    assert names == {"Router", "VisionEncoder", "LLM"}


@pytest.mark.parametrize("name", ["qwen3-vl-2b-gpu.yaml", "qwen3-vl-8b-gpu.yaml"])
def test_gpu_presets_validate(name):
    from pathlib import Path

    import yaml

    conf = yaml.safe_load((Path(__file__).parent.parent / "configs" / name).read_text())
    app = conf["applications"][0]
    cfg = AppConfig(**app["args"])
    assert cfg.model.startswith("embedded:qwen3-vl-") and app["import_path"] == "deployments.app:build_app"
