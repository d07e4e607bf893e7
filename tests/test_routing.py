"""Least-loaded LLM routing, the LLM autoscaling policy and the merged replica reports, without a
cluster (tests/test_scaling.py runs them in Ray Serve)."""

from __future__ import annotations

import random

import pytest

from app.serving.replica_stats import merge_encoder_stats, merge_llm_loads
from app.serving.routing import ReplicaLoad, choose, rank


def test_fewest_requests_in_flight_wins():
    loads = {"a": ReplicaLoad(5), "b": ReplicaLoad(2), "c": ReplicaLoad(9)}
    assert rank(loads) == ["b", "a", "c"]


def test_waiting_requests_and_a_full_kv_cache_count_against_a_replica():
    # the same requests in flight: the one whose engine has nothing waiting and an emptier cache first
    loads = {"waits": ReplicaLoad(4, running=2, waiting=2), "full": ReplicaLoad(4, running=4, kv_usage=1.0),
             "free": ReplicaLoad(4, running=4, kv_usage=0.1)}
    assert rank(loads) == ["free", "waits", "full"]
    # a full cache outweighs up to kv_weight more requests in flight
    assert rank({"full": ReplicaLoad(0, kv_usage=1.0), "busy": ReplicaLoad(7)}, kv_weight=8)[0] == "busy"
    assert rank({"full": ReplicaLoad(0, kv_usage=1.0), "busy": ReplicaLoad(9)}, kv_weight=8)[0] == "full"


def test_the_larger_of_the_handles_count_and_the_engines_report_counts():
    loads = {"known": ReplicaLoad(3), "reported": ReplicaLoad.from_stats(None, {"running": 1, "waiting": 0}),
             "silent": ReplicaLoad.from_stats(None, {})}
    assert rank(loads) == ["silent", "reported", "known"]
    # the handle's count fell to 0 for long streams it had forgotten, the engine still runs 6 of them
    stale = {"busy": ReplicaLoad.from_stats(0, {"running": 6}), "new": ReplicaLoad.from_stats(2, {})}
    assert rank(stale) == ["new", "busy"]


def test_ties_are_broken_at_random():
    loads = {k: ReplicaLoad(1) for k in "abcd"}
    firsts = {rank(loads, rng=random.Random(seed))[0] for seed in range(40)}
    assert firsts == set("abcd")


def _stale_burst(pick, sends: int = 100) -> dict:
    """One router's `sends` requests between two reports: every replica reported 100-107 running
    (replica a the least), and the router's own count of requests in flight at each grows per send."""
    reported = {k: 100 + i for i, k in enumerate("abcdefgh")}
    mine = dict.fromkeys(reported, 0)
    for _ in range(sends):
        k = pick({k: ReplicaLoad(mine[k], running=reported[k]) for k in reported})[0]
        mine[k] += 1
    return {k: n for k, n in mine.items() if n}


def test_between_two_reports_ranking_every_replica_sends_the_whole_burst_to_one():
    """Why `choose` draws two: a router's own requests are a small share of each replica's queue, so
    under a shared stale report the least loaded replica stays the least loaded (every router does
    the same: on four GPUs single GPUs fell idle for a second at a time while others queued)."""
    assert _stale_burst(rank) == {"a": 100}
    rng = random.Random(7)
    spread = _stale_burst(lambda loads: choose(loads, 2, rng=rng))
    assert len(spread) >= 6 and max(spread, key=spread.get) == "a"
    assert "h" not in spread  # the busiest loses every draw it is in
    assert sum(spread.values()) == 100


def test_choose_tries_the_better_of_two_first_then_the_rest_least_loaded_first():
    loads = {k: ReplicaLoad(i) for i, k in enumerate("abcdef")}
    for seed in range(20):
        order = choose(loads, 2, rng=random.Random(seed))
        drawn = random.Random(seed).sample(list(loads), 2)
        assert order[0] == min(drawn, key=lambda k: loads[k].in_flight)
        assert order[1:] == [k for k in "abcdef" if k != order[0]]
    # as many draws as replicas (one GPU's two replicas), or 0: every replica ranked
    two = {"x": ReplicaLoad(3), "y": ReplicaLoad(1)}
    assert all(choose(two, 2, rng=random.Random(s)) == ["y", "x"] for s in range(10))
    assert choose(loads, 0) == list("abcdef")


