"""Continuous-batching text generation for Qwen3-VL, fed precomputed vision embeddings.

- Prefill runs new requests together (left-padded, up to `max_prefill_tokens`) through transformers'
  own text model: vision embeddings spliced into the placeholders, deepstack features injected into
  the first layers, M-RoPE positions from the grids. Their keys and values are then copied into
  slots of a preallocated KV cache. If a batched prefill fails, each request is retried alone.
- Decode runs every running request in one batched step over the same modules. A decode token's
  three M-RoPE axes share one position (prompt length + delta), and attention reads each slot's
  prefix through a length mask. Finished slots are refilled by the last one, so the running batch
  always occupies slots [0, n) and attention reads a view of the cache, not a gather.
- A scheduler thread runs at most one (batched) prefill between decode steps, so new requests stall
  the running ones by one prefill at most. A cancelled request leaves at the next step. When every slot
  is busy, requests wait; past `max_waiting` they are refused with 503 and Retry-After.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from ..errors import ClientError
from ..sdpa_backends import UNCAPTURED
from .mrope import mrope_positions
from .sampling import SamplingParams
from .sequence import Chunk, Sequence

log = logging.getLogger(__name__)

__all__ = ["Chunk", "Engine", "GenerationRequest", "VisionInput", "request_from_dict", "resolve_dtype"]


@dataclass
class VisionInput:
    """Encoder output for one media item, in prompt order."""

    grid: tuple[int, int, int]
    main: torch.Tensor  # [n, hidden]
    deepstack: list[torch.Tensor]


@dataclass
class GenerationRequest:
    input_ids: list[int]
    mm_token_type_ids: list[int]
    vision: list[VisionInput] = field(default_factory=list)
    params: SamplingParams = field(default_factory=SamplingParams)


def request_from_dict(gen: dict, encoded: list) -> GenerationRequest:
    """The router's generation dict plus the encoder's (main, deepstack) per item, in prompt order."""
    vision = [VisionInput(tuple(g), main, ds) for g, (main, ds) in zip(gen["grids"], encoded, strict=True)]
    return GenerationRequest(gen["input_ids"], gen["mm_token_type_ids"], vision, SamplingParams(**gen["params"]))


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


class Engine:
    """`Engine(path, ...)` loads a checkpoint; `Engine.from_model(model, tokenizer, ...)` wraps one in memory."""

    def __init__(self, path: str | None = None, device: str = "cpu", dtype: str = "auto", max_model_len: int = 8192,
                 max_num_seqs: int = 8, max_waiting: int = 256, *, model=None, tokenizer=None,
                 cuda_graphs: bool = True, max_prefill_tokens: int = 8192):
        from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration
        from transformers.models.qwen3_vl.modeling_qwen3_vl import apply_rotary_pos_emb

        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        if model is None:
            model = Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=self.dtype)
            tokenizer = AutoTokenizer.from_pretrained(path)
        model.model.visual = None  # the encoder deployment owns the vision tower
        self.model = model.to(self.device, self.dtype).eval()
        self.text = model.model.language_model
        self.tokenizer = tokenizer
        self._rope = apply_rotary_pos_emb
        cfg = model.config
        tc = cfg.text_config
        self.merge = cfg.vision_config.spatial_merge_size
        self.image_id, self.video_id = cfg.image_token_id, cfg.video_token_id
        eos = model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) | {self.tokenizer.eos_token_id}
        self.max_model_len, self.max_num_seqs, self.max_waiting = max_model_len, max_num_seqs, max_waiting
        self.max_prefill_tokens = max_prefill_tokens
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.kv_heads = tc.num_key_value_heads
        self.head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []
        self.running: list[Sequence] = []
        self.waiting: collections.deque[tuple[Sequence, GenerationRequest]] = collections.deque()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self.steps = 0
        self.graph_steps = 0
        self.prefill_batches = 0
        self.peak_running = 0
        self.decode_graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.batch_buckets, self.span_buckets = self._buckets()
        if cuda_graphs:
            self.capture_decode_graphs()

    # ------------------------------------------------------------------ public
    def submit(self, req: GenerationRequest, on_chunk=None) -> Sequence:
        """Queue a request; its chunks go to `on_chunk` if given, else to `seq.next_chunk()`."""
        length = len(req.input_ids)
        if length >= self.max_model_len:
            raise ClientError(f"prompt of {length} tokens exceeds max_model_len {self.max_model_len}",
                              param="messages", code="context_length_exceeded")
        n_rows = sum(v.main.shape[0] for v in req.vision)
        seq = Sequence(length, req.params, min(req.params.max_tokens, self.max_model_len - length), self.tokenizer,
                       self.eos_ids, n_rows, self.device, on_chunk)
        with self._cv:
            if len(self.waiting) >= self.max_waiting:
                raise ClientError("the server is at capacity; retry shortly", status=503, type="server_busy",
                                  code="overloaded", headers={"Retry-After": "1"})
            self.waiting.append((seq, req))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="llm-scheduler", daemon=True)
                self._thread.start()
            self._cv.notify()
        return seq

    @classmethod
    def from_model(cls, model, tokenizer, device: str, dtype: str = "auto", **kw) -> Engine:
        return cls(None, device, dtype, model=model, tokenizer=tokenizer, **kw)

    def generate(self, req: GenerationRequest) -> Iterator[Chunk]:
        """Synchronous convenience: submit and yield chunks until the last; closing it cancels."""
        seq = self.submit(req)
        try:
            while True:
                chunk = seq.next_chunk()
                yield chunk
                if chunk.finish_reason:
                    return
        finally:
            seq.cancel()

    def load(self) -> dict:
        with self._cv:
            return {"running": len(self.running), "waiting": len(self.waiting),
                    "kv_usage": len(self.running) / self.max_num_seqs}

    # ------------------------------------------------------------------ scheduler
    def _loop(self) -> None:
        with torch.inference_mode():  # the KV cache is made of inference tensors
            while True:
                try:
                    self._iterate()
                except Exception as e:  # never let the scheduler die: fail what was running
                    log.exception("scheduler iteration failed")
                    for s in list(self.running):
                        self.running.remove(s)
                        s.fail(e)

    def _iterate(self) -> None:
        """Admit waiting requests into free slots (one batched prefill of at most max_prefill_tokens),
        then one decode step for all running."""
        with self._cv:
            while not self.running and not self.waiting:
                self._cv.wait()
            admit, tokens = [], 0
            while self.waiting and len(self.running) + len(admit) < self.max_num_seqs:
                seq, req = self.waiting[0]
                if seq.cancelled:
                    self.waiting.popleft()
                    continue
                if admit and tokens + len(req.input_ids) > self.max_prefill_tokens:
                    break
                self.waiting.popleft()
                admit.append((seq, req))
                tokens += len(req.input_ids)
        if admit:
            self._admit(admit)
        if self.running:
            self._step()

    def _admit(self, batch: list[tuple[Sequence, GenerationRequest]]) -> None:
        try:
            logits = self._prefill(batch)
        except Exception as e:
            if len(batch) > 1:  # find the bad request: each alone
                for item in batch:
                    self._admit([item])
                return
            seq = batch[0][0]
            self._release_kv_for(seq)
            seq.fail(e)
            return
        for i, (seq, _) in enumerate(batch):
            seq.advance(seq.sample(logits[i]))
            if seq.finished:
                self._release_kv_for(seq)

    # ------------------------------------------------------------------ KV cache
    def _ensure_kv(self) -> None:
        if self._k:
            return
        shape = (self.max_num_seqs, self.kv_heads, self.max_model_len, self.head_dim)
        for _ in self.text.layers:
            self._k.append(torch.zeros(shape, dtype=self.dtype, device=self.device))
            self._v.append(torch.zeros(shape, dtype=self.dtype, device=self.device))

    def _release_kv_for(self, seq: Sequence) -> None:
        """Drop `seq` from the running set, moving the last running sequence into its slot."""
        if seq not in self.running:
            return
        i = self.running.index(seq)
        last = self.running[-1]
        if last is not seq:
            n = last.kv_len
            for k, v in zip(self._k, self._v):
                k[i, :, :n] = k[last.slot, :, :n]
                v[i, :, :n] = v[last.slot, :, :n]
            self.running[i] = last
            last.slot = i
        self.running.pop()

    # ------------------------------------------------------------------ decode graphs
    def _buckets(self) -> tuple[list[int], list[int]]:
        """Batch sizes 1, 2, 4, ... up to max_num_seqs; attention spans 256, 512, ... up to max_model_len."""
        def doubling(lo: int, hi: int) -> list[int]:
            out, v = [], lo
            while v < hi:
                out.append(v)
                v *= 2
            return [*out, hi]

        return doubling(1, self.max_num_seqs), doubling(min(256, self.max_model_len), self.max_model_len)

    @torch.inference_mode()
    def capture_decode_graphs(self) -> None:
        """Capture one decode step per (batch bucket, span bucket) into one pool (CUDA only)."""
        if self.device.type != "cuda":
            return
        self._ensure_kv()
        t0 = time.perf_counter()
        # tokens, positions, lengths: one buffer, so each step is a single host-to-device copy
        self._g_in = torch.zeros(3, self.max_num_seqs, dtype=torch.long, device=self.device)
        self._g_tok, self._g_pos, self._g_len = self._g_in.unbind(0)
        batches, spans = self.batch_buckets, self.span_buckets
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up outside capture
            self._decode(self._g_tok, self._g_pos, self._g_len, spans[-1])
        torch.cuda.current_stream(self.device).wait_stream(side)
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(batches):
            for span in reversed(spans):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    out = self._decode(self._g_tok[:b], self._g_pos[:b], self._g_len[:b], span)
                self.decode_graphs[b, span] = (g, out)
        for k in self._k + self._v:  # the captures wrote dummy rows
            k.zero_()
        torch.cuda.synchronize(self.device)
        log.info("captured %d decode graphs in %.2f s", len(self.decode_graphs), time.perf_counter() - t0)

    def _run_decode(self, tokens: list[int], positions: list[int], lengths: list[int]) -> torch.Tensor:
        n, need = len(tokens), max(lengths) + 1
        if self.decode_graphs:
            b = next(x for x in self.batch_buckets if x >= n)
            span = next(x for x in self.span_buckets if x >= need)
            pad = [0] * (b - n)  # padded rows write position 0 of free slots [n, b): never read
            self._g_in[:, :b].copy_(torch.tensor([tokens + pad, positions + pad, lengths + pad]), non_blocking=True)
            g, out = self.decode_graphs[b, span]
            g.replay()
            self.graph_steps += 1
            return out[:n]
        dev = self.device
        with sdpa_kernel(UNCAPTURED):
            return self._decode(torch.tensor(tokens, device=dev), torch.tensor(positions, device=dev),
                                torch.tensor(lengths, device=dev), need)

    # ------------------------------------------------------------------ model
    @torch.inference_mode()
    def _prefill(self, batch: list[tuple[Sequence, GenerationRequest]]) -> torch.Tensor:
        """One forward over several prompts, left-padded; their KV goes to new slots. -> logits [n, vocab]."""
        from transformers import DynamicCache

        self._ensure_kv()
        lens = [len(req.input_ids) for _, req in batch]
        width, n = max(lens), len(batch)
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((n, width), dtype=torch.long)
        position_ids = torch.zeros((4, n, width), dtype=torch.long)
        deltas, vision = [], []
        for i, (_, req) in enumerate(batch):
            pad = width - lens[i]
            ids[i, pad:] = torch.tensor(req.input_ids)
            attn[i, pad:] = 1
            pos, delta = mrope_positions(req.mm_token_type_ids, [v.grid for v in req.vision], self.merge)
            position_ids[0, i, pad:] = torch.arange(lens[i])
            position_ids[1:, i, pad:] = pos
            deltas.append(delta)
            rows = sum(v.main.shape[0] for v in req.vision)
            slots = sum(1 for t in req.input_ids if t in (self.image_id, self.video_id))
            if slots != rows:
                raise ValueError(f"prompt has {slots} vision placeholders but the encoder produced {rows} embeddings")
            vision.extend(req.vision)
        ids, attn, position_ids = ids.to(self.device), attn.to(self.device), position_ids.to(self.device)
        embeds = self.text.embed_tokens(ids)
        mask = ((ids == self.image_id) | (ids == self.video_id)) & attn.bool()
        deepstack = None
        if vision:  # row-major order of the mask = request order, then position: the concatenation order
            main = torch.cat([v.main for v in vision]).to(self.device, embeds.dtype)
            embeds = embeds.masked_scatter(mask[..., None], main)
            deepstack = [torch.cat([v.deepstack[j] for v in vision]).to(self.device, embeds.dtype)
                         for j in range(len(vision[0].deepstack))]
        cache = DynamicCache(config=self.model.config.text_config)
        with sdpa_kernel(UNCAPTURED):  # prefill shapes change with every batch: no cuDNN plans
            out = self.text(inputs_embeds=embeds, attention_mask=attn if n > 1 else None, position_ids=position_ids,
                            past_key_values=cache, use_cache=True, visual_pos_masks=mask if vision else None,
                            deepstack_visual_embeds=deepstack)
        for i, (seq, _) in enumerate(batch):
            seq.slot = len(self.running)
            pad = width - lens[i]
            for li, layer in enumerate(cache.layers):
                self._k[li][seq.slot, :, :lens[i]] = layer.keys[i, :, pad:]
                self._v[li][seq.slot, :, :lens[i]] = layer.values[i, :, pad:]
            seq.kv_len, seq.rope_delta = lens[i], deltas[i]
            self.running.append(seq)
        self.peak_running = max(self.peak_running, len(self.running))
        self.prefill_batches += 1
        return self.model.lm_head(out.last_hidden_state[:, -1])

    @torch.inference_mode()
    def _decode(self, tokens: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor, span: int) -> torch.Tensor:
        """One token for each of the first B slots: tokens/positions/lengths [B] -> logits [B, vocab].
        Attention reads the first `span` cache positions of each slot (span > every length)."""
        b = tokens.shape[0]
        x = self.text.embed_tokens(tokens)[:, None, :]
        cos, sin = self.text.rotary_emb(x, positions.view(1, b, 1).expand(3, b, 1))
        rows = torch.arange(b, device=self.device)
        visible = (torch.arange(span, device=self.device)[None, :] <= lengths[:, None])[:, None, None, :]
        for li, layer in enumerate(self.text.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_norm(attn.q_proj(h).view(b, 1, -1, self.head_dim)).transpose(1, 2)
            k = attn.k_norm(attn.k_proj(h).view(b, 1, -1, self.head_dim)).transpose(1, 2)
            v = attn.v_proj(h).view(b, 1, -1, self.head_dim).transpose(1, 2)
            q, k = self._rope(q, k, cos, sin)
            self._k[li][rows, :, lengths] = k[:, :, 0]
            self._v[li][rows, :, lengths] = v[:, :, 0]
            o = F.scaled_dot_product_attention(q, self._k[li][:b, :, :span], self._v[li][:b, :, :span],
                                               attn_mask=visible, scale=attn.scaling, enable_gqa=True)
            x = x + attn.o_proj(o.transpose(1, 2).reshape(b, 1, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.lm_head(self.text.norm(x)[:, 0])

    def _step(self) -> None:
        for seq in [s for s in self.running if s.cancelled]:
            self._release_kv_for(seq)
        if not self.running:
            return
        seqs = list(self.running)
        tokens = [s.next_token for s in seqs]
        lengths = [s.kv_len for s in seqs]
        positions = [n + s.rope_delta for n, s in zip(lengths, seqs)]
        try:
            logits = self._run_decode(tokens, positions, lengths)
        except Exception as e:  # e.g. out of memory: fail the batch, keep serving
            for s in seqs:
                self._release_kv_for(s)
                s.fail(e)
            return
        self.steps += 1
        for i, s in enumerate(seqs):
            s.kv_len += 1
            s.advance(s.sample(logits[i]))
        for s in seqs:
            if s.finished:
                self._release_kv_for(s)
