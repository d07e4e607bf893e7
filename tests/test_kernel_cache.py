"""app/gpu/kernel_cache.py: where a replica's Triton compiles go (TRITON_CACHE_DIR)."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.gpu import kernel_cache


@pytest.fixture
def no_env(monkeypatch):
    """TRITON_CACHE_DIR unset for the test, and restored after it (what the function sets included)."""
    monkeypatch.setenv("TRITON_CACHE_DIR", "recorded")  # so that the teardown restores the real value
    monkeypatch.delenv("TRITON_CACHE_DIR")
    return monkeypatch


def test_kernels_go_under_the_configs_cache_dir(no_env, tmp_path):
    import os

    got = kernel_cache.use_kernel_cache(str(tmp_path / "models"))
    assert got == str(tmp_path / "models" / "triton") == os.environ["TRITON_CACHE_DIR"]
    assert Path(got).is_dir()


def test_without_a_cache_dir_the_default_model_cache_holds_them(no_env, tmp_path):
    from app.checkpoints import model_builder

    no_env.setattr(model_builder, "DEFAULT_CACHE", tmp_path / "default")
    assert kernel_cache.use_kernel_cache(None) == str(tmp_path / "default" / "triton")


def test_a_triton_cache_dir_already_set_wins(no_env, tmp_path):
    no_env.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    assert kernel_cache.use_kernel_cache(str(tmp_path / "models")) == str(tmp_path / "mine")
    assert not (tmp_path / "models").exists()


def test_a_cache_dir_that_cannot_be_written_leaves_tritons_default(no_env, tmp_path, caplog):
    """A read-only mount of prepared checkpoints as cache_dir: the replica starts, Triton keeps its own
    default directory (nothing set), and the log says why."""
    import os

    blocked = tmp_path / "file"
    blocked.write_text("a file where the directory would go")
    with caplog.at_level("WARNING", logger="app.gpu.kernel_cache"):
        assert kernel_cache.use_kernel_cache(str(blocked)) is None
    assert "TRITON_CACHE_DIR" not in os.environ
    assert "cannot write" in caplog.text
