"""The MoE router (app/llm/moe_routing.py): the linear logits then top-k on the CPU, and on CUDA the
routing kernel against torch, eager and replayed in the engine's CUDA graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from app.llm.moe_routing import route_tokens, route_topk

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
    every partial sum is a multiple of 1/64 below 2 in magnitude (8 significant bits). Eager and replayed
    GEMMs then hold the same logits, and the routing must agree bit for bit."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.zeros(tokens, hidden, device="cuda")
    for t in range(tokens):
        at = torch.randperm(hidden, generator=g, device="cuda")[:16]
        h[t, at] = torch.randint(0, 2, (16,), generator=g, device="cuda").float() * 2 - 1
    w = torch.randint(-8, 9, (experts, hidden), generator=g, device="cuda") / 64
    return h.to(torch.bfloat16), w.to(torch.bfloat16)


@pytest.mark.gpu
@needs_cuda
def test_routing_replays_in_the_engines_cuda_graph():
    """Captured as the engine captures (cuda_graphs._capture: a warm-up on a side stream, then the capture
    on it): the graph replays the logits GEMM and the routing kernel on new inputs, as eager calls route."""
    from app.llm.cuda_graphs import _capture

    h, w = _exact_inputs(1, 128, 2048, seed=5)
    out = {}

    def step():
        out["ids"], out["weights"] = route_tokens(h, w, 8, True)

    graph = _capture(step, h.device, torch.cuda.graph_pool_handle())
    for seed in range(6, 10):
        h2, w2 = _exact_inputs(1, 128, 2048, seed=seed)
        h.copy_(h2)
        w.copy_(w2)
        graph.replay()
        torch.cuda.synchronize()
        want_ids, want_w = route_topk(F.linear(h, w), 8, True, torch.bfloat16)
        assert torch.equal(out["ids"], want_ids) and torch.equal(out["weights"], want_w)
