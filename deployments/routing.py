"""LeastLoadedRouter: Ray Serve request router for the LLM deployment (`request_router_config`).

Ray Serve's default router probes two random replicas and takes the one with fewer requests in
flight. This one scores replicas by app.serving.routing's score: requests in flight as the calling handle
knows them (Ray's queue-length cache), plus the engine's own report (`record_routing_stats` in
deployments/llm.py: running, waiting, KV use), and takes the less loaded of two drawn at random
(`app.serving.routing.choose`: a stale report shared by every router made them all pick the same replica).
Ranks are returned one replica each: Ray sends the request to the first that has room
(`max_ongoing_requests`), probing replicas whose queue length it does not know. Where the calling
handle prefers its own node (`placement.prefer_local_node`: the Router's handles), the first try ranks
that node's replicas only, and the next try every replica, as Ray's own router does (its locality mixin).
"""

from __future__ import annotations

import logging

from ray.serve.request_router import FIFOMixin, LocalityMixin, PendingRequest, RequestRouter, RunningReplica

from app.serving.routing import DEFAULT_KV_WEIGHT, DEFAULT_SAMPLE, DEFAULT_WAITING_WEIGHT, ReplicaLoad, choose

log = logging.getLogger("ray.serve")


class LeastLoadedRouter(FIFOMixin, LocalityMixin, RequestRouter):
    def initialize_state(self, waiting_weight: float = DEFAULT_WAITING_WEIGHT, kv_weight: float = DEFAULT_KV_WEIGHT,
                         sample: int = DEFAULT_SAMPLE, **_):
        """`request_router_kwargs` of the deployment's RequestRouterConfig."""
        self.waiting_weight, self.kv_weight, self.sample = float(waiting_weight), float(kv_weight), int(sample)
        log.info("LeastLoadedRouter for %s: waiting_weight %g, kv_weight %g, sample %d", self._deployment_id,
                 self.waiting_weight, self.kv_weight, self.sample)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_id = {r.replica_id: r for r in candidate_replicas}
        if pending_request is not None:
            # Every replica is in the ranks: when none has room (max_ongoing_requests), Ray should back
            # off before asking again. FIFOMixin alone left it False, and the routing loop then re-probed
            # every replica at once, again and again.
            pending_request.routing_context.should_backoff = True
            if getattr(self, "_prefer_local_node_routing", False):
                # the handle's own node first, once, without backing off (the mixin sets both)
                local = set(self.apply_locality_routing(pending_request)) & by_id.keys()
                by_id = {rid: by_id[rid] for rid in local} or by_id
        loads = {rid: ReplicaLoad.from_stats(self.replica_queue_len_cache.get(rid), r.routing_stats)
                 for rid, r in by_id.items()}
        order = choose(loads, getattr(self, "sample", DEFAULT_SAMPLE),
                       getattr(self, "waiting_weight", DEFAULT_WAITING_WEIGHT), getattr(self, "kv_weight", DEFAULT_KV_WEIGHT))
        return [[by_id[rid]] for rid in order]
