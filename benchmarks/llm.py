"""LLM engine benchmark: our engine against transformers' `generate`, side by side in one process.

A Qwen3-VL-2B-shaped model (random weights, bf16; speed does not depend on weight values), text
prompts of random token ids (distinct per request, so the prefix cache never flatters a number),
`ignore_eos` so every request generates exactly what it asks for.

Measures (the LLM-engine issue's targets):
- single-stream decode tok/s (first token to last), ours and transformers';
- 64 concurrent streams, aggregate tok/s;
- TTFT of one 1000-token prompt alone (ours and transformers');
- TTFT of 1000-token prompts arriving while 64 streams decode (p50/p99), and those streams' rate;
- host time per decode step at batch 1, 16 and 64 (the engine's own step log);
- KV-cache bytes per token;
- with --profile, the CUDA kernels of a decode step at batch 1 and 64;
- with --logprobs-cost (only this phase): 64 streams decoding with and without log-probabilities
  (top 5), alternating: what asking for them costs in tok/s and host time per step;
- with --rollouts N (only this phase): N samples of one 1000-token prompt (reinforcement-learning
  rollouts) as one request with `n=N` against N requests of that prompt, sent one after another and
  all at once, alternating: wall time, first and last choice's TTFT, and the prompt tokens computed;
- with --structured-cost (only this phase): 64 streams with and without a JSON schema (`response_format`),
  alternating: what a format costs in tok/s and host time per decode step;
- with --sampling-cost (only this phase): 64 streams greedy and at Qwen3-VL's sampling defaults (temperature
  0.7, top_k 20, top_p 0.8, what clients that leave them out get), alternating: what sampling costs.

    python benchmarks/llm.py --out $OUT/llm.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.checkpoints.model_builder import build_tokenizer, load_preset  # noqa: E402
from app.llm.async_engine import AsyncEngine  # noqa: E402
from app.llm.engine import Engine  # noqa: E402
from app.llm.sampling import SamplingParams  # noqa: E402
from app.llm.sequence import GenerationRequest  # noqa: E402
from benchmarks.stats import pct  # noqa: E402

RNG = np.random.default_rng(0)


QWEN3_VL_SAMPLING = {"temperature": 0.7, "top_k": 20, "top_p": 0.8}  # its generation_config: what clients that
# leave the settings out get


def request(tokens: int, new: int, vocab: int, logprobs: int | None = None, sampling: dict | None = None
            ) -> GenerationRequest:
    """Random prompt ids, `new` tokens (ignore_eos); greedy, or `sampling`'s settings (seeded per request)."""
    ids = RNG.integers(0, min(vocab, 150000), tokens).tolist()  # below the special tokens (vision placeholders)
    settings = {"temperature": 0} if sampling is None else {**sampling, "seed": int(RNG.integers(1 << 31))}
    return GenerationRequest(ids, [0] * tokens, [], SamplingParams(max_tokens=new, ignore_eos=True, logprobs=logprobs,
                                                                   **settings))


class Reader:
    """Reads every request's output as the LLM replica does: `AsyncEngine` on an event loop (here on
    a thread of its own), one hand-off per step, text made on the loop, chunks coalesced per
    `stream_interval_ms`."""

    def __init__(self, engine: Engine, interval_s: float = 0.01):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.streams = AsyncEngine(engine, interval_s)
        self.streams.loop = self.loop

    def submit(self, req: GenerationRequest, on_seq=None) -> dict:
        """-> a record: 'seq' (once submitted; a request's last choice), 'tokens' read so far, 'end' and
        'done' when it ends. `on_seq` sees each of the request's sequences."""
        return self.submit_together([req], on_seq)[0]

    def submit_together(self, reqs: list[GenerationRequest], on_seq=None) -> list[dict]:
        """`submit` for several requests that reach the engine's queue in one go: the loop holds the
        engine's lock (re-entrant: the submissions run on the loop too) until every one is queued, so
        the engine thread takes them into one step."""
        recs = []

        def consume(req, rec):
            def seen(seq):
                rec["seq"] = seq
                if on_seq is not None:
                    on_seq(seq)
                rec["submitted"].set()

            async def run():
                try:
                    async for chunk in self.streams.generate(req, on_submit=seen):
                        rec["tokens"] += len(chunk.token_ids)
                except Exception:  # cancelled by the phase that started it
                    pass
                rec["end"] = time.perf_counter()
                rec["done"].set()
            return run()

        async def start():
            with self.streams.engine._cv:
                tasks = [asyncio.ensure_future(consume(req, rec)) for req, rec in zip(reqs, recs)]
                while not all(r["submitted"].is_set() or t.done() for r, t in zip(recs, tasks)):
                    await asyncio.sleep(0)

        for _ in reqs:
            recs.append({"tokens": 0, "seq": None, "done": threading.Event(), "submitted": threading.Event()})
        asyncio.run_coroutine_threadsafe(start(), self.loop).result(60)
        return recs


