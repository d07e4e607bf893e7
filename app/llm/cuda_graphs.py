"""CUDA graphs of the model runner's forwards, captured once at start-up.

- Decode graphs, per batch bucket (step_inputs.decode_buckets): the forward and the LM head for
  one token per row, reading [ids, positions, KV slots, lengths, rows] from the start of the step
  input buffer, logits into a fixed buffer.
- Step graphs, per token bucket (step_inputs.step_buckets): the forward over a padded StepLayout,
  vision rows included (a step without any has an all-zero mask), final hidden states into a fixed
  buffer; the step's sampling rows' logits are taken from there after the replay.
Each bucket is warmed up eagerly on a side stream first (Triton compiles and autotunes outside the
capture), and captured largest first into one memory pool, so smaller graphs reuse its blocks.
Under tensor parallelism every rank captures the same graphs, collectives inside.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from ..gpu.capture import collection_paused
from .step_inputs import decode_buckets, step_buckets

log = logging.getLogger(__name__)


def _capture(fn, device: torch.device, pool) -> torch.cuda.CUDAGraph:
    """`fn` run once on a side stream (Triton compiles and autotunes, the allocator's blocks are made),
    then captured on that same stream."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with collection_paused(), torch.cuda.graph(g, pool=pool, stream=side, capture_error_mode="thread_local"):
        fn()
    return g


@torch.inference_mode()
def capture_all(runner, step_graphs: bool = True) -> None:
    """Decode graphs, then step graphs, in one pool; then block 0, which the captures wrote, is zeroed."""
    pool = torch.cuda.graph_pool_handle()
    capture_decode_graphs(runner, pool)
    if step_graphs:
        capture_step_graphs(runner, pool)
    torch.cuda.synchronize(runner.device)
    runner.inputs.frozen = True
    runner.kv[:, :, :runner.block_size].zero_()


def capture_decode_graphs(runner, pool) -> None:
    t0, dev = time.perf_counter(), runner.device
    runner.graph_buckets = decode_buckets(runner.max_num_seqs)
    top = runner.graph_buckets[-1]
    runner.logits_out = torch.empty(top, runner.model.spec.vocab, dtype=runner.dtype, device=dev)
    graph_in = runner.inputs.dev  # where `StepInputs.pack` puts the "graph" array: the buffer's start
    pad = runner.tables.padding_row
    for b in reversed(runner.graph_buckets):
        view = graph_in[:5 * b].view(5, b)
        view.copy_(torch.tensor([[0] * b, [0] * b, [0] * b, [1] * b, [pad] * b], dtype=torch.int32, device=dev))
        runner.graphs[b] = _capture(lambda view=view, b=b: runner.decode_forward(view, b, runner.logits_out[:b]),
                                    dev, pool)
    torch.cuda.synchronize(dev)
    log.info("captured %d decode graphs (batch %s) in %.2f s", len(runner.graphs), runner.graph_buckets,
             time.perf_counter() - t0)


def capture_step_graphs(runner, pool) -> None:
    t0, dev = time.perf_counter(), runner.device
    runner.step_buckets = step_buckets(runner.max_tokens)
    runner.step_hidden = torch.empty(runner.max_tokens, runner.model.spec.hidden, dtype=runner.dtype, device=dev)
    empty = {"ids": [], "pos": np.zeros((3, 0)), "slots": [], "vis_mask": [], "qstart": [0], "lens": [],
             "rows": [], "wseq": [], "wq0": []}
    for b in reversed(runner.step_buckets):
        layout = runner.step_layout(b)
        if layout.words > runner.inputs.dev.numel():
            raise RuntimeError(f"a {b}-token step graph's inputs overflow the step-input buffer")
        buf = runner.inputs.dev[:layout.words]
        buf.copy_(torch.from_numpy(layout.fill(empty, runner.tables.padding_row)).to(dev))  # a step of no tokens
        v = layout.views(buf)
        runner.step_graphs[b] = _capture(
            lambda v=v, b=b: runner.step_hidden[:b].copy_(runner.step_forward(v, b, vision=True)), dev, pool)
    torch.cuda.synchronize(dev)
    log.info("captured %d step graphs (tokens %s) in %.2f s", len(runner.step_graphs), runner.step_buckets,
             time.perf_counter() - t0)
