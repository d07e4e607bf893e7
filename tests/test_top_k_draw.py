"""The sampler's draw from each row's top-k candidates (`Sampler.drawn_from_top_k`) against the
whole-vocabulary draw it replaces for rows with a top_k (`Sampler.drawn`, itself checked against
transformers' warpers in test_sampling_extensions.py): the same token for the same seed, over Qwen3-VL's
vocabulary, with bf16-rounded logits (many ties), temperature, min-p and top-p; rows with and without a
top_k in one step; ties at the k-th logit; and the flag that lets a step skip the whole-vocabulary draw."""

from types import SimpleNamespace

import pytest
import torch
from transformers import LogitsProcessorList, TopKLogitsWarper, TopPLogitsWarper

from app.llm.sampler import TIE_ROOM, Sampler, SamplingBatch, host_sampling_flags
from app.llm.sampling import SamplingParams

QWEN_VOCAB = 151936


def batch(temperature, top_k, top_p, min_p=None, seed0=0, step=0, **flags) -> SamplingBatch:
    n = len(temperature)
    min_p = torch.zeros(n) if min_p is None else min_p
    return SamplingBatch(torch.as_tensor(temperature, dtype=torch.float32), torch.as_tensor(top_k, dtype=torch.int32),
                         torch.as_tensor(top_p, dtype=torch.float32), torch.arange(n) * 7 + seed0,
                         torch.full((n,), step), torch.zeros(n), torch.zeros(n), torch.arange(n),
                         min_p=torch.as_tensor(min_p, dtype=torch.float32), all_greedy=False,
                         max_top_k=int(max(top_k)), any_top_p=True, any_min_p=bool((min_p > 0).any()), **flags)


def test_the_top_k_draw_gives_the_whole_vocabulary_draw_s_tokens():
    """32 rows a case, six spreads of logits from nearly flat (0.05: thousands of bf16 ties) to peaked
    (30), random temperature, top_k 1-79, top_p (70% of rows) and min_p (30%): every token equal."""
    s = Sampler(QWEN_VOCAB, 32, torch.device("cpu"))
    for case, spread in enumerate([0.05, 0.5, 1.0, 3.0, 10.0, 30.0]):
        g = torch.Generator().manual_seed(case)
        logits = (torch.randn(32, QWEN_VOCAB, generator=g) * spread).bfloat16().float()
        pick = torch.rand(32, generator=g)
        b = batch(torch.rand(32, generator=g) * 1.5 + 0.05, torch.randint(1, 80, (32,), generator=g),
                  torch.where(pick < 0.7, torch.rand(32, generator=g), torch.ones(32)),
                  torch.where(torch.rand(32, generator=g) < 0.3, torch.rand(32, generator=g) * 0.2, torch.zeros(32)),
                  seed0=100 * case, step=case)
        assert torch.equal(s.drawn_from_top_k(logits, b), s.drawn(logits, b)), case


def test_ties_with_the_k_th_logit_are_kept_as_transformers_keeps_them():
    """Top-k 2 over logits where 40 tokens tie for second place: all 41 can be drawn, the same ones as the
    whole-vocabulary draw and transformers' TopKLogitsWarper keep; 300 seeds give the same tokens both ways."""
    vocab = 1000
    logits = torch.zeros(300, vocab)
    logits[:, 7] = 3.0
    tied = torch.arange(100, 140)
    logits[:, tied] = 1.0
    s = Sampler(vocab, 300, torch.device("cpu"))
    b = batch(torch.full((300,), 2.0), [2] * 300, torch.ones(300))
    got = s.drawn_from_top_k(logits, b)
    assert torch.equal(got, s.drawn(logits, b))
    kept = torch.isfinite(TopKLogitsWarper(2)(None, logits[:1].clone())[0]).nonzero().flatten()
    assert kept.tolist() == [7, *tied.tolist()]
    assert set(got.tolist()) <= set(kept.tolist()) and len(set(got.tolist())) > 20
    assert 40 < TIE_ROOM  # the ties fit among the candidates


def test_the_drawn_tokens_are_transformers_top_k_then_top_p_set_with_its_edge_s_ties():
    """Qwen3-VL's defaults (temperature 0.7, top_k 20, top_p 0.8) over a peaked bf16 row: 400 seeds draw
    every token that transformers' TopK then TopP warpers keep, and beyond them only the ties at its edge."""
    g = torch.Generator().manual_seed(5)
    row = (torch.randn(1, QWEN_VOCAB, generator=g) * 4).bfloat16().float()
    s = Sampler(QWEN_VOCAB, 400, torch.device("cpu"))
    b = batch(torch.full((400,), 0.7), [20] * 400, torch.full((400,), 0.8))
    got = set(s.drawn_from_top_k(row.expand(400, -1), b).tolist())
    warp = LogitsProcessorList([TopKLogitsWarper(20), TopPLogitsWarper(0.8)])
    kept = torch.isfinite(warp(None, row / 0.7)[0]).nonzero().flatten()
    # transformers cuts ties at the nucleus's edge by sort order; the sampler keeps every token tied with the
    # last one kept (top_p_filter, here a bf16 tie of two tokens at 4.2%)
    edge = row[0, kept].min()
    tied = set((row[0] == edge).nonzero().flatten().tolist())
    assert got == set(kept.tolist()) | tied and 1 < len(got) <= 20 and len(tied) == 2