def _context(replicas: int, requests: float, kv: dict, target_requests: float = 4, metric: str = "kv_usage"):
    from ray.serve._private.common import DeploymentID, ReplicaID
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    dep = DeploymentID(name="LLM", app_name="vlm")
    ids = [ReplicaID(f"r{i}", dep) for i in range(replicas)]
    config = AutoscalingConfig(min_replicas=1, max_replicas=8, target_ongoing_requests=target_requests)
    return AutoscalingContext(
        deployment_id=dep, deployment_name="LLM", app_name="vlm", current_num_replicas=replicas,
        target_num_replicas=replicas, running_replicas=ids, total_num_requests=requests, total_queued_requests=0,
        aggregated_metrics={metric: {ids[i]: v for i, v in kv.items()}}, raw_metrics={},
        capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=8, policy_state={},
        last_scale_up_time=None, last_scale_down_time=None, current_time=None, config=config)


def test_llm_policy_scales_on_requests_or_on_kv_use_whichever_asks_more():
    from app.serving.autoscaling import LLMAutoscalingPolicy

    policy = LLMAutoscalingPolicy(target_kv_usage=0.8)
    # 12 requests over 2 replicas, target 4 each: 3 replicas; KV half used: 1.25
    assert policy(_context(2, 12, {0: 0.5, 1: 0.5}))[0] == pytest.approx(3)
    # few requests but long prompts: the KV caches are nearly full, 2 x 0.96 / 0.8 = 2.4 replicas
    assert policy(_context(2, 2, {0: 0.96, 1: 0.96}))[0] == pytest.approx(2.4)
    # idle: scale down
    assert policy(_context(2, 0, {0: 0.0, 1: 0.0}))[0] == 0
    with pytest.raises(ValueError):
        LLMAutoscalingPolicy(target_kv_usage=0)


def test_router_policy_counts_the_requests_on_the_routers_own_port():
    from app.serving.autoscaling import RouterAutoscalingPolicy

    policy = RouterAutoscalingPolicy()
    # Serve counted 40 requests over 2 Routers, the shared port took 90 more: 130 / target 64 = 2.03 Routers
    assert policy(_context(2, 40, {0: 50.0, 1: 40.0}, 64, "direct_ongoing"))[0] == pytest.approx(130 / 64)
    # all the load on the shared port: Serve alone would see an idle deployment and scale it down
    assert policy(_context(2, 0, {0: 200.0, 1: 184.0}, 64, "direct_ongoing"))[0] == pytest.approx(6)
    # no Router reported yet (or the port is off): Serve's count alone, as Ray's default policy
    assert policy(_context(2, 96, {}, 64, "direct_ongoing"))[0] == pytest.approx(1.5)
    assert policy(_context(0, 96, {}, 64, "direct_ongoing"))[0] == 0  # cold start: Ray's target stands


def test_merged_reports_sum_counters_and_recompute_ratios():
    a = {"graph_hits": 3, "eager_batches": 1, "eager_reasons": {"tokens": 1}, "per_budget": {"256": 3},
         "real_tokens": 300, "padded_tokens": 100, "batches": 4, "pieces": 8, "batch_tokens": 300,
         "batch_budget_tokens": 400, "queue_wait_ms_mean": 2.0, "queue_wait_ms_max": 5.0, "cache_hits": 1}
    b = {"graph_hits": 1, "eager_batches": 2, "eager_reasons": {"tokens": 1, "frames": 1}, "per_budget": {"256": 1},
         "real_tokens": 100, "padded_tokens": 0, "batches": 1, "pieces": 2, "batch_tokens": 100,
         "batch_budget_tokens": 100, "queue_wait_ms_mean": 7.0, "queue_wait_ms_max": 9.0, "cache_hits": 0}
    m = merge_encoder_stats([a, b])
    assert (m["graph_hits"], m["eager_batches"], m["pieces"], m["cache_hits"]) == (4, 3, 10, 1)
    assert m["eager_reasons"] == {"tokens": 2, "frames": 1} and m["per_budget"] == {"256": 4}
    assert m["padding_ratio"] == pytest.approx(100 / 500) and m["batch_fill"] == pytest.approx(400 / 500)
    assert m["items_per_batch"] == pytest.approx(2) and m["queue_wait_ms_max"] == 9.0
    assert m["queue_wait_ms_mean"] == pytest.approx((2 * 8 + 7 * 2) / 10)
    assert m["num_replicas"] == 2 and m["replicas"] == [a, b]

    loads = merge_llm_loads([{"replica": "y", "running": 2, "waiting": 1, "kv_usage": 0.5},
                             {"replica": "x", "running": 1, "waiting": 0, "kv_usage": 0.1}])
    assert (loads["running"], loads["waiting"], loads["num_replicas"]) == (3, 1, 2)
    assert loads["kv_usage"] == pytest.approx(0.3) and loads["kv_usage_max"] == 0.5
    assert [r["replica"] for r in loads["replicas"]] == ["x", "y"]