def finish(reader: Reader, req: GenerationRequest) -> dict:
    rec = reader.submit(req)
    rec["done"].wait(600)
    return rec


def run_streams(engine: Engine, reader: Reader, n: int, prompt: int, new: int, vocab: int,
                logprobs: int | None = None, sampling: dict | None = None) -> dict:
    """n concurrent requests: aggregate generated tokens per second, and per-stream decode rates."""
    t0 = time.perf_counter()
    recs = [reader.submit(request(prompt, new, vocab, logprobs, sampling)) for _ in range(n)]
    for r in recs:
        r["done"].wait(600)
    wall = max(r["end"] for r in recs) - t0
    rates = [(new - 1) / (r["end"] - r["seq"].first_token_time) for r in recs]
    return {"streams": n, "tokens": n * new, "wall_s": wall, "aggregate_tok_s": n * new / wall,
            "per_stream_decode_tok_s_median": float(np.median(rates)),
            "ttft_ms_median": 1e3 * float(np.median([r["seq"].first_token_time - t0 for r in recs]))}


def rollouts(engine: Engine, reader: Reader, n: int, prompt: int, new: int, vocab: int, rounds: int = 3) -> dict:
    """n samples (temperature 1) of one prompt: one request with `n` (the prompt computed once, its
    forks take its KV blocks from the prefix cache) against n one-choice requests of the same prompt,
    submitted one after another (each once the engine has queued the one before) and all at once (they
    arrive in one step: the later ones wait for the first one's prompt blocks). A new prompt for each,
    so none hits another's blocks."""
    def one(ids: list[int], choices: int, copies: int, together: bool = False) -> dict:
        seqs: list = []
        params = SamplingParams(max_tokens=new, temperature=1.0, seed=7, ignore_eos=True, n=choices)
        hits = engine.blocks.hit_tokens
        t0 = time.perf_counter()
        reqs = [GenerationRequest(ids, [0] * len(ids), [], params) for _ in range(copies)]
        if together:
            recs = reader.submit_together(reqs, on_seq=seqs.append)
        else:
            recs = [reader.submit(r, on_seq=seqs.append) for r in reqs]
        for r in recs:
            r["done"].wait(600)
        wall = max(r["end"] for r in recs) - t0
        ttfts = sorted(1e3 * (s.first_token_time - t0) for s in seqs)
        prompt_tokens = choices * copies * len(ids) - (engine.blocks.hit_tokens - hits)
        return {"wall_ms": 1e3 * wall, "ttft_first_ms": ttfts[0], "ttft_last_ms": ttfts[-1],
                "prompt_tokens_computed": prompt_tokens, "tokens": sum(r["tokens"] for r in recs)}

    out: dict = {"n": n, "prompt": prompt, "new": new, "rounds": []}
    sides = ("one_request_n", "n_requests", "n_requests_at_once")
    for _ in range(rounds):
        ids = [RNG.integers(0, min(vocab, 150000), prompt).tolist() for _ in sides]
        out["rounds"].append({"one_request_n": one(ids[0], n, 1), "n_requests": one(ids[1], 1, n),
                              "n_requests_at_once": one(ids[2], 1, n, together=True)})
    for side in sides:
        out[side] = {k: float(np.median([r[side][k] for r in out["rounds"]]))
                     for k in out["rounds"][0][side]}
    return out


