"""LLM engine benchmark: our continuous-batching engine vs transformers' `generate`, side by side.

A Qwen3-VL-2B-shaped model with random weights in bf16 (speed does not depend on weight values),
text-only prompts of random tokens, `ignore_eos` so every request generates exactly --new tokens.

    python benchmarks/llm.py --out benchmarks/llm_results.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.llm.engine import Engine, GenerationRequest  # noqa: E402
from app.llm.sampling import SamplingParams  # noqa: E402
from app.model_builder import build_tokenizer, load_preset  # noqa: E402


def make_request(tok_count: int, new: int, vocab: int, seed: int) -> GenerationRequest:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (tok_count,), generator=g).tolist()
    return GenerationRequest(ids, [0] * tok_count, [], SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))


def run_ours(engine: Engine, n: int, prompt: int, new: int, vocab: int) -> dict:
    """n concurrent requests; aggregate generated tokens/s and time to first token."""
    t0 = time.perf_counter()
    seqs = [engine.submit(make_request(prompt, new, vocab, seed=i)) for i in range(n)]
    done = []

    def wait(s):
        while not s.next_chunk().finish_reason:
            pass
        done.append(time.perf_counter())

    threads = [threading.Thread(target=wait, args=(s,)) for s in seqs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = max(done) - t0
    ttft = [s.first_token_time - t0 for s in seqs]
    return {"concurrency": n, "tokens": n * new, "wall_s": wall, "tok_per_s": n * new / wall,
            "ttft_ms_median": 1e3 * statistics.median(ttft)}


def run_transformers(model, prompt: int, new: int, vocab: int) -> dict:
    req = make_request(prompt, new, vocab, seed=0)
    ids = torch.tensor([req.input_ids], device="cuda")
    kw = {"attention_mask": torch.ones_like(ids), "do_sample": False}
    model.generate(input_ids=ids, max_new_tokens=4, min_new_tokens=4, **kw)  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.generate(input_ids=ids, max_new_tokens=new, min_new_tokens=new, **kw)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return {"tokens": new, "wall_s": wall, "tok_per_s": new / wall}


def transformers_ttft(model, prompt: int, vocab: int) -> float:
    ids = torch.tensor([make_request(prompt, 1, vocab, seed=1).input_ids], device="cuda")
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    from transformers import AutoConfig, Qwen3VLForConditionalGeneration

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--preset", default="qwen3-vl-2b")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--ttft-prompt", type=int, default=1000)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--out", default="benchmarks/llm_results.json")
    a = p.parse_args()
    cfg = AutoConfig.for_model(**load_preset(a.preset))
    cfg.text_config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3VLForConditionalGeneration._from_config(cfg, dtype=torch.bfloat16).eval()
    tok = build_tokenizer()
    vocab = len(tok)
    t0 = time.perf_counter()
    engine = Engine.from_model(model, tok, "cuda", max_model_len=a.max_model_len, max_num_seqs=max(a.concurrency))
    capture_s = time.perf_counter() - t0
    eager = Engine.from_model(model, tok, "cuda", max_model_len=a.max_model_len, max_num_seqs=max(a.concurrency),
                              cuda_graphs=False)
    for e in (engine, eager):
        run_ours(e, 2, 32, 8, vocab)  # warm-up
    rows = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "preset": a.preset,
            "prompt": a.prompt, "new": a.new, "graphs": len(engine.decode_graphs), "engine_start_s": capture_s}
    rows["transformers_single"] = run_transformers(model, a.prompt, a.new, vocab)
    rows["ours_eager"] = [run_ours(eager, n, a.prompt, a.new, vocab) for n in a.concurrency]
    del eager
    rows["ours"] = [run_ours(engine, n, a.prompt, a.new, vocab) for n in a.concurrency]
    ttft_ours = [run_ours(engine, 1, a.ttft_prompt, 1, vocab)["ttft_ms_median"] for _ in range(5)]
    rows["ttft_1000"] = {"ours_ms": statistics.median(ttft_ours), "transformers_ms": transformers_ttft(model, a.ttft_prompt, vocab)}
    single = rows["ours"][0]["tok_per_s"]
    hf = rows["transformers_single"]["tok_per_s"]
    print(f"device {rows['device']}, {a.preset} bf16, prompt {a.prompt}, {a.new} new tokens per request; "
          f"{rows['graphs']} decode graphs, engine start incl. capture {capture_s:.1f} s")
    print("| engine | concurrency | aggregate tok/s | vs our single | vs transformers single | TTFT median ms |")
    print("|---|---|---|---|---|---|")
    print(f"| transformers generate | 1 | {hf:.1f} | | 1.0x | |")
    for r in rows["ours_eager"]:
        print(f"| ours, eager decode | {r['concurrency']} | {r['tok_per_s']:.1f} | | {r['tok_per_s'] / hf:.1f}x | "
              f"{r['ttft_ms_median']:.1f} |")
    for r in rows["ours"]:
        print(f"| ours, graph decode | {r['concurrency']} | {r['tok_per_s']:.1f} | {r['tok_per_s'] / single:.1f}x | "
              f"{r['tok_per_s'] / hf:.1f}x | {r['ttft_ms_median']:.1f} |")
    t = rows["ttft_1000"]
    print(f"TTFT, {a.ttft_prompt}-token prompt: ours {t['ours_ms']:.1f} ms, transformers {t['transformers_ms']:.1f} ms")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