def test_the_ray_router_backs_off_when_no_replica_has_room_and_puts_the_drawn_one_first():
    """deployments/routing.py's adapter: every replica is ranked, so Ray's routing loop must back off
    before asking again (with FIFOMixin alone `should_backoff` stayed False: a loop of re-probes)."""
    import asyncio
    from types import SimpleNamespace

    pytest.importorskip("ray")
    from deployments.routing import LeastLoadedRouter

    replicas = [SimpleNamespace(replica_id=k, routing_stats={"running": n}) for k, n in (("a", 5), ("b", 1), ("c", 9))]
    router = SimpleNamespace(replica_queue_len_cache={}, sample=0, waiting_weight=1.0, kv_weight=8.0)
    pending = SimpleNamespace(routing_context=SimpleNamespace(should_backoff=False))
    ranks = asyncio.run(LeastLoadedRouter.choose_replicas(router, replicas, pending))
    assert pending.routing_context.should_backoff is True
    assert [[r.replica_id for r in rank] for rank in ranks] == [["b"], ["a"], ["c"]]


def test_the_ray_router_ranks_its_own_nodes_replicas_first_when_the_handle_prefers_them():
    """A handle with `_prefer_local_routing` (placement.prefer_local_node): the first try ranks the
    replicas of the caller's node only, least loaded first, without backing off; the next try all of
    them, with backoff (Ray's LocalityMixin keeps the try count in the request's routing context)."""
    import asyncio
    from types import SimpleNamespace

    pytest.importorskip("ray")
    from ray.serve._private.request_router.request_router import LocalityScope

    from deployments.routing import LeastLoadedRouter

    router = LeastLoadedRouter.__new__(LeastLoadedRouter)  # the state Ray's constructor would set
    router._replica_queue_len_cache = {}
    router.sample, router.waiting_weight, router.kv_weight = 0, 1.0, 8.0
    router._prefer_local_node_routing, router._prefer_local_az_routing = True, False
    router._replica_id_set = {"a", "b", "c"}
    router._colocated_replica_ids = {LocalityScope.NODE: {"a", "c"}, LocalityScope.AVAILABILITY_ZONE: set()}
    replicas = [SimpleNamespace(replica_id=k, routing_stats={"running": n}) for k, n in (("a", 5), ("b", 1), ("c", 9))]
    context = SimpleNamespace(tried_same_node=False, tried_same_az=False, should_backoff=False)
    pending = SimpleNamespace(routing_context=context)
    first = asyncio.run(LeastLoadedRouter.choose_replicas(router, replicas, pending))
    assert [[r.replica_id for r in rank] for rank in first] == [["a"], ["c"]] and context.should_backoff is False
    again = asyncio.run(LeastLoadedRouter.choose_replicas(router, replicas, pending))
    assert [[r.replica_id for r in rank] for rank in again] == [["b"], ["a"], ["c"]] and context.should_backoff is True
    router._prefer_local_node_routing = False  # the default: every replica at once
    context.tried_same_node = False
    assert len(asyncio.run(LeastLoadedRouter.choose_replicas(router, replicas, pending))) == 3
