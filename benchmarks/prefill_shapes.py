"""What a new prefill shape costs: the LLM's text model, first call at a (batch, width) vs a repeat,
with PyTorch's default attention choice (cuDNN on Hopper) and with cuDNN left out (the engine's).

cuDNN builds an execution plan per new shape; prefill shapes change with every batch, so that cost
lands on requests. Wall-clock ms per forward, synchronised (one call each: a first call cannot be
repeated).

    python3 benchmarks/prefill_shapes.py --preset qwen3-vl-2b
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention import sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.checkpoints.model_builder import ensure_embedded  # noqa: E402
from app.gpu.sdpa_backends import UNCAPTURED  # noqa: E402


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def forward_ms(text, cfg, n: int, width: int, device: str) -> float:
    """One left-padded batched forward, as the engine's prefill runs it."""
    from transformers import DynamicCache

    ids = torch.randint(0, min(cfg.vocab_size, 2000), (n, width), device=device)
    attn = torch.ones(n, width, dtype=torch.long, device=device)
    for i in range(n):
        attn[i, :3 * i] = 0  # left padding, different per row
    pos = torch.arange(width, device=device).expand(4, n, width)
    sync(device)
    t = time.perf_counter()
    with torch.inference_mode():
        text(input_ids=ids, attention_mask=attn if n > 1 else None, position_ids=pos,
             past_key_values=DynamicCache(config=cfg), use_cache=True)
    sync(device)
    return (time.perf_counter() - t) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--preset", default="qwen3-vl-2b")
    p.add_argument("--device", default="cuda", help="cpu only checks that the script runs")
    a = p.parse_args()
    dev = a.device
    from transformers import Qwen3VLForConditionalGeneration

    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    model = Qwen3VLForConditionalGeneration.from_pretrained(ensure_embedded(a.preset), dtype=dtype)
    model.model.visual = None
    model = model.to(dev).eval()
    text, cfg = model.model.language_model, model.config.text_config
    forward_ms(text, cfg, 1, 64, dev)  # the process's first forward (CUDA context, cuBLAS) is not a shape's cost
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    print(f"{name} (torch {torch.__version__}), {a.preset}")
    print("| attention | batch x width | first call ms | repeat ms |\n|---|---|---|---|")
    # Each side gets shapes the other never ran, so neither inherits the other's plans.
    for label, choice, shapes in (("PyTorch default (cuDNN first on Hopper)", contextlib.nullcontext,
                                   [(4, 230), (5, 241), (8, 260), (1, 333)]),
                                  ("engine (cuDNN left out)", lambda: sdpa_kernel(UNCAPTURED),
                                   [(6, 251), (7, 263), (3, 199), (1, 444)])):
        with choice():
            for n, w in shapes:
                first, again = forward_ms(text, cfg, n, w, dev), forward_ms(text, cfg, n, w, dev)
                print(f"| {label} | {n} x {w} | {first:.1f} | {again:.1f} |")


if __name__ == "__main__":
    main()
