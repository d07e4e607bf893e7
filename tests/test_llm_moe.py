"""Qwen3-VL-MoE on our engine against transformers' `Qwen3VLMoeForConditionalGeneration`, fp32, CPU:
greedy answers token for token with images and video, prefill logits, and the expert weights in
every layout a checkpoint may hold them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import collect, make_request, ours, reference_generate


@pytest.fixture(scope="module")
def moe_world(model_cache):
    from transformers import AutoTokenizer, Qwen3VLMoeForConditionalGeneration

    from app.checkpoints.model_builder import ensure_embedded
    from app.llm.engine import Engine
    from app.media.spec import patch_spec_for
    from app.vision.graphs import GraphManager, GraphSettings
    from app.vision.loading import build_tower

    path = ensure_embedded("tiny-qwen3-vl-moe", model_cache)
    ref = Qwen3VLMoeForConditionalGeneration.from_pretrained(path).eval()
    mgr = GraphManager(build_tower(path, torch.float32), GraphSettings([256, 512]))
    return {"path": path, "ref": ref, "engine": Engine(str(path)), "tok": AutoTokenizer.from_pretrained(path),
            "spec": patch_spec_for(path), "mgr": mgr}


def test_the_tiny_preset_mixes_sparse_and_dense_layers(moe_world):
    s = moe_world["engine"].spec
    assert (s.experts, s.experts_per_token, s.expert_intermediate) == (8, 2, 48)
    assert s.sparse_layers == (0, 2) and s.layers == 3  # layer 1 is in mlp_only_layers
    assert [layer.sparse for layer in moe_world["engine"].model.layers] == [True, False, True]


@pytest.mark.parametrize("kinds", [[], ["image"], ["video"], ["image", "video"]])
def test_greedy_equals_transformers_generate(moe_world, kinds):
    req, items, prompt = make_request(moe_world, kinds, max_tokens=12)
    got, chunks = ours(moe_world, req)
    want = reference_generate(moe_world, prompt, items, max_new=12)
    eos = moe_world["engine"].eos_ids
    assert got == [t for t in want if t not in eos]
    assert chunks[-1].finish_reason == ("stop" if want[-1] in eos else "length")


def test_several_requests_batched_equal_each_alone(moe_world):
    """Routing is per token: requests decoded side by side (one fused MoE call over all their rows)
    answer what each answers alone."""
    eng = moe_world["engine"]
    reqs = [make_request(moe_world, kinds, data_seed=i, words=3 * i, max_tokens=8)[0]
            for i, kinds in enumerate([["image"], [], ["video"], ["image", "image"]])]
    alone = [ours(moe_world, r)[0] for r in reqs]
    seqs = [eng.submit(r) for r in reqs]
    together = [collect(seq)[0] for seq in seqs]
    assert together == alone


def _expert_sources(moe_world, layout: str):
    """The checkpoint's tensors with the experts rewritten as a Hub checkpoint file holds them
    ([E, hidden, 2 units] / [E, units, hidden]) or one tensor per expert (Qwen3-MoE's names)."""
    from app.llm.weights import TensorSource

    for name, t in moe_world["ref"].state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
            if layout == "file":
                yield TensorSource.of(name, t.transpose(1, 2).contiguous())
            else:
                base = name.rsplit(".", 1)[0]
                for e in range(t.shape[0]):
                    if name.endswith("gate_up_proj"):
                        gate, up = t[e].chunk(2, dim=0)
                        yield TensorSource.of(f"{base}.{e}.gate_proj.weight", gate)
                        yield TensorSource.of(f"{base}.{e}.up_proj.weight", up)
                    else:
                        yield TensorSource.of(f"{base}.{e}.down_proj.weight", t[e])
        else:
            yield TensorSource.of(name, t)


@pytest.mark.parametrize("layout", ["file", "per_expert"])
def test_expert_weights_load_from_every_layout(moe_world, layout):
    from app.llm.model import TextModel
    from app.llm.weights import load_weights

    eng = moe_world["engine"]
    other = TextModel(eng.spec, torch.float32, torch.device("cpu"), 64)
    load_weights(other, _expert_sources(moe_world, layout))
    for (name, a), (_, b) in zip(eng.model.named_parameters(), other.named_parameters()):
        assert torch.equal(a, b), name


def test_our_forward_equals_transformers_logits(moe_world):
    """Prefill logits of a prompt with an image and a video, every position, fp32."""
    logits, ref = _prefill_logits(moe_world)
    assert (logits - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_experts_left_unsummed_reach_the_same_logits(moe_world, monkeypatch):
    """On one GPU a few tokens' expert rows come back unsummed ([T, k, hidden]) and the next add+RMSNorm,
    the deepstack sum or the final norm adds them up. Here the reference's sum is split into k rows (the
    first the sum, the rest zeros): the model's plumbing must give the very same logits."""
    from app.llm import model as model_module

    whole = model_module.moe_forward
    unsummed = []

    def split(*args, sum_k=True, **kw):
        out = whole(*args, **kw)
        if sum_k:
            return out
        parts = torch.zeros(out.shape[0], moe_world["engine"].spec.experts_per_token, out.shape[1], dtype=out.dtype)
        parts[:, 0] = out
        unsummed.append(parts.shape)
        return parts

    want, _ = _prefill_logits(moe_world)
    monkeypatch.setattr(model_module, "moe_forward", split)
    got, _ = _prefill_logits(moe_world)
    assert len(unsummed) == 2 and torch.equal(got, want)  # both sparse layers, one of them a deepstack layer


def _prefill_logits(moe_world) -> tuple[torch.Tensor, torch.Tensor]:
    """(our prefill logits, transformers') of a prompt with an image and a video, fp32."""
    from app.llm.attention import AttentionMetadata
    from app.llm.model import VisionBatch
    from app.llm.sequence import Sequence

    eng = moe_world["engine"]
    req, items, prompt = make_request(moe_world, ["image", "video"], words=5)
    img, vid = items
    kw = dict(pixel_values=torch.from_numpy(img.pixel_values), image_grid_thw=torch.tensor([img.grid]),
              pixel_values_videos=torch.from_numpy(vid.pixel_values), video_grid_thw=torch.tensor([vid.grid]))
    with torch.no_grad():
        ref = moe_world["ref"](input_ids=torch.tensor([prompt.input_ids]),
                               mm_token_type_ids=torch.tensor([prompt.mm_token_type_ids]), **kw).logits[0]
    seq = Sequence(req, rope=eng.rope, vision_ids=eng.vision_ids, max_model_len=4096, block_size=4,
                   device=torch.device("cpu"), dtype=torch.float32)
    n, s = len(seq), eng.spec
    kv = torch.zeros(s.layers, 2, 4 * (n // 4 + 1), s.kv_heads, s.head_dim)
    table = list(range(n // 4 + 1))
    slots = torch.arange(n)
    meta = AttentionMetadata(*[None] * 6, block_q=8, block_size=4, host_query_start=np.array([0, n]),
                             host_seq_lens=np.array([n]), host_block_tables=[table])
    offs, r0, r1 = seq.vision_rows(0, n)
    vision = VisionBatch.from_rows(torch.from_numpy(offs), seq.vision_main[r0:r1], seq.vision_deepstack[:, r0:r1], n)
    with torch.no_grad():
        logits = eng.model.logits(eng.model(torch.tensor(seq.token_ids), torch.from_numpy(seq.positions(0, n)),
                                            slots, kv, meta, vision))
    return logits, ref


def _cuda(req):
    for v in req.vision:
        v.main, v.deepstack = v.main.cuda(), [d.cuda() for d in v.deepstack]
    return req


@pytest.mark.gpu
def test_moe_on_gpu_in_graphs_equals_transformers_generate(moe_world):
    """The fused MoE kernel inside decode and step graphs (fp32), answers against transformers'."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from app.llm.engine import Engine

    eng = Engine(str(moe_world["path"]), device="cuda", dtype="float32", max_model_len=512, max_num_seqs=8,
                 max_num_batched_tokens=64, num_kv_blocks=256)
    assert eng.runner.graphs and eng.runner.step_graphs
    for i, kinds in enumerate([["image"], [], ["video"], ["image", "video"]]):
        req, items, prompt = make_request(moe_world, kinds, data_seed=i, words=4 * i, max_tokens=12)
        got = [t for c in eng.generate(_cuda(req)) for t in c.token_ids]
        want = reference_generate(moe_world, prompt, items, max_new=12)
        assert got == [t for t in want if t not in eng.eos_ids], kinds
    assert eng.graph_steps > 0 and eng.step_graph_steps > 0
    eng.shutdown()


def test_a_config_only_checkpoint_serves_with_dummy_weights(tmp_path):
    """`load_format: dummy`: a folder with config, tokenizer and processor files and no weights (as the
    30B and 235B shapes are built) serves an image request end to end: tower and LLM made on the device."""
    import asyncio

    from app.checkpoints.model_builder import build_checkpoint
    from app.config import AppConfig
    from app.media.synthetic import image_bytes
    from app.serving.fused import FusedBackend
    from helpers import local_chat

    path = build_checkpoint(tmp_path / "moe", "tiny-qwen3-vl-moe", with_weights=False)
    assert not list(path.glob("*.safetensors"))
    cfg = AppConfig(model=str(path), llm={"load_format": "dummy", "max_num_batched_tokens": 64},
                    encoder={"min_budget": 64, "max_budget": 1024})
    chat = local_chat(cfg, path, backend=FusedBackend.build(cfg, str(path)))
    import base64

    url = "data:image/png;base64," + base64.b64encode(image_bytes(96, 128, 5, "PNG")).decode()
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": "What is this?"}]}],
            "max_tokens": 5, "temperature": 0, "ignore_eos": True}

    async def go():
        return await chat.complete(*(await chat.prepare(body)))

    answer = asyncio.run(go())
    assert answer["usage"]["completion_tokens"] == 5
    assert answer["usage"]["prompt_tokens_details"]["image_tokens"] > 0
