"""Decode speed of the engine for any preset shape, on one GPU or tensor-parallel over several.

Random weights made on the GPU (`load_format: dummy`: a 30B or 235B checkpoint is never written),
the preset's config and tokenizer from a config-only folder. Each rank runs a whole engine; every
rank is handed the same requests in one batch under the engine's lock, so every rank's scheduler
plans the same steps and their collectives meet (the lockstep a tensor-parallel replica needs).
Rank 0 times:
- single-stream decode tok/s (first token to last, median of 3);
- 64 streams' aggregate tok/s (and per-stream median);
- TTFT of one 1000-token prompt alone;
- KV capacity (blocks, tokens) and start-up time.

    python benchmarks/decode.py --preset qwen3-vl-30b-a3b --out $OUT/moe30b.json
    python benchmarks/decode.py --preset qwen3-vl-32b --tp 2 --out $OUT/dense32b_tp2.json
    python benchmarks/decode.py --preset qwen3-vl-235b-a22b --layers 24 --tp 4   # a reduced-layer variant
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def checkpoint_folder(preset: str, layers: int | None, root: Path) -> Path:
    """A config-only folder for the preset (weights come from `load_format: dummy`)."""
    from app.checkpoints.model_builder import build_checkpoint, load_preset

    out = root / f"{preset}-{layers or 'all'}"
    if (out / "vlm_serve_builder.json").is_file():
        return out
    spec = load_preset(preset)
    if layers:
        spec["text_config"]["num_hidden_layers"] = layers
    path = Path(build_checkpoint(out, preset, with_weights=False))
    if layers:  # build_checkpoint rereads the preset: put the reduced depth back
        cfg = json.loads((path / "config.json").read_text())
        cfg["text_config"]["num_hidden_layers"] = layers
        (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


def run_batch(engine, reqs) -> list:
    """Submit `reqs` in one go (one step takes them all, on every rank alike); wait for the last token."""
    done, ends = threading.Event(), {}
    seqs = []

    def sink_for(i):
        def sink(delta):
            if delta.finish_reason or delta.error is not None:
                ends[i] = time.perf_counter()
                if len(ends) == len(reqs):
                    done.set()
        return sink

    with engine._cv:
        for i, r in enumerate(reqs):
            seqs.append(engine.submit(r, sink_for(i)))
    done.wait(900)
    return [(s, ends[i]) for i, s in enumerate(seqs)]


def requests(n: int, prompt: int, new: int, vocab: int, seed: int, avoid: tuple[int, ...]):
    """Random text prompts (never a vision placeholder id: `avoid`)."""
    from app.llm.sampling import SamplingParams
    from app.llm.sequence import GenerationRequest

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = rng.integers(0, min(vocab, 150000), prompt)
        ids[np.isin(ids, avoid)] = 0
        out.append(GenerationRequest(ids.tolist(), [0] * prompt, [],
                                     SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)))
    return out


def profile_decode(run, tokens: int) -> dict:
    """Kernels of a decode phase from CUPTI (graph replays included): which kernels, how many per token,
    and how much of the phase's wall time the GPU spent in kernels at all (the rest is gaps: launch
    latency, host waits)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        run()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    rows = []
    for e in prof.key_averages():
        dev = getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)
        if dev > 0:
            rows.append({"name": e.key[:90], "calls": e.count, "total_ms": dev / 1e3,
                         "per_token_us": dev / tokens, "calls_per_token": e.count / tokens})
    rows.sort(key=lambda r: -r["total_ms"])
    busy = sum(r["total_ms"] for r in rows)
    return {"tokens": tokens, "wall_ms": wall * 1e3, "kernel_ms": busy, "kernel_share_of_wall": busy / (wall * 1e3),
            "kernels_per_token": sum(r["calls"] for r in rows) / tokens, "top": rows[:40]}


