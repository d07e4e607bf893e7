"""What one step's sampling costs over Qwen3-VL's vocabulary: greedy, the whole-vocabulary draw, and the draw
from each row's top-k candidates (app/llm/sampler.py), at several row counts.

Requests that leave out `temperature` take the checkpoint's generation_config, which for Qwen3-VL is
temperature 0.7, top_k 20, top_p 0.8: most real traffic samples. Every serving benchmark sends temperature 0,
so none of them times this. The sampler runs eagerly after the decode graph, once per step.

    python3 benchmarks/sampler.py [--rows 16 64 256] [--vocab 151936] [--repeats 20] [--json OUT]

Times are medians of `--repeats` runs after warm-up (CUDA events on a GPU, the wall clock on the CPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.llm.sampler import Sampler, SamplingBatch  # noqa: E402

QWEN3_VL_DEFAULTS = {"temperature": 0.7, "top_k": 20, "top_p": 0.8}


def make_batch(rows: int, device: torch.device, greedy: bool, all_top_k: bool) -> SamplingBatch:
    def full(v, dtype=torch.float32):
        return torch.full((rows,), v, dtype=dtype, device=device)

    d = QWEN3_VL_DEFAULTS
    return SamplingBatch(full(0.0 if greedy else d["temperature"]), full(0 if greedy else d["top_k"], torch.int32),
                         full(1.0 if greedy else d["top_p"]), torch.arange(rows, device=device),
                         torch.zeros(rows, dtype=torch.int64, device=device), full(0.0), full(0.0),
                         torch.arange(rows, device=device), all_greedy=greedy, max_top_k=0 if greedy else d["top_k"],
                         any_top_p=not greedy, all_top_k=all_top_k)


def whole_vocabulary_step(sampler: Sampler, logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """The sampler's step before the top-k draw (2026-12-04): greedy and the whole-vocabulary draw, per row."""
    x = sampler.penalized(logits[:, :sampler.vocab].float(), b)
    return torch.where(b.temperature > 0, sampler.drawn(x, b), x.argmax(-1))


def median_ms(fn, device: torch.device, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times)


def time_rows(rows: int, vocab: int, device: torch.device, repeats: int) -> dict[str, float]:
    """Median ms of one step of `rows` rows: greedy, the former whole-vocabulary step, the top-k draw."""
    sampler = Sampler(vocab, rows, device)
    logits = (torch.randn(rows, vocab, device=device) * 3).bfloat16().float()
    greedy, whole, cand = (make_batch(rows, device, True, False), make_batch(rows, device, False, False),
                           make_batch(rows, device, False, True))
    assert torch.equal(whole_vocabulary_step(sampler, logits, whole), sampler(logits, cand))  # the same tokens
    return {"greedy": median_ms(lambda: sampler(logits, greedy), device, repeats),
            "whole_vocabulary": median_ms(lambda: whole_vocabulary_step(sampler, logits, whole), device, repeats),
            "top_k_candidates": median_ms(lambda: sampler(logits, cand), device, repeats)}


def profile_draw(rows: int, vocab: int, device: torch.device) -> str:
    """Where a top-k draw's time goes: torch.profiler's table of 10 draws, by device time (host time on the CPU)."""
    from torch.profiler import ProfilerActivity, profile

    sampler = Sampler(vocab, rows, device)
    logits = (torch.randn(rows, vocab, device=device) * 3).bfloat16().float()
    cand = make_batch(rows, device, False, True)
    for _ in range(3):
        sampler(logits, cand)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(10):
            sampler(logits, cand)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    table = prof.key_averages().table(sort_by="cuda_time_total" if device.type == "cuda" else "cpu_time_total",
                                      row_limit=25)
    print(table, flush=True)
    return table


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", default=None)
    p.add_argument("--profile", type=int, default=0, metavar="ROWS",
                   help="also profile 10 top-k draws of ROWS rows (torch.profiler): the ops by device and host time")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    out = {"device": name, "vocab": a.vocab, "sampling": QWEN3_VL_DEFAULTS, "rows": []}
    print(f"| rows | greedy ms | whole vocabulary ms | top-k candidates ms | whole / candidates |  ({name})")
    print("|---|---|---|---|---|")
    with torch.inference_mode():
        for rows in a.rows:
            ms = time_rows(rows, a.vocab, device, a.repeats)
            out["rows"].append({"rows": rows, **{k: round(v, 4) for k, v in ms.items()}})
            print(f"| {rows} | {ms['greedy']:.3f} | {ms['whole_vocabulary']:.3f} | {ms['top_k_candidates']:.3f} | "
                  f"{ms['whole_vocabulary'] / ms['top_k_candidates']:.1f}x |", flush=True)
        if a.profile:
            out["profile"] = profile_draw(a.profile, a.vocab, device)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
