"""Shared fixtures: the embedded tiny checkpoint is built once per test session."""

from __future__ import annotations

import os

import pytest


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    """`make test` runs the suite in two pytest-xdist workers (`--dist loadgroup`). Every test that starts
    Ray or Ray Serve (the `integration` marker) goes to one worker, in turn: two Ray clusters at once on a
    2-core CI machine would starve each other's replicas past their timeouts, and several modules bind
    fixed ports. The rest (CPU model, kernel and unit tests) share the other worker and the gaps."""
    for item in items:
        if item.get_closest_marker("integration"):
            item.add_marker(pytest.mark.xdist_group("ray"))


@pytest.fixture(autouse=True)
def _triton_cache_dir_restored():
    """A GPU actor built in the test process (app/gpu/kernel_cache.py) sets TRITON_CACHE_DIR for the process:
    restored after each test, so that no later test or Ray it starts inherits it."""
    saved = os.environ.get("TRITON_CACHE_DIR")
    yield
    if saved is None:
        os.environ.pop("TRITON_CACHE_DIR", None)
    else:
        os.environ["TRITON_CACHE_DIR"] = saved


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory):
    return os.environ.get("VLM_SERVE_TEST_CACHE") or str(tmp_path_factory.mktemp("model-cache"))


@pytest.fixture(scope="session")
def tiny_checkpoint(model_cache):
    from app.checkpoints.model_builder import ensure_embedded

    return ensure_embedded("tiny", model_cache)


@pytest.fixture(scope="session")
def world(tiny_checkpoint):
    """Reference model, our engine, tokenizer and an encoder for LLM tests on the tiny model."""
    import torch
    from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration

    from app.llm.engine import Engine
    from app.media.spec import patch_spec_for
    from app.vision.graphs import GraphManager, GraphSettings
    from app.vision.loading import load_vision_model
    from app.vision.tower import VisionTower

    ref = Qwen3VLForConditionalGeneration.from_pretrained(tiny_checkpoint).eval()
    mgr = GraphManager(VisionTower(load_vision_model(tiny_checkpoint, torch.float32)), GraphSettings([256, 512]))
    return {"ref": ref, "engine": Engine(str(tiny_checkpoint)), "tok": AutoTokenizer.from_pretrained(tiny_checkpoint),
            "spec": patch_spec_for(tiny_checkpoint), "mgr": mgr}