def rank_main(rank: int, a, path: str, port: int, out: str) -> None:
    import torch.distributed as dist

    from app.llm.engine import Engine
    from app.llm.parallel import SINGLE, TensorParallel

    torch.cuda.set_device(rank)
    if a.direct_config:
        from app.llm import fused_moe

        tiles, pick = json.loads(Path(a.direct_config).read_text()), fused_moe.moe_config
        fused_moe.moe_config = lambda t, *rest: dict(tiles) if t <= fused_moe.DIRECT_MAX_TOKENS else pick(t, *rest)
    if a.no_weight_prefetch:
        from app.llm import gemv

        gemv.PREFETCH = False
    if a.legacy_moe:
        from app.llm import fused_moe, moe_routing

        fused_moe.DIRECT_MAX_TOKENS = 0
        moe_routing.route_topk = moe_routing.route_topk_torch
    tp = SINGLE
    if a.tp > 1:
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=a.tp,
                                device_id=torch.device("cuda", rank))
        tp = TensorParallel(rank, a.tp, moe=a.moe)
        if a.symm_all_reduce:
            from app.llm.symm_all_reduce import checked_symm_all_reduce

            tp.fast = checked_symm_all_reduce(None, torch.device("cuda", rank), torch.bfloat16, rank)
    t0 = time.perf_counter()
    engine = Engine(path, "cuda", tp=tp, load_format="dummy", max_model_len=a.max_model_len,
                    max_num_seqs=a.max_num_seqs, gpu_memory_utilization=a.gpu_memory_utilization,
                    decode_gemv=not a.no_gemv, decode_gemv_split=a.gemv_split, pdl=a.pdl,
                    **({"decode_kv_splits": 1} if a.no_kv_split else {}))
    res = {"preset": a.preset, "layers": engine.spec.layers, "tp": a.tp, "moe": a.moe, "legacy_moe": a.legacy_moe,
           "no_kv_split": a.no_kv_split, "no_gemv": a.no_gemv, "no_weight_prefetch": a.no_weight_prefetch,
           "gemv_split": a.gemv_split, "pdl": a.pdl,
           "gemv": engine.model.gemv.as_dict(), "symm_all_reduce": a.tp > 1 and tp.fast is not None,
           "direct_config": json.loads(Path(a.direct_config).read_text()) if a.direct_config else None,
           "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "engine_start_s": time.perf_counter() - t0, "kv_blocks": engine.blocks.usable_blocks,
           "kv_tokens": engine.blocks.usable_blocks * engine.blocks.block_size,
           "weights_gib_per_rank": sum(p.numel() * p.element_size() for p in engine.model.parameters()) / 2**30}
    vocab, seed = engine.spec.vocab, 0

    def phase(n, prompt, new):
        nonlocal seed
        seed += 1
        if tp.enabled:
            dist.barrier()
        t = time.perf_counter()
        ends = run_batch(engine, requests(n, prompt, new, vocab, seed, engine.vision_ids))
        wall = max(e for _, e in ends) - t
        rates = [(new - 1) / (e - s.first_token_time) for s, e in ends]
        return {"streams": n, "wall_s": wall, "aggregate_tok_s": n * new / wall,
                "per_stream_decode_tok_s_median": float(np.median(rates)),
                "ttft_ms_median": 1e3 * float(np.median([s.first_token_time - t for s, _ in ends]))}

    phase(4, 32, 8)  # warm-up
    phase(2, 1100, 2)
    singles = [phase(1, a.prompt, a.new) for _ in range(3)]
    res["single"] = singles
    res["single_decode_tok_s"] = float(np.median([r["per_stream_decode_tok_s_median"] for r in singles]))
    res["concurrent"] = phase(a.streams, a.prompt, a.new)
    res["ttft_1000_ms"] = float(np.median([phase(1, 1000, 1)["ttft_ms_median"] for _ in range(5)]))
    if a.profile:
        res["profile"] = profile_decode(lambda: phase(a.profile, a.prompt, 64), a.profile * 64)
    host = engine.stats()["host_ms_median_by_batch"]
    res["host_ms_by_batch"] = {str(k): v for k, v in host.items() if k in (1, 16, 64)}
    if rank == 0:
        Path(out).write_text(json.dumps(res, indent=1))
        print(json.dumps({k: v for k, v in res.items() if k != "single"}), flush=True)
    engine.shutdown()
    if tp.enabled:
        # Every rank's figures are in; tearing NCCL down hung past the call's limit on 2 and 4 H200s
        # (2026-11-27), so a rank leaves at once, as a killed process would, without the teardown.
        sys.stdout.flush()
        os._exit(0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--preset", default="qwen3-vl-30b-a3b")
    p.add_argument("--layers", type=int, default=None, help="a reduced-layer variant (same widths)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--moe", choices=["tp", "ep"], default="tp")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--cache", default=os.environ.get("VLM_SERVE_CACHE", "/tmp/vlm-serve-decode"))
    p.add_argument("--out", default="benchmarks/decode_results.json")
    p.add_argument("--no-weight-prefetch", action="store_true",
                   help="the matrix-vector kernel loads its first weight tile after its PDL wait, not before "
                        "(app/llm/gemv.py PREFETCH, as before 2026-12-06): an A/B in one device call")
    p.add_argument("--legacy-moe", action="store_true",
                   help="the MoE path before the routing kernel and the unsorted decode path (torch's router ops, "
                        "always sorted by expert): an A/B against today's in one device call")
    p.add_argument("--no-gemv", action="store_true",
                   help="cuBLAS for every projection (llm.decode_gemv false), for the A/B of app/llm/gemv.py")
    p.add_argument("--gemv-split", action=argparse.BooleanOptionalAction, default=True,
                   help="split-K tiles among the matrix-vector candidates (llm.decode_gemv_split, on by default); "
                        "--no-gemv-split for their A/B")
    p.add_argument("--pdl", action=argparse.BooleanOptionalAction, default=True,
                   help="programmatic dependent launch for the engine's Triton kernels (llm.pdl, on by default "
                        "since 2026-12-02); --no-pdl for its A/B")
    p.add_argument("--no-kv-split", action="store_true",
                   help="decode attention with one program per sequence and KV head, the keys never split (the path "
                        "before decode_kv_splits): an A/B in one device call")
    p.add_argument("--symm-all-reduce", action="store_true",
                   help="with --tp: the decode steps' all-reduces through symmetric memory instead of NCCL "
                        "(app/llm/symm_all_reduce.py): an A/B in one device call")
    p.add_argument("--direct-config", default=None, metavar="JSON_FILE",
                   help="tiles for the unsorted few-token MoE path (e.g. moe_kernel.py --sweep's best) instead of "
                        "moe_config's")
    p.add_argument("--profile", type=int, default=0, metavar="STREAMS",
                   help="also profile 64 decode steps of STREAMS streams with CUPTI (kernels per token, GPU share)")
    a = p.parse_args()
    path = str(checkpoint_folder(a.preset, a.layers, Path(a.cache)))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    if a.tp == 1:
        rank_main(0, a, path, 0, a.out)
    else:
        import torch.multiprocessing as mp

        mp.spawn(rank_main, args=(a, path, _port(), a.out), nprocs=a.tp, join=True)


if __name__ == "__main__":
    main()
