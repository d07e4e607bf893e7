"""Runs one planned step on the device: inputs in, sampled token ids out.

Host time per step caps a Python engine, so the host does little: every input goes to the device in
one copy (step_inputs.py); a decode-only step replays the CUDA graph of the smallest batch bucket
that holds it, any other step a step graph over the smallest token bucket (cuda_graphs.py); sampling
runs on the device and the token ids come back in one copy. `launch` and `collect` are apart so the
engine can queue step N+1 while step N runs: a token step N+1 feeds back is a placeholder on the
host, -(k + 1) for step N's k-th sampled row, read from step N's tokens on the device; pinned host
buffers come in pairs for that. Words: a request's *row* is its block-table and penalty row; a
token's *KV slot* is its place in the KV cache (block x block_size + offset).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from . import kv_cache
from .attention import AttentionMetadata, block_q_for, decode_block_n, decode_kv_splits, work_table
from .block_tables import BlockTables
from .cuda_graphs import capture_all
from .model import TextModel, VisionBatch
from .sampler import (
    SAMPLING_FIELDS,
    Sampler,
    SamplingBatch,
    host_sampling_arrays,
    host_sampling_flags,
    worst_case_batch,
)
from .sampling import MAX_LOGPROBS
from .scheduler import StepPlan
from .sequence import Sequence
from .step_inputs import StepInputs, StepLayout

log = logging.getLogger(__name__)

DECODE_BLOCK_M = 16  # query rows per attention program in decode steps (1 token x the GQA group, padded)
PREFILL_BLOCK_M = 64


@dataclass
class StepResult:
    tokens: list[int]  # one per sampling sequence, in plan order
    host_s: float  # host time of the step (preparing inputs, launching, reading results)
    wall_s: float  # the whole call, waiting for the device included
    graph: str  # "decode" or "step" (the kind of CUDA graph replayed), "" when launched eagerly
    # per sampling row: (log-probability of its token, top ids, top log-probabilities), None for rows
    # that did not ask; None when no row did
    logprobs: list | None = None


@dataclass
class LaunchedStep:
    """A step queued on the device whose sampled tokens have not been read yet."""

    plan: StepPlan
    tokens: torch.Tensor | None  # [sampling rows] on the device: what the next step's placeholders read
    host_tokens: torch.Tensor | None  # their pinned destination
    done: torch.cuda.Event | None  # recorded after the copy to the host
    graph: str  # as StepResult.graph
    host_s: float  # preparing and launching
    started: float  # perf_counter at the launch's start
    keep: list = field(default_factory=list)  # tensors the queued kernels read that nobody else may hold
    placed: list = field(default_factory=list)  # (sequence, index of its placeholder token): the engine's
    logprobs: tuple | None = None  # ([rows, 1 + 2k] on the host: sampler.token_logprobs, each row's k or None)


class ModelRunner:
    def __init__(self, model: TextModel, *, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int,
                 block_size: int, num_kv_blocks: int | None, gpu_memory_utilization: float, cuda_graphs: bool,
                 step_graphs: bool = True, decode_kv_splits: int = 32):
        self.model, self.device, self.dtype = model, model.device, model.dtype
        s, local = model.spec, model.local
        self.block_size, self.max_num_seqs = block_size, max_num_seqs
        self.max_blocks = -(-max_model_len // block_size)
        self.tables = BlockTables(max_num_seqs, self.max_blocks, self.device)
        # the largest step: every row's whole block table, the token budget's ids, positions, slots and
        # vision rows, and a few dozen words per row of attention layout and sampling parameters
        words = 2 * (max_num_seqs + 1) * self.max_blocks + 10 * max_num_batched_tokens + 32 * (max_num_seqs + 8)
        self.inputs = StepInputs(self.device, words)
        self.max_tokens = max_num_batched_tokens
        # the vision rows of a step, dense over its token rows (model.VisionBatch), written in place each
        # step: a step graph reads them at fixed addresses
        self.vision_main = torch.empty(max_num_batched_tokens, s.hidden, dtype=self.dtype, device=self.device)
        self.vision_deepstack = (torch.empty(s.deepstack_layers, max_num_batched_tokens, s.hidden, dtype=self.dtype,
                                             device=self.device) if s.deepstack_layers else None)
        self.sampler = Sampler(s.vocab, max_num_seqs, self.device)
        self.grammars = None  # the engine's grammar.Grammars: masks for rows with a response format
        group = local.heads // local.kv_heads
        self.decode_block_q = block_q_for(group, DECODE_BLOCK_M)
        self.prefill_block_q = block_q_for(group, PREFILL_BLOCK_M)
        cuda = self.device.type == "cuda"
        # decode attention splits each sequence's keys where a step has too few programs for the GPU
        self.sms = torch.cuda.get_device_properties(self.device).multi_processor_count if cuda else 0
        self.most_kv_splits = decode_kv_splits
        self.tokens_host = [torch.empty(max_num_seqs, dtype=torch.int64, pin_memory=cuda)
                            for _ in range(2)]  # in turn: one may still await its copy
        self._token_turn = 0
        # log-probabilities' pinned destinations, in turn like the tokens': per row the chosen token's,
        # up to MAX_LOGPROBS top values and their ids (sampler.token_logprobs)
        self.logprobs_host = [torch.empty(max_num_seqs * (1 + 2 * MAX_LOGPROBS), dtype=torch.float32,
                                          pin_memory=cuda) for _ in range(2)]
        self.bytes_per_block = kv_cache.bytes_per_block(s, local.kv_heads, block_size, self.dtype)
        # (phase, start, end) in wall-clock seconds: what starting took (app/serving/startup.py)
        self.startup: list[tuple[str, float, float]] = []
        t = time.time()
        if num_kv_blocks:
            self.num_blocks = num_kv_blocks
        elif not cuda:  # the CPU: room for max_num_seqs requests of max_model_len
            self.num_blocks = self.max_num_seqs * self.max_blocks + 1
        else:
            self.num_blocks = model.tp.smallest(kv_cache.blocks_that_fit(
                self.device, self.bytes_per_block, gpu_memory_utilization,
                lambda: self._profile_forward(max_num_batched_tokens, max_model_len), max_num_batched_tokens),
                self.device)
        self.kv = kv_cache.allocate(s, local.kv_heads, self.num_blocks, block_size, self.dtype, self.device)
        self.startup.append(("KV cache", t, time.time()))
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_buckets: list[int] = []
        self.step_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.step_buckets: list[int] = []
        if cuda_graphs and cuda:
            t = time.time()
            capture_all(self, step_graphs)
            self.startup.append(("graphs", t, time.time()))

    @torch.inference_mode()
    def _profile_forward(self, tokens: int, max_model_len: int) -> None:
        """The largest eager step, on a throw-away cache, to measure its activation memory."""
        s, local = self.model.spec, self.model.local
        kv = torch.zeros(s.layers, 2, self.block_size, local.kv_heads, s.head_dim, dtype=self.dtype, device=self.device)
        lens = [min(max_model_len, tokens - i) for i in range(0, tokens, max_model_len)]
        qstart = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        wseq, wq0 = work_table(np.array(lens), self.prefill_block_q)
        dev = self.device
        meta = AttentionMetadata(
            torch.tensor(qstart, device=dev), torch.tensor(lens, dtype=torch.int32, device=dev),
            torch.full((len(lens),), self.tables.padding_row, dtype=torch.int32, device=dev), self.tables.tensor,
            torch.tensor(wseq, device=dev), torch.tensor(wq0, device=dev), self.prefill_block_q, self.block_size)
        ids = torch.zeros(tokens, dtype=torch.int32, device=dev)
        pos = torch.zeros(3, tokens, dtype=torch.int32, device=dev)
        slots = torch.zeros(tokens, dtype=torch.int32, device=dev)
        h = self.model(ids, pos, slots, kv, meta)
        rows = min(self.max_num_seqs, tokens)
        logits = self.model.logits(h[:rows])
        self.sampler(logits, worst_case_batch(rows, dev))
        torch.cuda.synchronize(dev)

    # ------------------------------------------------------------------ rows
    def assign_row(self, seq: Sequence) -> None:
        row = self.tables.assign(seq)
        self.sampler.admit(row, seq)

    def release_row(self, seq: Sequence) -> None:
        self.tables.release(seq)

    # ------------------------------------------------------------------ steps
    def graph_ready(self, plan: StepPlan) -> bool:
        """A decode step whose every token is generated (or plain prompt text) can replay a graph. Every
        row must sample: the graph samples all of its rows, and the engine maps the step's tokens to the
        sampling rows (a 1-token middle chunk of a prompt, possible when max_num_seqs nearly fills the
        step's token budget, runs eagerly)."""
        if not plan.decode_only or not all(plan.sample):
            return False
        for s in plan.seqs:
            i = s.num_computed
            if i < s.prompt_len and s.is_vision[i]:
                return False
        return True

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> StepResult:
        """Launch a step and wait for its tokens."""
        return self.collect(self.launch(plan))

    @torch.inference_mode()
    def launch(self, plan: StepPlan, previous: LaunchedStep | None = None) -> LaunchedStep:
        """Queue the step's inputs, forward and sampling on the device; return without waiting.
        Placeholder tokens in the plan's sequences read `previous`'s sampled tokens on the device."""
        t0 = time.perf_counter()
        for s in plan.seqs:
            if s.row < 0:
                self.assign_row(s)
        feed = previous.tokens if previous is not None else None
        keep: list = []
        if self.graph_ready(plan):
            logits, sampling, graph = self._decode(plan.seqs, feed)
            rows = plan.seqs
        else:
            rows = [s for s, sampled in zip(plan.seqs, plan.sample) if sampled]
            logits, sampling, graph = self._mixed(plan, rows, feed, keep)
        drawn_from = logits
        if rows and self.grammars is not None and self.grammars.live:  # structured output's masks
            drawn_from = self.grammars.masked(logits, [s.matcher for s in rows])
        tokens = self.sampler(drawn_from, sampling) if rows else None
        out = done = logprobs = None
        if tokens is not None:
            self.sampler.count(tokens, sampling)
            out = self.tokens_host[self._token_turn][:len(rows)]
            out.copy_(tokens, non_blocking=True)
            wanted = [s.params.logprobs for s in rows]
            if wanted.count(None) != len(wanted):
                logprobs = self._logprobs_to_host(logits, tokens, wanted)
            self._token_turn ^= 1
            if self.device.type == "cuda":
                done = torch.cuda.Event()
                done.record()
        return LaunchedStep(plan, tokens, out, done, graph, time.perf_counter() - t0, t0, keep, logprobs=logprobs)

    def _logprobs_to_host(self, logits: torch.Tensor, tokens: torch.Tensor, wanted: list[int | None]) -> tuple:
        """Queue the log-probabilities of a step where some row asked for them, and their one copy to
        this turn's pinned buffer (the turn of the step's tokens: read before the buffer comes round)."""
        k = max(w for w in wanted if w is not None)
        packed = self.sampler.token_logprobs(logits, tokens, k)
        if self.device.type == "cuda":
            host = self.logprobs_host[self._token_turn][:packed.numel()].view(packed.shape)
            host.copy_(packed, non_blocking=True)
            packed = host
        return packed, wanted

    def collect(self, step: LaunchedStep) -> StepResult:
        """Wait for a launched step's tokens (only its own work: later steps may be queued behind it)."""
        t0 = time.perf_counter()
        if step.done is not None:
            step.done.synchronize()
        t_synced = time.perf_counter()
        result = step.host_tokens.tolist() if step.host_tokens is not None else []
        logprobs = None
        if step.logprobs is not None:
            packed, wanted = step.logprobs
            width = (packed.shape[1] - 1) // 2
            logprobs = [None if k is None else (row[0], [int(i) for i in row[1 + width:1 + width + k]], row[1:1 + k])
                        for row, k in zip(packed.tolist(), wanted)]
        step.keep.clear()
        end = time.perf_counter()
        return StepResult(result, step.host_s + (end - t_synced), step.host_s + (end - t0), step.graph, logprobs)

    @staticmethod
    def _feed_placeholders(ids: torch.Tensor, feed: torch.Tensor | None, placeholders: bool) -> None:
        """Replace placeholder ids -(k + 1) in the device view `ids` by the previous step's k-th token
        (`feed`, on the device). `placeholders`: whether the host copy of the ids holds any (else nothing to do)."""
        if feed is None or not placeholders:
            return
        src = feed[(-ids.long() - 1).clamp_(min=0)].to(ids.dtype)
        ids.copy_(torch.where(ids < 0, src, ids))

    def _sampling(self, seqs: list[Sequence]) -> tuple[dict[str, np.ndarray], dict]:
        """Host arrays for the sampler (none when every row is greedy) and the host-side flags."""
        holds_back = self.sampler.holds_back
        flags, needed = host_sampling_flags(seqs, holds_back)
        if not needed:
            return {}, flags
        return {f"s_{k}": v for k, v in host_sampling_arrays(seqs, holds_back).items()}, flags

    def _sampling_batch(self, dev: dict[str, torch.Tensor], flags: dict) -> SamplingBatch:
        if "s_temperature" not in dev:
            empty = torch.empty(0, device=self.device)
            return SamplingBatch(*([empty] * 8), any_penalty=False)
        return SamplingBatch(*(dev[f"s_{n}"] for n in SAMPLING_FIELDS), **flags)

    def _decode(self, seqs: list[Sequence], feed: torch.Tensor | None):
        n = len(seqs)
        bucket = next((b for b in self.graph_buckets if b >= n), n) if self.graphs else n
        bs = self.block_size
        idx = [s.num_computed for s in seqs]
        ids = [s.token_ids[i] for s, i in zip(seqs, idx)]
        # a prompt's last token (alone after a prefix hit or a chunk) has its own position: `i + delta`
        # holds for generated tokens, and for a prompt's end only where no video's time axis runs past
        # its text (Qwen2.5-VL: a video's seconds outrun its tokens)
        pos = [int(s.prompt_positions[0, i]) if i < s.prompt_len else i + s.rope_delta for s, i in zip(seqs, idx)]
        slots = [s.block_table[i // bs] * bs + i % bs for s, i in zip(seqs, idx)]
        lens = [i + 1 for i in idx]
        rows = [s.row for s in seqs]
        pad = bucket - n
        if pad:
            ids += [0] * pad
            pos += [0] * pad
            slots += [0] * pad
            lens += [1] * pad
            rows += [self.tables.padding_row] * pad
        table_idx, table_val = self.tables.updates(seqs)
        sampling, flags = self._sampling(seqs)
        dev = self.inputs.pack({"graph": np.array([ids, pos, slots, lens, rows], dtype=np.int32),
                                "table_idx": table_idx, "table_val": table_val, **sampling})
        self.tables.apply(dev["table_idx"], dev["table_val"])
        self._feed_placeholders(dev["graph"][0], feed, min(ids) < 0)
        if bucket in self.graphs:
            self.graphs[bucket].replay()
            logits = self.logits_out[:n]
            graph = "decode"
        else:
            logits = self.decode_forward(dev["graph"], bucket)[:n]
            graph = ""
        return logits, self._sampling_batch(dev, flags), graph

    def _decode_meta(self, lens: torch.Tensor, rows: torch.Tensor, b: int) -> AttentionMetadata:
        ar = torch.arange(b + 1, dtype=torch.int32, device=self.device)
        return AttentionMetadata(ar, lens, rows, self.tables.tensor, ar[:b], torch.zeros(b, dtype=torch.int32,
                                 device=self.device), self.decode_block_q, self.block_size, decode_block_n(b),
                                 decode_kv_splits(b, self.model.local.kv_heads, self.sms, self.most_kv_splits)
                                 if self.sms else 1,
                                 host_query_start=np.arange(b + 1), host_seq_lens=None, host_block_tables=None)

    def decode_forward(self, graph_in: torch.Tensor, b: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The decode forward on the fixed layout [ids, positions, slots, lens, rows] x b."""
        ids, pos, slots, lens, rows = graph_in.unbind(0)
        meta = self._decode_meta(lens, rows, b)
        if self.device.type != "cuda":  # the CPU path reads the layout on the host
            meta.host_seq_lens = lens.numpy()
            meta.host_block_tables = [self.tables.tensor[r].tolist() for r in rows.tolist()]
        return self.model.logits(self.model(ids, pos, slots, self.kv, meta), out)

    def _step_arrays(self, plan: StepPlan) -> tuple[dict[str, np.ndarray], list[int], list]:
        """A step's host arrays (StepLayout.FIELDS, unpadded), its sampling rows' places in the flat
        batch, and its vision parts (sequence, first row, end row of the sequence's vision embeddings)."""
        bs = self.block_size
        ids, pos, slots, qlens, lens, rows, logit_rows, vis_rows, vis_parts = [], [], [], [], [], [], [], [], []
        offset = 0
        for i, (s, n) in enumerate(zip(plan.seqs, plan.num_tokens)):
            start, end = s.num_computed, s.num_computed + n
            ids.extend(s.token_ids[start:end])
            pos.append(s.positions(start, end))
            j = np.arange(start, end)
            table = np.asarray(s.block_table, dtype=np.int64)
            slots.append(table[j // bs] * bs + j % bs)
            qlens.append(n)
            lens.append(end)
            rows.append(s.row)
            if plan.sample[i]:
                logit_rows.append(offset + n - 1)
            offs, r0, r1 = s.vision_rows(start, end)
            if len(offs):
                s.vision_to_device()  # first chunk: start the pinned copy (inside the step's error handling)
                vis_rows.append(offs + offset)
                vis_parts.append((s, r0, r1))
            offset += n
        qlens_np = np.array(qlens, dtype=np.int32)
        wseq, wq0 = work_table(qlens_np, self.prefill_block_q)
        vis_mask = np.zeros(offset, dtype=np.int32)
        vis_idx = np.concatenate(vis_rows).astype(np.int32) if vis_rows else np.zeros(0, np.int32)
        vis_mask[vis_idx] = 1
        arrays = {"ids": np.array(ids, dtype=np.int32), "pos": np.concatenate(pos, axis=1),
                  "slots": np.concatenate(slots).astype(np.int32), "vis_mask": vis_mask,
                  "qstart": np.concatenate([[0], np.cumsum(qlens_np)]).astype(np.int32),
                  "lens": np.array(lens, dtype=np.int32), "rows": np.array(rows, dtype=np.int32),
                  "wseq": wseq, "wq0": wq0, "vis_idx": vis_idx}
        return arrays, logit_rows, vis_parts

    def _step_bucket(self, tokens: int) -> int | None:
        """The smallest step graph that holds `tokens`, None when there is none."""
        return next((b for b in self.step_buckets if b >= tokens), None) if self.step_graphs else None

    def step_layout(self, tokens: int) -> StepLayout:
        """A step graph's layout: room for every running request and one padding sequence, and for the
        most attention programs `tokens` rows can make (each sequence rounds its queries up once)."""
        work = -(-tokens // self.prefill_block_q) + self.max_num_seqs
        return StepLayout(tokens, self.max_num_seqs + 1, work)

    def _mixed(self, plan: StepPlan, sampling_rows: list[Sequence], feed: torch.Tensor | None, keep: list):
        """A step that is not a pure decode: replayed from the step graph of its token bucket, or eager
        (no graphs: the CPU, `cuda_graphs` off)."""
        a, logit_rows, vis_parts = self._step_arrays(plan)
        t = len(a["ids"])
        bucket = self._step_bucket(t)
        layout = self.step_layout(bucket) if bucket else StepLayout(t, len(a["lens"]), len(a["wseq"]))
        table_idx, table_val = self.tables.updates(plan.seqs)
        sampling, flags = self._sampling(sampling_rows)
        dev = self.inputs.pack({"step": layout.fill(a, self.tables.padding_row),
                                "logit_rows": np.array(logit_rows, dtype=np.int32), "vis_idx": a["vis_idx"],
                                "table_idx": table_idx, "table_val": table_val, **sampling})
        self.tables.apply(dev["table_idx"], dev["table_val"])
        v = layout.views(dev["step"])
        self._feed_placeholders(v["ids"], feed, bool(t) and a["ids"].min() < 0)
        if vis_parts:
            idx = dev["vis_idx"].long()
            self.vision_main.index_copy_(0, idx, torch.cat([s.vision_main[r0:r1] for s, r0, r1 in vis_parts]))
            if self.vision_deepstack is not None:
                self.vision_deepstack.index_copy_(1, idx, torch.cat([s.vision_deepstack[:, r0:r1]
                                                                     for s, r0, r1 in vis_parts], dim=1))
            keep.extend((s.vision_main, s.vision_deepstack) for s, _, _ in vis_parts)  # read by queued kernels
        if bucket:
            self.step_graphs[bucket].replay()
            h, graph = self.step_hidden[:bucket], "step"
        else:
            h = self.step_forward(v, t, vision=bool(vis_parts), host=(a, plan))
            graph = ""
        logits = self.model.logits(h[dev["logit_rows"].long()]) if logit_rows else None
        return logits, self._sampling_batch(dev, flags), graph

    def step_forward(self, v: dict[str, torch.Tensor], tokens: int, vision: bool, host=None) -> torch.Tensor:
        """The forward over a step layout's device views `v` (`tokens` rows). `host`: the step's host
        arrays and plan, for the CPU's attention (None in a graph: the kernel reads only the device views)."""
        meta = AttentionMetadata(v["qstart"], v["lens"], v["rows"], self.tables.tensor, v["wseq"], v["wq0"],
                                 self.prefill_block_q, self.block_size)
        if host is not None:
            a, plan = host
            meta.host_query_start, meta.host_seq_lens = a["qstart"], a["lens"]
            meta.host_block_tables = [s.block_table for s in plan.seqs]
        batch = None
        if vision:
            ds = self.vision_deepstack[:, :tokens] if self.vision_deepstack is not None else None
            batch = VisionBatch(v["vis_mask"], self.vision_main[:tokens], ds)
        return self.model(v["ids"], v["pos"], v["slots"], self.kv, meta, batch)
