"""The MoE router (app/llm/moe_routing.py): its dispatch on the CPU, and on CUDA the routing kernel
against torch and the fused few-token kernel against the unfused path, eager and replayed in a graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from app.llm import moe_routing
from app.llm.moe_routing import FUSED_ROUTER_MAX_TOKENS, route_tokens, route_topk, route_topk_torch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("tokens", [1, 2, 9])
def test_route_tokens_on_the_cpu_is_torchs_linear_softmax_topk(tokens):
    g = torch.Generator().manual_seed(tokens)
    h = torch.randn(tokens, 64, generator=g)
    w = torch.randn(16, 64, generator=g)
    ids, weights = route_tokens(h, w, 4, True)
    probs = torch.softmax(h @ w.t(), dim=-1)
    want_w, want_ids = torch.topk(probs, 4, dim=-1)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w / want_w.sum(-1, keepdim=True), rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_triton_routing_picks_torchs_experts_and_weights(tokens, renormalize):
    g = torch.Generator(device="cuda").manual_seed(tokens)
    logits = torch.randn(tokens, 128, generator=g, device="cuda").to(torch.bfloat16)
    ids, weights = route_topk(logits, 8, renormalize, torch.bfloat16)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    want_w, want_ids = torch.topk(probs, 8, dim=-1)
    if renormalize:
        want_w = want_w / want_w.sum(-1, keepdim=True)
    # the same experts' probabilities in the same order (bf16 logits tie now and then: either expert of
    # a tie is right)
    assert torch.equal(torch.gather(probs, 1, ids.long()), torch.gather(probs, 1, want_ids))
    # weights within one bf16 rounding of torch's (exp differs in the last float32 bits)
    assert (weights.float() - want_w.to(torch.bfloat16).float()).abs().max() <= 2 ** -8


def _exact_inputs(tokens: int, experts: int, hidden: int, seed: int):
    """bf16 hidden states and router weights whose logits are exact in bf16, whatever the order of the
    sums and wherever they round: 16 entries of +-1 per token against multiples of 1/64 up to 1/8, so
    every partial sum is a multiple of 1/64 below 2 in magnitude (8 significant bits). The linear
    layer and the fused kernel then hold the same logits, and the routing must agree bit for bit."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.zeros(tokens, hidden, device="cuda")
    for t in range(tokens):
        at = torch.randperm(hidden, generator=g, device="cuda")[:16]
        h[t, at] = torch.randint(0, 2, (16,), generator=g, device="cuda").float() * 2 - 1
    w = torch.randint(-8, 9, (experts, hidden), generator=g, device="cuda") / 64
    return h.to(torch.bfloat16), w.to(torch.bfloat16)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("shape", [(128, 2048, 8), (128, 4096, 8), (60, 300, 4)])  # 30B, 235B, odd sizes
@pytest.mark.parametrize("tokens", list(range(1, FUSED_ROUTER_MAX_TOKENS + 1)))
def test_fused_router_equals_the_linear_layer_then_the_routing_kernel(tokens, shape, renormalize):
    experts, hidden, k = shape
    h, w = _exact_inputs(tokens, experts, hidden, seed=tokens * 7 + hidden)
    ids, weights = route_tokens(h, w, k, renormalize)
    logits = F.linear(h, w)
    want_ids, want_w = route_topk(logits, k, renormalize, torch.bfloat16)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_w)
    # and transformers' routing in torch ops picks experts of the same probabilities
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    ref_ids, _ = route_topk_torch(logits, k, renormalize, torch.bfloat16)
    assert torch.equal(torch.gather(probs, 1, ids.long()), torch.gather(probs, 1, ref_ids))


@pytest.mark.gpu
@needs_cuda
def test_fused_router_on_random_weights_picks_the_experts_of_the_largest_logits():
    """Random bf16 inputs: the logits' float32 sums differ from cuBLAS's in order, so a bf16 logit may
    round one step apart; every chosen expert's probability is then within that of the true k-th."""
    g = torch.Generator(device="cuda").manual_seed(3)
    for _ in range(20):
        h = torch.randn(1, 2048, generator=g, device="cuda").to(torch.bfloat16)
        w = (torch.randn(128, 2048, generator=g, device="cuda") * 2048 ** -0.5).to(torch.bfloat16)
        ids, weights = route_tokens(h, w, 8, True)
        exact = h.float() @ w.float().t()
        kth = torch.topk(exact, 8, dim=-1).values[:, -1:]
        assert (torch.gather(exact, 1, ids.long()) >= kth - 2 ** -6 * exact.abs().max()).all()
        assert torch.allclose(weights.float().sum(-1), torch.ones(1, device="cuda"), atol=2e-2)


@pytest.mark.gpu
@needs_cuda
def test_fused_router_replays_in_the_engines_cuda_graph_and_leaves_its_counter_at_zero():
    """Captured as the engine captures (cuda_graphs._capture: a warm-up on a side stream, then the capture
    on it): the graph holds the fused kernel, not the fallback, and replays it on new inputs."""
    from app.llm.cuda_graphs import _capture

    h, w = _exact_inputs(1, 128, 2048, seed=5)
    out = {}

    def step():
        out["ids"], out["weights"] = route_tokens(h, w, 8, True)

    before = moe_routing.capture_fallbacks
    graph = _capture(step, h.device, torch.cuda.graph_pool_handle())
    assert moe_routing.capture_fallbacks == before  # the capture stream had its counter: the fused kernel
    for seed in range(6, 10):
        h2, w2 = _exact_inputs(1, 128, 2048, seed=seed)
        h.copy_(h2)
        w.copy_(w2)
        graph.replay()
        torch.cuda.synchronize()
        want_ids, want_w = route_topk(F.linear(h, w), 8, True, torch.bfloat16)
        assert torch.equal(out["ids"], want_ids) and torch.equal(out["weights"], want_w)
    assert all(int(c.item()) == 0 for c in moe_routing._counters.values())


@pytest.mark.gpu
@needs_cuda
def test_a_capture_on_a_stream_without_warm_up_falls_back_and_says_so():
    h, w = _exact_inputs(1, 128, 2048, seed=11)
    stream = torch.cuda.Stream()
    # torch hands streams out of a pool: forget any counter an earlier test made for this one
    moe_routing._counters.pop((h.device.index, stream.cuda_stream), None)
    before = moe_routing.capture_fallbacks
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):  # a stream no eager call has met
        ids, weights = route_tokens(h, w, 8, True)
    graph.replay()
    torch.cuda.synchronize()
    assert moe_routing.capture_fallbacks == before + 1
    want_ids, want_w = route_topk(F.linear(h, w), 8, True, torch.bfloat16)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_w)