def test_rows_with_and_without_a_top_k_in_one_step_each_draw_as_alone():
    """A step of rows with a top_k, rows without (whole vocabulary) and greedy rows: each row's token is the
    one it gets in a step of its own kind (all_top_k True where every sampled row has a top_k)."""
    g = torch.Generator().manual_seed(9)
    vocab = 5000
    logits = (torch.randn(6, vocab, generator=g) * 2).bfloat16().float()
    s = Sampler(vocab, 6, torch.device("cpu"))
    temperature, top_k, top_p = [0.8, 1.0, 0.0, 0.9, 1.2, 0.0], [20, 0, 0, 50, 0, 5], [0.8, 0.9, 1.0, 1.0, 1.0, 1.0]
    mixed = s(logits, batch(temperature, top_k, top_p))
    for i in range(6):
        if temperature[i] == 0:
            assert mixed[i] == logits[i].argmax()
            continue
        one = batch([temperature[i]], [top_k[i]], [top_p[i]], seed0=7 * i, all_top_k=top_k[i] > 0)  # its seed there
        assert s(logits[i:i + 1], one).item() == mixed[i].item(), i


def test_a_step_takes_the_top_k_draw_alone_only_where_every_sampled_row_has_a_top_k():
    def flags(*params):
        seqs = [SimpleNamespace(params=SamplingParams(**p)) for p in params]
        return host_sampling_flags(seqs, lambda s: False)[0]

    assert flags({"temperature": 0.7, "top_k": 20}, {"temperature": 0.0})["all_top_k"]  # greedy rows do not draw
    assert not flags({"temperature": 0.7, "top_k": 20}, {"temperature": 1.0})["all_top_k"]
    assert flags({"temperature": 0.7, "top_k": 20, "top_p": 0.8})["max_top_k"] == 20


def test_the_sampler_benchmark_times_the_three_steps_and_checks_they_agree(tmp_path):
    import json

    from benchmarks.sampler import main

    out = main(["--rows", "2", "8", "--vocab", "3000", "--repeats", "1", "--device", "cpu",
                "--json", str(tmp_path / "s.json"), "--profile", "4"])
    assert "aten::topk" in out["profile"]  # the draw's candidates, in the profile's table
    assert [r["rows"] for r in out["rows"]] == [2, 8] and out["device"] == "cpu"
    assert all(r[k] > 0 for r in out["rows"] for k in ("greedy", "whole_vocabulary", "top_k_candidates"))
    assert json.loads((tmp_path / "s.json").read_text()) == out


@pytest.mark.gpu
def test_on_a_gpu_the_top_k_draw_gives_the_whole_vocabulary_draw_s_tokens_and_the_cpu_s():
    """On CUDA, 256 rows at Qwen3-VL's defaults and 64 with random settings: the top-k draw equals the
    whole-vocabulary draw on the same GPU, and the CPU's draws over the same logits (the noise is integer
    arithmetic; the logits are bf16-rounded, so the float32 sums differ little)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(11)
    logits = (torch.randn(320, QWEN_VOCAB, generator=g) * 4).bfloat16().float()
    temperature = torch.cat([torch.full((256,), 0.7), torch.rand(64, generator=g) + 0.1])
    top_k = torch.cat([torch.full((256,), 20), torch.randint(1, 200, (64,), generator=g)])
    top_p = torch.cat([torch.full((256,), 0.8), torch.rand(64, generator=g)])
    cpu = batch(temperature, top_k, top_p, all_top_k=True)
    gpu = SamplingBatch(*(getattr(cpu, f).to(dev) for f in ("temperature", "top_k", "top_p", "seeds", "steps",
                                                             "frequency_penalty", "presence_penalty", "rows")),
                        min_p=cpu.min_p.to(dev), all_greedy=False, max_top_k=cpu.max_top_k, any_top_p=True,
                        all_top_k=True)
    s_gpu, s_cpu = Sampler(QWEN_VOCAB, 320, dev), Sampler(QWEN_VOCAB, 320, torch.device("cpu"))
    on_gpu = s_gpu(logits.to(dev), gpu)
    assert torch.equal(on_gpu, s_gpu.drawn(logits.to(dev), gpu))
    assert torch.equal(on_gpu.cpu(), s_cpu(logits, cpu))
