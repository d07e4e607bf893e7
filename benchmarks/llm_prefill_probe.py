"""Where a prefill step's time goes: host launches against device work, eager against a CUDA graph.

A Qwen3-VL-2B-shaped text model (random weights, bf16) in our engine, on one GPU:
- TTFT of a 1000-token prompt alone, engine only (no reader sharing the GIL), 20 runs, with the
  prompt's step from the engine's step log (seqs, tokens, host ms, wall ms);
- our forward (and the last row's logits) over 256, 1000 and 2000 tokens of one prompt, called on this
  thread: the host time to launch it, its CUDA-event time as launched, its wall time, its event time
  when queued behind a long kernel (every launch already made: the GPU's own time), and a CUDA graph
  of it replayed; median and p99;
- the CUDA kernels of a 1000-token forward (profiler, per forward).
Writes $OUT/probe_<pid>.json (run it twice for two processes).

    python3 benchmarks/llm_prefill_probe.py
"""

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.checkpoints.model_builder import build_tokenizer, load_preset  # noqa: E402
from app.llm.attention import AttentionMetadata, work_table  # noqa: E402
from app.llm.engine import Engine  # noqa: E402
from benchmarks.llm import Quiet, Reader, request, run_streams  # noqa: E402


def fwd_inputs(runner, t: int):
    """One prompt of t tokens laid out as an eager step lays it out, on blocks 1.. of a spare row."""
    dev = torch.device("cuda")
    lens = np.array([t], dtype=np.int32)
    qstart = np.array([0, t], dtype=np.int32)
    wseq, wq0 = work_table(lens, runner.prefill_block_q)
    nb = -(-t // runner.block_size)
    row = runner.max_num_seqs - 1
    runner.tables.tensor[row, :nb] = torch.arange(1, nb + 1, dtype=torch.int32, device=dev)
    meta = AttentionMetadata(torch.tensor(qstart, device=dev), torch.tensor(lens, device=dev),
                             torch.tensor([row], dtype=torch.int32, device=dev), runner.tables.tensor,
                             torch.tensor(wseq, device=dev), torch.tensor(wq0, device=dev), runner.prefill_block_q,
                             runner.block_size, host_query_start=qstart, host_seq_lens=lens)
    ids = torch.randint(0, 150000, (t,), dtype=torch.int32, device=dev)
    pos = torch.arange(t, dtype=torch.int32, device=dev).expand(3, t).contiguous()
    slots = torch.arange(runner.block_size, runner.block_size + t, dtype=torch.int32, device=dev)
    return ids, pos, slots, meta


def timed(step, a) -> dict:
    for _ in range(3):
        step(*a)
    torch.cuda.synchronize()
    launch, ev, wall = [], [], []
    for _ in range(30):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        s.record()
        step(*a)
        e.record()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        launch.append(1e3 * (t1 - t0))
        ev.append(s.elapsed_time(e))
        wall.append(1e3 * (t2 - t0))
    ev_q = []  # queued behind a long kernel: the device's own time for the eager launch sequence
    for _ in range(10):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(50e6))  # tens of ms of GPU spin, so that every launch is queued first
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        step(*a)
        e.record()
        torch.cuda.synchronize()
        ev_q.append(s.elapsed_time(e))
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(*a)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(g):
        step(*a)
    gr = []
    for _ in range(30):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        torch.cuda.synchronize()
        gr.append(s.elapsed_time(e))
    del g
    return {k: [round(float(np.median(v)), 3), round(float(np.percentile(v, 99)), 3)]
            for k, v in dict(launch_ms=launch, event_ms=ev, wall_ms=wall, queued_event_ms=ev_q, graph_ms=gr).items()}


def main() -> None:
    from transformers import AutoConfig, Qwen3VLForConditionalGeneration

    out = {"pid": os.getpid(), "affinity": sorted(os.sched_getaffinity(0))[:8], "ncpu": len(os.sched_getaffinity(0))}
    cfg = AutoConfig.for_model(**load_preset("qwen3-vl-2b"))
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3VLForConditionalGeneration._from_config(cfg, dtype=torch.bfloat16).eval()
    model.model.visual = None
    vocab = cfg.text_config.vocab_size
    t_start = time.perf_counter()
    engine = Engine.from_model(model, build_tokenizer(), "cuda", max_model_len=8192, max_num_seqs=256,
                               gpu_memory_utilization=0.6, overlap_steps=True)
    out["engine_start_s"] = round(time.perf_counter() - t_start, 2)
    out["step_graphs"] = len(getattr(engine.runner, "step_graphs", {}))
    reader = Reader(engine)
    run_streams(engine, reader, 4, 32, 8, vocab)
    run_streams(engine, reader, 2, 1100, 2, vocab)
    with Quiet(engine) as q:
        times, steps = [], []
        for _ in range(20):
            engine.step_log.clear()
            t0 = time.perf_counter()
            (seq,) = q.run([request(1000, 1, vocab)])
            times.append(1e3 * (seq.first_token_time - t0))
            steps.append([(r[0], r[1], round(1e3 * r[3], 2), round(1e3 * r[4], 2)) for r in engine.step_log])
    out["ttft_engine_only_ms"] = [round(x, 2) for x in times]
    out["ttft_steps"] = steps[-3:]

    runner, tm = engine.runner, engine.runner.model

    def step(ids, pos, slots, meta):
        h = tm(ids, pos, slots, runner.kv, meta)
        return tm.logits(h[-1:])

    res = {}
    with torch.inference_mode():
        for t in (256, 1000, 2000):
            res[t] = timed(step, fwd_inputs(runner, t))
            print(t, res[t], flush=True)
        out["forward"] = res
        a = fwd_inputs(runner, 1000)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                step(*a)
            torch.cuda.synchronize()
        ka = {}
        for evt in prof.key_averages():
            if evt.device_time_total > 0 and getattr(evt, "device_type", None) is not None \
                    and "CUDA" in str(evt.device_type):
                ka[evt.key[:60]] = (round(evt.device_time_total / 5, 1), evt.count // 5)
        out["kernels_us_per_forward"] = dict(sorted(ka.items(), key=lambda kv: -kv[1][0])[:20])
        out["kernel_total_us"] = round(sum(v[0] for v in ka.values()), 1)
    engine.shutdown()
    print(json.dumps(out, indent=1))
    Path(os.environ.get("OUT", "."), f"probe_{os.getpid()}.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