def ttft_parts(seq, t0: float) -> dict:
    """Where the time to first token went: to the sequence being built (hand-off to the reader's loop
    included), queued for the engine, admitted into a step, and the step that made the token."""
    s = seq
    return {"built_ms": 1e3 * (s.arrival_time - t0), "queued_ms": 1e3 * (s.queued_time - s.arrival_time),
            "admitted_ms": 1e3 * (s.scheduled_time - s.queued_time),
            "first_step_ms": 1e3 * (s.first_token_time - s.scheduled_time)}


def ttft_alone(engine: Engine, reader: Reader, prompt: int, vocab: int, runs: int) -> dict:
    times, parts = [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        rec = finish(reader, request(prompt, 1, vocab))
        times.append(1e3 * (rec["seq"].first_token_time - t0))
        parts.append(ttft_parts(rec["seq"], t0))
    median_parts = {k: float(np.median([p[k] for p in parts])) for k in parts[0]}
    return {"median_ms": float(np.median(times)), "p99_ms": pct(times, 99), "runs": runs, "all_ms": times,
            "median_parts_ms": median_parts}


def ttft_under_load(engine: Engine, reader: Reader, streams: int, prompt: int, arrivals: int, gap_s: float,
                    vocab: int) -> dict:
    """`streams` long decodes run; meanwhile `arrivals` prompts of `prompt` tokens arrive `gap_s` apart."""
    long = [reader.submit(request(128, 100000, vocab)) for _ in range(streams)]
    while any(r["seq"].first_token_time is None for r in long):
        time.sleep(0.01)
    time.sleep(0.5)
    c0, t_start = sum(r["tokens"] for r in long), time.perf_counter()
    times = []
    for _ in range(arrivals):
        t0 = time.perf_counter()
        rec = finish(reader, request(prompt, 1, vocab))
        times.append(1e3 * (rec["seq"].first_token_time - t0))
        time.sleep(gap_s)
    rate = (sum(r["tokens"] for r in long) - c0) / (time.perf_counter() - t_start)
    for r in long:
        r["seq"].cancel()
    for r in long:
        r["done"].wait(60)
    return {"streams": streams, "arrivals": arrivals, "median_ms": float(np.median(times)), "p99_ms": pct(times, 99),
            "max_ms": max(times), "all_ms": times, "streams_aggregate_tok_s_meanwhile": rate}


class Quiet:
    """The engine alone: its step outputs go to a counter, no reader shares the GIL."""

    def __init__(self, engine: Engine):
        self.engine, self.done = engine, {}

    def __enter__(self):
        self.saved = self.engine.emit
        self.engine.emit = self._emit
        return self

    def __exit__(self, *exc):
        self.engine.emit = self.saved

    def _emit(self, outputs):
        for seq, delta in outputs:
            if delta.finish_reason or delta.error is not None:
                self.done[seq.id] = time.perf_counter()

    def run(self, reqs: list[GenerationRequest]) -> list:
        seqs = [self.engine.submit(r, sink=lambda d: None) for r in reqs]
        while any(s.id not in self.done for s in seqs):
            time.sleep(0.0005)
        return seqs


def engine_only(engine: Engine, batches: list[int], prompt: int, vocab: int, steps: int = 200) -> dict:
    """Host time per decode step and TTFT with no reader: what the engine itself costs."""
    out = {}
    with Quiet(engine) as q:
        for b in batches:
            engine.step_log.clear()
            q.run([request(64, steps, vocab) for _ in range(b)])
            host = [1e3 * r[3] for r in engine.step_log if r[0] == b and r[2] == "decode"]
            out[f"host_b{b}"] = {"steps": len(host), "median_ms": float(np.median(host)), "p99_ms": pct(host, 99)}
        times, parts = [], []
        for _ in range(20):
            t0 = time.perf_counter()
            (seq,) = q.run([request(prompt, 1, vocab)])
            times.append(1e3 * (seq.first_token_time - t0))
            parts.append(ttft_parts(seq, t0))
        out["ttft_alone"] = {"median_ms": float(np.median(times)), "p99_ms": pct(times, 99), "all_ms": times,
                             "median_parts_ms": {k: float(np.median([p[k] for p in parts])) for k in parts[0]}}
    return out


def host_time_by_batch(engine: Engine, reader: Reader, batches: list[int], vocab: int, steps: int = 200) -> dict:
    """Decode exactly b streams for a while; the engine's log gives each step's host time."""
    out = {}
    for b in batches:
        engine.step_log.clear()
        res = run_streams(engine, reader, b, 64, steps, vocab)
        rows = [r for r in engine.step_log if r[0] == b and r[2] == "decode"]  # graph decode steps at batch b
        host = [1e3 * r[3] for r in rows]
        wall = [1e3 * r[4] for r in rows]
        out[b] = {"steps": len(rows), "host_ms_median": float(np.median(host)), "host_ms_p99": pct(host, 99),
                  "step_ms_median": float(np.median(wall)), "aggregate_tok_s": res["aggregate_tok_s"]}
    return out


def logprobs_cost(engine: Engine, reader: Reader, streams: int, vocab: int, rounds: int = 3) -> dict:
    """`streams` streams of 256 tokens without log-probabilities and with the top 5, alternating:
    aggregate tok/s, and host and wall ms per graph decode step at that batch (medians)."""
    out: dict = {"off": [], "top5": []}
    for _ in range(rounds):
        for name, k in (("off", None), ("top5", 5)):
            engine.step_log.clear()
            res = run_streams(engine, reader, streams, 64, 256, vocab, logprobs=k)
            rows = [r for r in engine.step_log if r[0] == streams and r[2] == "decode"]
            out[name].append({"aggregate_tok_s": round(res["aggregate_tok_s"], 1)} | _step_medians(rows))
    return out


def sampling_cost(engine: Engine, reader: Reader, streams: int, vocab: int, rounds: int = 3) -> dict:
    """`streams` streams of 256 tokens, greedy and at Qwen3-VL's sampling defaults (top_k 20: the sampler's
    top-k draw, app/llm/sampler.py), alternating: aggregate tok/s, and host and wall ms per graph decode
    step at that batch (medians). Every other benchmark here is greedy."""
    out: dict = {"greedy": [], "qwen3_vl_defaults": []}
    for _ in range(rounds):
        for name, sampling in (("greedy", None), ("qwen3_vl_defaults", QWEN3_VL_SAMPLING)):
            engine.step_log.clear()
            res = run_streams(engine, reader, streams, 64, 256, vocab, sampling=sampling)
            rows = [r for r in engine.step_log if r[0] == streams and r[2] == "decode"]
            out[name].append({"aggregate_tok_s": round(res["aggregate_tok_s"], 1)} | _step_medians(rows))
    return out


def _step_medians(rows: list) -> dict:
    """Step-log rows -> their count and median host and wall ms per step."""
    return {"steps": len(rows), "host_ms_median": round(1e3 * float(np.median([r[3] for r in rows])), 3),
            "step_ms_median": round(1e3 * float(np.median([r[4] for r in rows])), 3)}


def structured_cost(engine: Engine, reader: Reader, streams: int, vocab: int, rounds: int = 3) -> dict:
    """`streams` streams of 256 tokens, free text and with a JSON schema (a string of at least 4,000
    characters, so no answer completes early), alternating: aggregate tok/s, and host and wall ms
    per decode step at that batch (medians). What a format costs: the masks built on the host each
    step, and steps that no longer overlap."""
    from app.llm.grammar import grammar_for

    grammar = grammar_for({"type": "json_schema", "json_schema": {"name": "long", "schema": {
        "type": "object", "properties": {"text": {"type": "string", "minLength": 4000}}, "required": ["text"]}}})
    out: dict = {"off": [], "schema": []}
    for _ in range(rounds):
        for name, g in (("off", None), ("schema", grammar)):
            engine.step_log.clear()
            t0 = time.perf_counter()
            reqs = [request(64, 256, vocab) for _ in range(streams)]
            for r in reqs:
                r.params.grammar = g
            recs = reader.submit_together(reqs)
            for r in recs:
                r["done"].wait(600)
            wall = max(r["end"] for r in recs) - t0
            rows = [r for r in engine.step_log if r[0] == streams and r[1] == streams]  # decode steps of all
            out[name].append({"aggregate_tok_s": round(sum(r["tokens"] for r in recs) / wall, 1)} | _step_medians(rows))
    return out


def transformers_rates(model, prompt: int, new: int, ttft_prompt: int, vocab: int) -> dict:
    def gen(tokens, n):
        ids = torch.tensor([RNG.integers(0, min(vocab, 150000), tokens).tolist()], device="cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    gen(32, 4)  # warm-up
    one = min(gen(prompt, 1) for _ in range(3))
    full = gen(prompt, new)
    ttft = [1e3 * gen(ttft_prompt, 1) for _ in range(5)]
    return {"decode_tok_s": (new - 1) / (full - one), "end_to_end_tok_s": new / full,
            "ttft_1000_median_ms": float(np.median(ttft))}


def profile_decode(engine: Engine, reader: Reader, batch: int, vocab: int) -> list[dict]:
    """CUDA kernels over a window of decode steps at `batch` (per step: divide by the steps counted)."""
    from torch.profiler import ProfilerActivity, profile

    recs = [reader.submit(request(64, 100000, vocab)) for _ in range(batch)]
    while any(r["seq"].first_token_time is None for r in recs):
        time.sleep(0.01)
    time.sleep(0.3)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        time.sleep(0.2)
    # steps inside the window: one attention kernel per layer per step
    steps = next((e.count for e in prof.key_averages() if "paged_attention" in e.key), 0) // engine.spec.layers
    for r in recs:
        r["seq"].cancel()
    for r in recs:
        r["done"].wait(60)
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)
        if t > 0:
            rows.append({"kernel": e.key[:90], "calls": e.count, "us_per_step": round(t / max(steps, 1), 2)})
    rows.sort(key=lambda r: -r["us_per_step"])
    return [{"steps": steps, "gpu_us_per_step": round(sum(r["us_per_step"] for r in rows), 1)}] + rows[:25]


def prefill_attention_ab(engine: Engine) -> dict:
    """One layer's prefill attention, µs (CUDA events, median): our paged kernel against PyTorch's varlen
    FlashAttention on contiguous keys (a whole prompt), and, for a chunk after a cached prefix, varlen
    on keys first gathered out of the blocks (what using it there would cost)."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return {"varlen": "not in this torch"}
    cases = (("1 x 1000 prompt", [1000], [1000]), ("4 x 250 prompts", [250] * 4, [250] * 4),
             ("512 chunk after 1000 cached", [512], [1512]))
    return {name: _attention_case(engine.spec, qlens, klens) for name, qlens, klens in cases}


def _attention_case(s, qlens: list[int], klens: list[int], bs: int = 16) -> dict:
    import triton.testing
    from torch.nn.attention.varlen import varlen_attn

    from app.llm.attention import AttentionMetadata, block_q_for, paged_attention, work_table

    dev = "cuda"
    blocks = -(-sum(klens) // bs) + len(klens)
    k_cache = torch.randn(blocks * bs, s.kv_heads, s.head_dim, device=dev, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(sum(qlens), s.heads, s.head_dim, device=dev, dtype=torch.bfloat16)
    table = torch.zeros(len(klens) + 1, -(-max(klens) // bs), dtype=torch.int32, device=dev)
    nxt = 0
    for i, k in enumerate(klens):
        nb = -(-k // bs)
        table[i, :nb] = torch.arange(nxt, nxt + nb)
        nxt += nb

    def i32(a):
        return torch.tensor(np.asarray(list(a)), dtype=torch.int32, device=dev)

    bq = block_q_for(s.heads // s.kv_heads, 64)
    ws, w0 = work_table(np.array(qlens, dtype=np.int32), bq)
    cq, ck = i32(np.concatenate([[0], np.cumsum(qlens)])), i32(np.concatenate([[0], np.cumsum(klens)]))
    meta = AttentionMetadata(cq, i32(klens), i32(range(len(klens))), table, i32(ws), i32(w0), bq, bs)
    idx = torch.cat([(table[i, :-(-k // bs)].long()[:, None] * bs + torch.arange(bs, device=dev)).flatten()[:k]
                     for i, k in enumerate(klens)])
    kc, vc = k_cache[idx], v_cache[idx]
    scale = s.head_dim ** -0.5

    def bench(fn):
        return triton.testing.do_bench(fn, return_mode="median") * 1e3

    def flash(k, v):
        return varlen_attn(q, k, v, cq, ck, max(qlens), max(klens), scale=scale, window_size=(-1, 0), enable_gqa=True)

    row = {"ours_us": bench(lambda: paged_attention(q, k_cache, v_cache, meta, scale))}
    try:
        row["varlen_contiguous_us"] = bench(lambda: flash(kc, vc))
        if qlens != klens:
            row["varlen_with_gather_us"] = bench(lambda: flash(k_cache[idx], v_cache[idx]))
    except Exception as e:  # an older torch: no GQA, or no bottom-right causal mask for unequal lengths
        row["varlen_error"] = f"{type(e).__name__}: {e}"[:200]
    return row


def main() -> None:
    from transformers import AutoConfig, Qwen3VLForConditionalGeneration

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--preset", default="qwen3-vl-2b")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--ttft-prompt", type=int, default=1000)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--overlap", choices=["on", "off"], default="on",
                   help="llm.overlap_steps: launch step N+1 before reading step N's tokens")
    p.add_argument("--logprobs-cost", action="store_true", help="run only the log-probabilities phase")
    p.add_argument("--rollouts", type=int, default=0, help="run only the rollouts phase, with n = this")
    p.add_argument("--structured-cost", action="store_true", help="run only the structured-output phase")
    p.add_argument("--sampling-cost", action="store_true",
                   help="run only the sampling phase: greedy against Qwen3-VL's defaults, alternating")
    p.add_argument("--out", default="benchmarks/llm_results.json")
    a = p.parse_args()
    cfg = AutoConfig.for_model(**load_preset(a.preset))
    cfg.text_config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3VLForConditionalGeneration._from_config(cfg, dtype=torch.bfloat16).eval()
    model.model.visual = None
    tok = build_tokenizer()
    vocab = cfg.text_config.vocab_size
    t0 = time.perf_counter()
    engine = Engine.from_model(model, tok, "cuda", max_model_len=a.max_model_len, max_num_seqs=256,
                               gpu_memory_utilization=0.6, overlap_steps=a.overlap == "on")
    start_s = time.perf_counter() - t0
    reader = Reader(engine)
    run_streams(engine, reader, 4, 32, 8, vocab)  # warm-up (Triton compiles the eager kernels)
    run_streams(engine, reader, 2, 1100, 2, vocab)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "preset": a.preset, "overlap": a.overlap,
           "engine_start_s": start_s, "graphs": len(engine.runner.graphs), "kv_blocks": engine.blocks.usable_blocks,
           "kv_bytes_per_token": engine.stats()["kv_bytes_per_token"]}
    s = engine.spec
    res["kv_bytes_per_token_formula"] = s.layers * 2 * s.kv_heads * s.head_dim * 2
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    phases = [("single", lambda: run_streams(engine, reader, 1, a.prompt, a.new, vocab)),
              ("single_again", lambda: run_streams(engine, reader, 1, a.prompt, a.new, vocab)),
              ("concurrent", lambda: run_streams(engine, reader, a.streams, a.prompt, a.new, vocab)),
              ("ttft_alone", lambda: ttft_alone(engine, reader, a.ttft_prompt, vocab, 20)),
              ("ttft_under_load", lambda: ttft_under_load(engine, reader, a.streams, a.ttft_prompt, 30, 0.05, vocab)),
              ("host_by_batch", lambda: host_time_by_batch(engine, reader, [1, 16, 64], vocab)),
              ("engine_only", lambda: engine_only(engine, [1, 16, 64], a.ttft_prompt, vocab))]
    if a.logprobs_cost:
        phases = [("logprobs_cost", lambda: logprobs_cost(engine, reader, a.streams, vocab))]
    if a.rollouts:
        phases = [("rollouts", lambda: rollouts(engine, reader, a.rollouts, a.ttft_prompt, a.new, vocab))]
    if a.structured_cost:
        phases = [("structured_cost", lambda: structured_cost(engine, reader, a.streams, vocab))]
    if a.sampling_cost:
        phases = [("sampling_cost", lambda: sampling_cost(engine, reader, a.streams, vocab))]
    if a.profile:
        phases += [("prefill_attention_ab", lambda: prefill_attention_ab(engine)),
                   ("profile_b1", lambda: profile_decode(engine, reader, 1, vocab)),
                   ("profile_b64", lambda: profile_decode(engine, reader, 64, vocab))]
    for name, run in phases:  # each phase is printed and saved as it ends
        res[name] = run()
        print(name, json.dumps(res[name])[:400], flush=True)
        out.write_text(json.dumps(res, indent=1))
    engine.shutdown()
    if a.logprobs_cost or a.rollouts or a.structured_cost or a.sampling_cost:
        return
    if not a.skip_transformers:
        res["transformers"] = transformers_rates(model, a.prompt, 64, a.ttft_prompt, vocab)
    out.write_text(json.dumps(res, indent=1))
    print_table(res)


def print_table(r: dict) -> None:
    hf = r.get("transformers", {})
    print(f"device {r['device']}, torch {r['torch']}, {r['preset']} bf16; engine start {r['engine_start_s']:.1f} s, "
          f"{r['graphs']} decode graphs, {r['kv_blocks']} KV blocks, "
          f"{r['kv_bytes_per_token']} KV bytes/token (formula {r['kv_bytes_per_token_formula']})")
    print("| measure | ours | transformers | target |")
    print("|---|---|---|---|")
    print(f"| single-stream decode tok/s | {r['single_again']['per_stream_decode_tok_s_median']:.1f} | "
          f"{hf.get('decode_tok_s', float('nan')):.1f} | >= 450 |")
    c = r["concurrent"]
    print(f"| {c['streams']} streams aggregate tok/s | {c['aggregate_tok_s']:.0f} | | >= 10,000 |")
    t = r["ttft_alone"]
    print(f"| TTFT 1000-token prompt alone, median (p99) ms | {t['median_ms']:.2f} ({t['p99_ms']:.2f}) | "
          f"{hf.get('ttft_1000_median_ms', float('nan')):.2f} | <= 12 |")
    u = r["ttft_under_load"]
    print(f"| TTFT 1000-token prompt under {u['streams']} streams, p50 / p99 ms | {u['median_ms']:.1f} / "
          f"{u['p99_ms']:.1f} | | p99 <= 60 |")
    e = r["engine_only"]
    print(f"| TTFT 1000-token prompt alone, engine only (no reader), median (p99) ms | "
          f"{e['ttft_alone']['median_ms']:.2f} ({e['ttft_alone']['p99_ms']:.2f}) | | <= 12 |")
    for b, h in r["host_by_batch"].items():
        q = e[f"host_b{b}"]
        print(f"| host ms per decode step, batch {b}: engine only / beside the replica's reader (median, p99; "
              f"step {h['step_ms_median']:.2f} ms) | {q['median_ms']:.3f}, {q['p99_ms']:.3f} / "
              f"{h['host_ms_median']:.3f}, {h['host_ms_p99']:.3f} | | <= 1 at 64 |")


if __name__ == "__main__":
    main()
