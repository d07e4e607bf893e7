"""A replica that is stopped lets its answers finish: the Router and LLM deployments get one grace, from one
definition (app/serving/shutdown.py), long enough for a long answer, and the LLM replica stops its engine
only once Serve has drained its requests."""

from __future__ import annotations

import asyncio
import gc

import pytest

from app.config import AppConfig
from app.serving.shutdown import (
    ANSWER_GRACE_S,
    SLOW_TOKENS_PER_S,
    START_MARGIN_S,
    answer_grace_s,
    shared_port_drain_s,
)


def test_the_grace_covers_the_longest_default_answer_at_the_slow_rate():
    tokens = AppConfig().llm.default_max_tokens
    assert ANSWER_GRACE_S == answer_grace_s(tokens) == 60  # the documented number: 256 tokens at 5/s, plus 8 s
    assert ANSWER_GRACE_S >= tokens / SLOW_TOKENS_PER_S + START_MARGIN_S
    for tokens in (1, 255, 256, 257, 1000, 4096):
        assert tokens / SLOW_TOKENS_PER_S + START_MARGIN_S <= answer_grace_s(tokens) < tokens / SLOW_TOKENS_PER_S + START_MARGIN_S + 1
    assert 0 < shared_port_drain_s(ANSWER_GRACE_S) < ANSWER_GRACE_S  # the Router's own port drains inside it


def test_router_and_llm_get_one_grace_that_follows_the_configured_max_tokens():
    from deployments.app import deployment_options

    for cfg, gpus, cpus in [(AppConfig(), 0, 2), (AppConfig(placement={"policy": "fused"}), 2, 32),
                            (AppConfig(llm={"default_max_tokens": 1024}), 4, 64)]:
        opts, _ = deployment_options(cfg, gpus, cpus)
        grace = answer_grace_s(cfg.llm.default_max_tokens)
        assert opts["Router"]["graceful_shutdown_timeout_s"] == opts["LLM"]["graceful_shutdown_timeout_s"] == grace
        assert grace >= cfg.llm.default_max_tokens / SLOW_TOKENS_PER_S
    assert opts["LLM"]["graceful_shutdown_timeout_s"] == 213  # 1024 tokens: 60 s would cut them


def test_the_deployments_default_grace_is_the_shared_one_and_reaches_rays_config():
    """The decorators' default (an application bound without the builder) and the builder's options, as
    Ray Serve's deployment config holds them."""
    pytest.importorskip("ray")
    from deployments.app import deployment_options
    from deployments.llm import LLM
    from deployments.router import Router

    for dep in (LLM, Router):
        assert dep._deployment_config.graceful_shutdown_timeout_s == ANSWER_GRACE_S
    opts, _ = deployment_options(AppConfig(llm={"default_max_tokens": 512}), 0, 2)
    for dep in (LLM, Router):
        configured = dep.options(**opts[dep.name])._deployment_config
        assert configured.graceful_shutdown_timeout_s == answer_grace_s(512) == 111


class _Engine:
    def __init__(self):
        self.stopped = 0

    def shutdown(self):
        self.stopped += 1


# Python calls an async __del__ too when it collects the object, and drops the coroutine (as the Router's)
@pytest.mark.filterwarnings("ignore:coroutine 'LLM.__del__' was never awaited:RuntimeWarning")
def test_the_llm_replica_stops_its_engine_when_serve_has_drained_it():
    """Serve awaits `__del__` only after the replica's requests have ended: it stops the engine (and with it a
    tensor-parallel group's followers); a replica stopped before its constructor returned has none."""
    pytest.importorskip("ray")
    from deployments.llm import LLM

    cls = LLM.func_or_class
    replica = cls.__new__(cls)
    replica.engine = _Engine()
    asyncio.run(replica.__del__())
    assert replica.engine.stopped == 1
    building = cls.__new__(cls)  # the engine built, the constructor not returned yet
    building.streams = type("Streams", (), {"engine": _Engine()})()
    asyncio.run(building.__del__())
    assert building.streams.engine.stopped == 1
    bare = cls.__new__(cls)  # nothing built yet
    asyncio.run(bare.__del__())
    del replica, building, bare
    gc.collect()
