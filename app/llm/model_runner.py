"""Runs one planned step on the device: inputs in, sampled token ids out.

Host time per step is what caps a Python engine, so a step does little on the host:
- every input of the step (token ids, positions, KV slots, attention layout, block-table changes,
  sampling parameters) is laid out in one pinned buffer and copied to the device once;
- decode-only steps replay a CUDA graph of the whole forward (and lm_head) for the smallest
  captured batch bucket that holds them;
- every other step (prefill chunks, alone or beside decodes) replays a "step graph": the forward over
  the smallest captured token bucket that holds the step's tokens, padded (`StepLayout`). Launched
  eagerly, the ~300 kernels of a 28-layer forward took about 6 ms of host time on an H200's host,
  as long as the GPU's work for 1000 tokens and three times its work for 256; and a busy event loop
  sharing the GIL stretched that further. Replayed, the launch is one call. Logits and sampling
  run after the replay, on the step's sampling rows only;
- sampling for the whole batch runs on the device, and the token ids come back in one copy (and,
  in steps where a request asked for them, the rows' log-probabilities in one more).

A step is launched (`launch`) and collected (`collect`) separately, so the engine can prepare and
queue step N+1 while step N runs (`llm.overlap_steps`): a token sampled in step N that step N+1
feeds back is a placeholder on the host, -(k + 1) for step N's k-th sampled row, and is taken from
step N's token tensor on the device. The pinned host buffers (step inputs, sampled tokens) come in
pairs for that: step N's copies may still be queued while step N+1 fills the other one.

Block tables live on the device, one row per running request; a step sends only the entries that
changed since the last. The KV cache is one tensor [layers, 2, blocks x block_size, kv_heads,
head_dim]: sized from the free GPU memory after the weights and a forward at the step's token
budget (`gpu_memory_utilization` of it), nothing per request.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..capture import collection_paused
from .attention import AttentionMetadata, block_q_for, decode_block_n, work_table
from .model import TextModel, VisionBatch
from .sampler import Sampler, SamplingBatch, host_sampling_arrays
from .sampling import MAX_LOGPROBS
from .scheduler import StepPlan
from .sequence import Sequence

log = logging.getLogger(__name__)

DECODE_BLOCK_M = 16  # query rows per attention program in decode steps (1 token x the GQA group, padded)
PREFILL_BLOCK_M = 64


def decode_buckets(max_batch: int) -> list[int]:
    """Batch sizes with a decode graph: 1, 2, 4, 8, then every multiple of 8 up to max_batch."""
    out = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return sorted(set(out + [max_batch]))


def step_buckets(max_tokens: int) -> list[int]:
    """Token counts with a step graph: 16, 32, 64, 128, then every 128 up to 1024, every 256 up to 4096,
    every 512 beyond, and max_tokens itself. A step pads to at most twice its tokens up to 128, then by
    fewer than 128 tokens up to 1024 (2.4% of a 1000-token prompt), 256 up to 4096, 512 beyond: 15
    graphs for the default 2048-token budget."""
    out, b = [], 16
    while b < max_tokens:
        out.append(b)
        b = 2 * b if b < 128 else b + (128 if b < 1024 else 256 if b < 4096 else 512)
    return out + [max_tokens]


class StepLayout:
    """Where a step's forward reads its inputs: int32 arrays for `tokens` rows, `seqs` sequences and
    `work` attention programs, each on a 16-byte boundary, in one array that `StepInputs.pack` puts at
    the start of the device buffer (the fixed addresses a step graph was captured on).

    A step graph's layout is larger than the steps it serves; the tail entries are padding that does
    nothing: token rows write KV slot 0 (block 0, nobody's cache), sequences have no queries and no
    keys, and attention programs point at such a sequence."""

    FIELDS = ("ids", "pos", "slots", "vis_mask", "qstart", "lens", "rows", "wseq", "wq0")

    def __init__(self, tokens: int, seqs: int, work: int):
        self.tokens, self.seqs, self.work = tokens, seqs, work
        shapes = [(tokens,), (3, tokens), (tokens,), (tokens,), (seqs + 1,), (seqs,), (seqs,), (work,), (work,)]
        self.slices, off = {}, 0
        for name, shape in zip(self.FIELDS, shapes):
            n = int(np.prod(shape))
            self.slices[name] = (off, n, shape)
            off += -(-n // 4) * 4
        self.words = off

    def views(self, buf):
        """name -> view of a flat int32 buffer (numpy array or tensor) laid out this way."""
        return {name: buf[o:o + n].reshape(shape) for name, (o, n, shape) in self.slices.items()}

    def fill(self, a: dict[str, np.ndarray], padding_row: int) -> np.ndarray:
        """The flat array for a step's host arrays `a` (as `ModelRunner._step_arrays` makes them), padded."""
        out = np.zeros(self.words, dtype=np.int32)
        v = self.views(out)
        t, n, w = len(a["ids"]), len(a["lens"]), len(a["wseq"])
        for name in ("ids", "slots", "vis_mask"):
            v[name][:t] = a[name]
        v["pos"][:, :t] = a["pos"]
        v["qstart"][:n + 1] = a["qstart"]
        v["qstart"][n + 1:] = t
        v["lens"][:n] = a["lens"]
        v["rows"][:n] = a["rows"]
        v["rows"][n:] = padding_row
        v["wseq"][:w] = a["wseq"]
        v["wseq"][w:] = self.seqs - 1  # a padding sequence: padded layouts have one more than any step
        v["wq0"][:w] = a["wq0"]
        return out


class StepInputs:
    """Lays host arrays out in one int32 buffer, copies it to the device in one go, and returns device
    views. On the CPU the views are the host arrays themselves.

    Every array starts on a 16-byte boundary: Triton compiles a kernel per combination of its pointer
    arguments' 16-byte alignment, so arrays at arbitrary offsets made new compilations (about 0.5 s
    each, on an H200) appear at random while serving."""

    def __init__(self, device: torch.device, capacity: int):
        self.device = device
        self.frozen = False  # set once CUDA graphs read from the buffer: it must not move
        self._alloc(capacity)

    def _alloc(self, capacity: int) -> None:
        cuda = self.device.type == "cuda"
        # two pinned host buffers, used in turn: the previous step's copy may still be queued. Each has an
        # event recorded after its copy, waited on before the buffer is written again: a step that samples
        # nothing (a prompt's middle chunk) is never waited on otherwise, so with overlapped steps the
        # buffer of step N could be rewritten by step N + 2 while step N's copy still waits in the queue.
        self.hosts = [torch.empty(capacity, dtype=torch.int32, pin_memory=cuda) for _ in range(2 if cuda else 1)]
        self.copied = [torch.cuda.Event() if cuda else None for _ in self.hosts]
        self.turn = 0
        self.host = self.hosts[0]
        self.dev = torch.empty(capacity, dtype=torch.int32, device=self.device) if cuda else self.host

    def pack(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        layout, off = [], 0
        for name, a in arrays.items():
            a = np.ascontiguousarray(a)
            off = -(-off // 4) * 4  # 16 bytes
            words = a.dtype.itemsize // 4 * a.size
            layout.append((name, a, off, words))
            off += words
        if off > self.host.numel():
            if self.frozen:
                raise RuntimeError(f"step inputs of {off} words overflow the graph input buffer")
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()  # the old buffer may still be in flight
            self._alloc(max(off, 2 * self.host.numel()))
        self.turn = (self.turn + 1) % len(self.hosts)
        self.host = self.hosts[self.turn]
        copied = self.copied[self.turn]
        if copied is not None:
            copied.synchronize()  # this buffer's previous copy has left it (at once unless a step lags)
        host_np = self.host.numpy()
        for _, a, o, w in layout:
            host_np[o:o + w] = a.reshape(-1).view(np.int32)
        if self.dev is not self.host:
            self.dev[:off].copy_(self.host[:off], non_blocking=True)
            copied.record(torch.cuda.current_stream(self.device))  # the stream the copy is on
        dtypes = {np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64,
                  np.dtype(np.float32): torch.float32}
        return {name: self.dev[o:o + w].view(dtypes[a.dtype]).view(a.shape) for name, a, o, w in layout}


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
                 step_graphs: bool = True):
        self.model, self.device, self.dtype = model, model.device, model.dtype
        s = model.spec
        self.block_size, self.max_num_seqs = block_size, max_num_seqs
        self.max_blocks = -(-max_model_len // block_size)
        self.padding_row = max_num_seqs  # block-table row of padded graph rows: all zeros = block 0
        self.block_tables = torch.zeros(max_num_seqs + 1, self.max_blocks, dtype=torch.int32, device=self.device)
        self.written = [0] * max_num_seqs  # block-table entries already on the device, per row
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))
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
        self.decode_block_q = block_q_for(s.heads // s.kv_heads, DECODE_BLOCK_M)
        self.prefill_block_q = block_q_for(s.heads // s.kv_heads, PREFILL_BLOCK_M)
        self.tokens_host = [torch.empty(max_num_seqs, dtype=torch.int64, pin_memory=self.device.type == "cuda")
                            for _ in range(2)]  # in turn: one may still await its copy
        self._token_turn = 0
        # log-probabilities' pinned destinations, in turn like the tokens': per row the chosen token's,
        # up to MAX_LOGPROBS top values and their ids (sampler.token_logprobs)
        self.logprobs_host = [torch.empty(max_num_seqs * (1 + 2 * MAX_LOGPROBS), dtype=torch.float32,
                                          pin_memory=self.device.type == "cuda") for _ in range(2)]
        self.num_blocks = num_kv_blocks or self._blocks_that_fit(max_num_batched_tokens, max_model_len,
                                                                 gpu_memory_utilization)
        self.kv = torch.empty(s.layers, 2, self.num_blocks * block_size, s.kv_heads, s.head_dim,
                              dtype=self.dtype, device=self.device)
        self.kv[:, :, :block_size].zero_()  # block 0: where padded rows write; read only by them
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_buckets: list[int] = []
        self.step_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.step_buckets: list[int] = []
        if cuda_graphs and self.device.type == "cuda":
            self.capture_graphs(step_graphs)

    # ------------------------------------------------------------------ memory
    @property
    def bytes_per_block(self) -> int:
        s = self.model.spec
        return s.layers * 2 * self.block_size * s.kv_heads * s.head_dim * self.dtype.itemsize

    def _blocks_that_fit(self, max_tokens: int, max_model_len: int, utilization: float) -> int:
        if self.device.type != "cuda":  # the CPU: room for max_num_seqs requests of max_model_len
            return self.max_num_seqs * self.max_blocks + 1
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self._profile_forward(max_tokens, max_model_len)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(self.device)
        blocks = int(utilization * (free - peak) // self.bytes_per_block)
        log.info("KV cache: %d blocks of %d tokens (%.1f GiB; %.1f GiB free after weights, %.2f GiB peak "
                 "activations at %d tokens)", blocks, self.block_size, blocks * self.bytes_per_block / 2**30,
                 free / 2**30, peak / 2**30, max_tokens)
        if blocks < 2:
            raise RuntimeError("no GPU memory left for the KV cache")
        return blocks

    @torch.inference_mode()
    def _profile_forward(self, tokens: int, max_model_len: int) -> None:
        """The largest eager step, on a throw-away cache, to measure its activation memory."""
        s = self.model.spec
        kv = torch.zeros(s.layers, 2, self.block_size, s.kv_heads, s.head_dim, dtype=self.dtype, device=self.device)
        lens = [min(max_model_len, tokens - i) for i in range(0, tokens, max_model_len)]
        qstart = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        wseq, wq0 = work_table(np.array(lens), self.prefill_block_q)
        dev = self.device
        meta = AttentionMetadata(
            torch.tensor(qstart, device=dev), torch.tensor(lens, dtype=torch.int32, device=dev),
            torch.full((len(lens),), self.padding_row, dtype=torch.int32, device=dev), self.block_tables,
            torch.tensor(wseq, device=dev), torch.tensor(wq0, device=dev), self.prefill_block_q, self.block_size)
        ids = torch.zeros(tokens, dtype=torch.int32, device=dev)
        pos = torch.zeros(3, tokens, dtype=torch.int32, device=dev)
        slots = torch.zeros(tokens, dtype=torch.int32, device=dev)
        h = self.model(ids, pos, slots, kv, meta)
        rows = min(self.max_num_seqs, tokens)
        logits = self.model.logits(h[:rows])
        b = self._sampling_batch_worst_case(rows)
        self.sampler(logits, b)
        torch.cuda.synchronize(dev)

    def _sampling_batch_worst_case(self, rows: int) -> SamplingBatch:
        dev = self.device
        f = torch.full((rows,), 0.5, device=dev)
        return SamplingBatch(f, torch.full((rows,), 50, dtype=torch.int32, device=dev), f,
                             torch.zeros(rows, dtype=torch.int64, device=dev),
                             torch.zeros(rows, dtype=torch.int64, device=dev), f, f,
                             torch.zeros(rows, dtype=torch.int64, device=dev), all_greedy=False, max_top_k=50,
                             any_top_p=True, any_penalty=True)

    # ------------------------------------------------------------------ rows (block tables)
    def assign_row(self, seq: Sequence) -> None:
        seq.slot = self.free_rows.pop()
        self.written[seq.slot] = 0
        p = seq.params
        if p.frequency_penalty or p.presence_penalty:
            self.sampler.reset_counts(seq.slot, seq.output_ids)

    def release_row(self, seq: Sequence) -> None:
        if seq.slot >= 0:
            self.free_rows.append(seq.slot)
            seq.slot = -1

    def _table_updates(self, seqs: list[Sequence]) -> tuple[np.ndarray, np.ndarray]:
        idx, val = [], []
        for s in seqs:
            done = self.written[s.slot]
            if len(s.block_table) > done:
                base = s.slot * self.max_blocks
                idx.extend(range(base + done, base + len(s.block_table)))
                val.extend(s.block_table[done:])
                self.written[s.slot] = len(s.block_table)
        return np.array(idx, dtype=np.int32), np.array(val, dtype=np.int32)

    def _apply_table_updates(self, dev: dict[str, torch.Tensor]) -> None:
        if dev["table_idx"].numel():
            self.block_tables.view(-1)[dev["table_idx"]] = dev["table_val"]

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
            if s.slot < 0:
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
        ps = [s.params for s in seqs]
        flags = {"all_greedy": all(p.temperature == 0 for p in ps),
                 "any_penalty": any(p.frequency_penalty or p.presence_penalty for p in ps)}
        if flags["all_greedy"] and not flags["any_penalty"]:
            return {}, flags
        flags["max_top_k"] = max((p.top_k for p in ps), default=0)
        flags["any_top_p"] = any(p.top_p < 1.0 for p in ps)
        return {f"s_{k}": v for k, v in host_sampling_arrays(seqs).items()}, flags

    def _sampling_batch(self, dev: dict[str, torch.Tensor], flags: dict) -> SamplingBatch:
        if "s_temperature" not in dev:
            empty = torch.empty(0, device=self.device)
            return SamplingBatch(*([empty] * 8), any_penalty=False)
        names = ["temperature", "top_k", "top_p", "seeds", "steps", "frequency_penalty", "presence_penalty", "slots"]
        return SamplingBatch(*(dev[f"s_{n}"] for n in names), **flags)

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
        rows = [s.slot for s in seqs]
        pad = bucket - n
        if pad:
            ids += [0] * pad
            pos += [0] * pad
            slots += [0] * pad
            lens += [1] * pad
            rows += [self.padding_row] * pad
        table_idx, table_val = self._table_updates(seqs)
        sampling, flags = self._sampling(seqs)
        dev = self.inputs.pack({"graph": np.array([ids, pos, slots, lens, rows], dtype=np.int32),
                                "table_idx": table_idx, "table_val": table_val, **sampling})
        self._apply_table_updates(dev)
        self._feed_placeholders(dev["graph"][0], feed, min(ids) < 0)
        if bucket in self.graphs:
            self.graphs[bucket].replay()
            logits = self.logits_out[:n]
            graph = "decode"
        else:
            logits = self._decode_forward(dev["graph"], bucket)[:n]
            graph = ""
        return logits, self._sampling_batch(dev, flags), graph

    def _decode_meta(self, lens: torch.Tensor, rows: torch.Tensor, b: int) -> AttentionMetadata:
        ar = torch.arange(b + 1, dtype=torch.int32, device=self.device)
        return AttentionMetadata(ar, lens, rows, self.block_tables, ar[:b], torch.zeros(b, dtype=torch.int32,
                                 device=self.device), self.decode_block_q, self.block_size, decode_block_n(b),
                                 host_query_start=np.arange(b + 1), host_seq_lens=None, host_block_tables=None)

    def _decode_forward(self, graph_in: torch.Tensor, b: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The decode forward on the fixed layout [ids, positions, slots, lens, rows] x b."""
        ids, pos, slots, lens, rows = graph_in.unbind(0)
        meta = self._decode_meta(lens, rows, b)
        if self.device.type != "cuda":  # the CPU path reads the layout on the host
            meta.host_seq_lens = lens.numpy()
            meta.host_block_tables = [self.block_tables[r].tolist() for r in rows.tolist()]
        h = self.model(ids, pos, slots, self.kv, meta)
        if out is None:
            return self.model.logits(h)
        torch.mm(h, self.model.head_weight.t(), out=out)
        return out

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
            rows.append(s.slot)
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

    def _step_layout(self, tokens: int) -> StepLayout:
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
        layout = self._step_layout(bucket) if bucket else StepLayout(t, len(a["lens"]), len(a["wseq"]))
        table_idx, table_val = self._table_updates(plan.seqs)
        sampling, flags = self._sampling(sampling_rows)
        dev = self.inputs.pack({"step": layout.fill(a, self.padding_row),
                                "logit_rows": np.array(logit_rows, dtype=np.int32), "vis_idx": a["vis_idx"],
                                "table_idx": table_idx, "table_val": table_val, **sampling})
        self._apply_table_updates(dev)
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
            h = self._step_forward(v, t, vision=bool(vis_parts), host=(a, plan))
            graph = ""
        logits = self.model.logits(h[dev["logit_rows"].long()]) if logit_rows else None
        return logits, self._sampling_batch(dev, flags), graph

    def _step_forward(self, v: dict[str, torch.Tensor], tokens: int, vision: bool, host=None) -> torch.Tensor:
        """The forward over a step layout's device views `v` (`tokens` rows). `host`: the step's host
        arrays and plan, for the CPU's attention (None in a graph: the kernel reads only the device views)."""
        meta = AttentionMetadata(v["qstart"], v["lens"], v["rows"], self.block_tables, v["wseq"], v["wq0"],
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

    # ------------------------------------------------------------------ graphs
    @torch.inference_mode()
    def capture_graphs(self, step_graphs: bool = True) -> None:
        """Decode graphs, then step graphs, in one memory pool (each captured largest first, so smaller
        ones reuse its blocks); then block 0, which the captures wrote, is zeroed again."""
        pool = torch.cuda.graph_pool_handle()
        self.capture_decode_graphs(pool)
        if step_graphs:
            self.capture_step_graphs(pool)
        torch.cuda.synchronize(self.device)
        self.inputs.frozen = True
        self.kv[:, :, :self.block_size].zero_()

    def capture_decode_graphs(self, pool) -> None:
        t0 = time.perf_counter()
        s = self.model.spec
        self.graph_buckets = decode_buckets(self.max_num_seqs)
        top = self.graph_buckets[-1]
        self.logits_out = torch.empty(top, s.vocab, dtype=self.dtype, device=self.device)
        # the graphs read their inputs where `StepInputs.pack` puts the "graph" array: the buffer's start
        graph_in = self.inputs.dev
        side = torch.cuda.Stream(self.device)
        for b in reversed(self.graph_buckets):
            view = graph_in[:5 * b].view(5, b)
            view.copy_(torch.tensor([[0] * b, [0] * b, [0] * b, [1] * b, [self.padding_row] * b],
                                    dtype=torch.int32, device=self.device))
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm-up (Triton compiles and autotunes outside capture)
                self._decode_forward(view, b, self.logits_out[:b])
            torch.cuda.current_stream(self.device).wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with collection_paused(), torch.cuda.graph(g, pool=pool, capture_error_mode="thread_local"):
                self._decode_forward(view, b, self.logits_out[:b])
            self.graphs[b] = g
        torch.cuda.synchronize(self.device)
        log.info("captured %d decode graphs (batch %s) in %.2f s", len(self.graphs), self.graph_buckets,
                 time.perf_counter() - t0)

    def capture_step_graphs(self, pool) -> None:
        """One graph per token bucket of the whole forward over a padded StepLayout at the buffer's start,
        the vision rows included (a step without any has an all-zero mask); its final hidden states are
        copied to `step_hidden`, where the step's logit rows are taken from."""
        t0 = time.perf_counter()
        self.step_buckets = step_buckets(self.max_tokens)
        self.step_hidden = torch.empty(self.max_tokens, self.model.spec.hidden, dtype=self.dtype, device=self.device)
        empty = {"ids": [], "pos": np.zeros((3, 0)), "slots": [], "vis_mask": [], "qstart": [0], "lens": [],
                 "rows": [], "wseq": [], "wq0": []}
        side = torch.cuda.Stream(self.device)
        for b in reversed(self.step_buckets):
            layout = self._step_layout(b)
            if layout.words > self.inputs.dev.numel():
                raise RuntimeError(f"a {b}-token step graph's inputs overflow the step-input buffer")
            buf = self.inputs.dev[:layout.words]
            buf.copy_(torch.from_numpy(layout.fill(empty, self.padding_row)).to(self.device))  # a step of no tokens
            v = layout.views(buf)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self.step_hidden[:b].copy_(self._step_forward(v, b, vision=True))
            torch.cuda.current_stream(self.device).wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with collection_paused(), torch.cuda.graph(g, pool=pool, capture_error_mode="thread_local"):
                self.step_hidden[:b].copy_(self._step_forward(v, b, vision=True))
            self.step_graphs[b] = g
        torch.cuda.synchronize(self.device)
        log.info("captured %d step graphs (tokens %s) in %.2f s", len(self.step_graphs), self.step_buckets,
                 time.perf_counter() - t0)
