"""The log-probabilities' GPU ops at the 2B shape's vocabulary (151,936): PyTorch's row reductions one
by one, and the whole computation through PyTorch's ops against app/llm/logprobs.py's Triton kernels.

µs per call, CUDA events around each call, median of 50 after 5 warm-up calls. The GPU is otherwise
idle, so a call's launch latency counts too (inside an engine step it overlaps queued work).

    python3 benchmarks/logprobs_ops.py --out $OUT/logprobs_ops.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from app.gpu import kernel_timing as timing  # noqa: E402
from app.llm.logprobs import token_logprobs, token_logprobs_torch  # noqa: E402

VOCAB = 151936


def median_us(fn, runs: int = 50) -> float:
    return round(statistics.median(timing.cuda_times_ms(fn, runs, warmup=5)) * 1e3, 1)


def ops_at(rows: int) -> dict:
    """µs of each op on `rows` rows of bf16 logits."""
    x = torch.randn(rows, VOCAB, device="cuda", dtype=torch.bfloat16) * 3
    tok = x.argmax(-1)
    xf = x.float()
    ops = {"float()": lambda: x.float(), "logsumexp (fp32)": lambda: torch.logsumexp(xf, -1),
           "amax": lambda: xf.amax(-1), "greedy argmax (the sampler's)": lambda: x.float().argmax(-1)}
    for k in (1, 5, 20):
        ops[f"topk {k} (bf16)"] = lambda k=k: x.topk(k, -1)
    for k in (0, 5, 20):
        ops[f"all, k {k}: PyTorch's ops"] = lambda k=k: token_logprobs_torch(x, tok, k)
        ops[f"all, k {k}: Triton kernels"] = lambda k=k: token_logprobs(x, tok, k)
    return {name: median_us(fn) for name, fn in ops.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default="logprobs_ops.json")
    out = Path(p.parse_args().out)
    res: dict = {"device": torch.cuda.get_device_name()}
    for rows in (1, 64, 256):
        res[f"rows {rows}"] = ops_at(rows)
        print(rows, json.dumps(res[f"rows {rows}"]), flush=True)
    out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
