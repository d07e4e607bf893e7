"""Shared fixtures: the embedded tiny checkpoint is built once per test session."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory):
    return os.environ.get("VLM_SERVE_TEST_CACHE") or str(tmp_path_factory.mktemp("model-cache"))


@pytest.fixture(scope="session")
def tiny_checkpoint(model_cache):
    from app.model_builder import ensure_embedded

    return ensure_embedded("tiny", model_cache)
