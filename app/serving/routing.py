"""Which LLM replica gets the next request: the less loaded of two drawn at random, by a score every
router can compute (`ReplicaLoad.score`).

A replica's load is what its engine reports every `request_routing_stats_period_s` (running and
waiting requests, the fraction of its KV cache in use) and, fresher, the number of requests the
calling handle knows to be in flight there (Ray Serve's queue-length cache: probes, plus one for
every request sent, minus one for every request finished). Ties are broken at random, so routers with
the same view do not all pick the same replica; why two random draws rather than the least loaded of
all: `choose`. No Ray import: deployments/routing.py adapts this to Ray Serve's RequestRouter.
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Mapping
from dataclasses import dataclass

DEFAULT_WAITING_WEIGHT = 1.0
DEFAULT_KV_WEIGHT = 8.0
DEFAULT_SAMPLE = 2  # replicas drawn per request (0: rank them all)


@dataclass(frozen=True)
class ReplicaLoad:
    in_flight: int | None = None  # requests the caller knows to be at the replica; None = unknown
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0

    @classmethod
    def from_stats(cls, in_flight: int | None, stats: Mapping | None) -> ReplicaLoad:
        """From a replica's routing stats (the engine's load report; empty before the first one)."""
        stats = stats or {}
        return cls(in_flight, int(stats.get("running", 0)), int(stats.get("waiting", 0)),
                   float(stats.get("kv_usage", 0.0)))

    def score(self, waiting_weight: float = DEFAULT_WAITING_WEIGHT, kv_weight: float = DEFAULT_KV_WEIGHT) -> float:
        """max(in flight, running + waiting) + waiting_weight * waiting + kv_weight * kv_usage.

        - Requests in flight are the queue a new request joins: more of them, more decode steps shared.
          Each count errs its own way: the engine's report lags by up to a stats period, and the
          handle's count undercounts long streams (Ray forgets an entry after 10 s, and the streams
          sent before then still decrement it when they finish: seen at 0 in flight beside 6
          running). The larger is taken.
        - A waiting request means the engine has no room (slots or KV blocks): it is counted again.
        - KV use near 1 means new prompts will wait or preempt others; `kv_weight` turns a full cache
          into that many requests' worth of load (8 by default: a replica with a full cache loses to
          one with up to 8 more requests in flight and an empty cache)."""
        queued = max(self.in_flight or 0, self.running + self.waiting)
        return queued + waiting_weight * self.waiting + kv_weight * self.kv_usage


def rank(loads: Mapping[Hashable, ReplicaLoad], waiting_weight: float = DEFAULT_WAITING_WEIGHT,
         kv_weight: float = DEFAULT_KV_WEIGHT, rng: random.Random | None = None) -> list[Hashable]:
    """Replica keys, least loaded first."""
    rng = rng or random
    return sorted(loads, key=lambda k: (loads[k].score(waiting_weight, kv_weight), rng.random()))


def choose(loads: Mapping[Hashable, ReplicaLoad], sample: int = DEFAULT_SAMPLE,
           waiting_weight: float = DEFAULT_WAITING_WEIGHT, kv_weight: float = DEFAULT_KV_WEIGHT,
           rng: random.Random | None = None) -> list[Hashable]:
    """Replica keys in the order to try them: the least loaded of `sample` replicas drawn at random,
    then the others, least loaded first (where the first has no room). `sample` 0, or at least the
    number of replicas, ranks them all (one GPU's two replicas: the same).

    Why not the least loaded of all: every router sees the same report, up to a second old, and its
    own count of requests in flight is a small share of a replica's queue (a dozen routers split the
    traffic), so until the next report every router sent everything to the one replica that had
    reported the least, and single GPUs idled for a second at a time while the others queued
    (benchmarks/results/2026-11-26-four-gpus-at-last.md). Two random draws keep most requests off the
    busiest replicas without all landing on one (benchmarks/routing_model.py models it; measured in
    benchmarks/results/2026-11-26-routing-ab-four-h100s-poisson.md)."""
    rng = rng or random
    if not 0 < sample < len(loads):
        return rank(loads, waiting_weight, kv_weight, rng)
    drawn = rng.sample(list(loads), sample)
    first = rank({k: loads[k] for k in drawn}, waiting_weight, kv_weight, rng)[0]
    return [first, *rank({k: v for k, v in loads.items() if k != first}, waiting_weight, kv_weight, rng)]
