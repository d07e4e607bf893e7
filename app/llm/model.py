"""Our own forward for the Qwen-family text decoder, over the flattened tokens of a whole step.

One forward serves every step: decodes and prefill chunks of different requests side by side, as
one [tokens, hidden] matrix (no padding, no batch dimension). Per layer: RMSNorm, one fused qkv
GEMM, q/k RMSNorm + rotary + KV-cache write in one kernel, paged attention, o GEMM, residual +
RMSNorm, then the feed-forward part: one gate/up GEMM, SiLU*mul, down GEMM for a dense layer, or
the router and the fused experts (moe.py) for a sparse one. Vision embeddings replace the
placeholder tokens' embeddings. Under tensor parallelism (parallel.py) each rank holds its share
of the heads, units and vocabulary, and the o and down products are summed across ranks.

The parameters hold transformers' tensors, or this rank's share of them (weights.py loads them by
name); `TextSpec` (spec.py) says what differs between the families.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionMetadata, paged_attention
from .fused_moe import sum_over_k
from .gemv import GemvTable
from .kernels import add_rmsnorm, qk_norm_rope_store, silu_mul
from .moe import moe_forward
from .parallel import SINGLE, TensorParallel
from .spec import TextSpec


@dataclass
class VisionBatch:
    """Vision tokens of a step, laid out over all T rows of the flat batch: `mask` [T] is nonzero on the
    vision rows, `main` [T, hidden] holds their embeddings and `deepstack` [layers, T, hidden] their
    deepstack features (None if the model has none); other rows of `main` and `deepstack` hold anything.

    Dense rather than (index, values) so that every shape is the step's: a CUDA graph of a whole step
    reads the same buffers whatever number of vision rows it carries."""

    mask: torch.Tensor
    main: torch.Tensor
    deepstack: torch.Tensor | None = None

    @classmethod
    def from_rows(cls, index: torch.Tensor, main: torch.Tensor, deepstack: torch.Tensor | None,
                  tokens: int) -> VisionBatch:
        """From the vision rows' indices in a step of `tokens` rows, their embeddings [n, hidden] and
        deepstack features [layers, n, hidden]."""
        index = index.long()
        mask = torch.zeros(tokens, dtype=torch.int32, device=main.device).index_fill_(0, index, 1)
        dense = main.new_zeros(tokens, main.shape[1]).index_copy_(0, index, main)
        ds = None
        if deepstack is not None:
            ds = deepstack.new_zeros(deepstack.shape[0], tokens, deepstack.shape[2]).index_copy_(1, index, deepstack)
        return cls(mask, dense, ds)


@dataclass(frozen=True)
class LocalShapes:
    """This rank's share of the spec's dimensions."""

    heads: int
    kv_heads: int
    intermediate: int  # dense MLP units
    experts: int  # experts held (all under "tp", a share under "ep")
    expert_intermediate: int  # units per held expert
    vocab: int  # vocabulary rows (padded equal across ranks)

    @classmethod
    def of(cls, s: TextSpec, tp: TensorParallel) -> LocalShapes:
        h0, h1 = tp.part(s.heads, "attention heads")
        _, kv = tp.kv_heads(s.heads, s.kv_heads)
        inter = s.intermediate // tp.size if s.intermediate and s.layers > len(s.sparse_layers) else 0
        if inter:
            tp.part(s.intermediate, "MLP units")
        experts, expert_inter = s.experts, s.expert_intermediate
        if s.experts and tp.enabled:
            if tp.moe == "ep":
                experts = s.experts // tp.size
                tp.part(s.experts, "experts")
            else:
                expert_inter = s.expert_intermediate // tp.size
                tp.part(s.expert_intermediate, "expert units")
        return cls(h1 - h0, kv, inter, experts, expert_inter, tp.padded_part(s.vocab)[2])


class DecoderLayer(nn.Module):
    def __init__(self, s: TextSpec, local: LocalShapes, sparse: bool, param):
        super().__init__()
        qkv = (local.heads + 2 * local.kv_heads) * s.head_dim
        self.qkv_weight = param(qkv, s.hidden)
        self.qkv_bias = param(qkv) if s.qkv_bias else None
        self.o_weight = param(s.hidden, local.heads * s.head_dim)
        self.q_norm = param(s.head_dim) if s.qk_norm else None
        self.k_norm = param(s.head_dim) if s.qk_norm else None
        self.input_norm = param(s.hidden)
        self.post_attention_norm = param(s.hidden)
        self.sparse = sparse
        if sparse:
            self.router_weight = param(s.experts, s.hidden)
            self.experts_gate_up = param(local.experts, 2 * local.expert_intermediate, s.hidden)
            self.experts_down = param(local.experts, s.hidden, local.expert_intermediate)
        else:
            self.gate_up_weight = param(2 * local.intermediate, s.hidden)
            self.down_weight = param(s.hidden, local.intermediate)


class TextModel(nn.Module):
    def __init__(self, spec: TextSpec, dtype: torch.dtype, device: torch.device, max_position: int,
                 tp: TensorParallel = SINGLE):
        super().__init__()
        self.spec, self.dtype, self.device, self.tp = spec, dtype, device, tp
        self.local = local = LocalShapes.of(spec, tp)
        # one- and two-token steps' projections: Triton matrix-vector products where the engine's start-up
        # timing found them faster than cuBLAS (gemv.py; empty, as on the CPU: F.linear throughout)
        self.gemv = GemvTable()

        def param(*shape):
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)

        self.embed = param(local.vocab, spec.hidden)
        self.layers = nn.ModuleList(DecoderLayer(spec, local, spec.is_sparse(i), param) for i in range(spec.layers))
        self.norm = param(spec.hidden)
        self.lm_head = None if spec.tie_embeddings else param(local.vocab, spec.hidden)
        self.scale = spec.head_dim ** -0.5
        self.vocab_start = tp.padded_part(spec.vocab)[0]
        # transformers computes cos/sin in float32 from position * inv_freq, then casts to the model's
        # dtype: a table of the same products, cast once, gives the same values
        inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, spec.head_dim, 2, dtype=torch.float) / spec.head_dim))
        freqs = torch.arange(max_position, dtype=torch.float)[:, None] * inv_freq[None, :]
        self.register_buffer("cos_table", freqs.cos().to(device, dtype), persistent=False)
        self.register_buffer("sin_table", freqs.sin().to(device, dtype), persistent=False)
        axes = torch.tensor(spec.rope_axes, dtype=torch.long, device=device)
        self.register_buffer("rope_axes", axes, persistent=False)
        self.register_buffer("rope_cols", torch.arange(len(spec.rope_axes), device=device), persistent=False)
        self.multi_axis = bool(axes.any())

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed if self.lm_head is None else self.lm_head

    # ------------------------------------------------------------------ forward
    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [3, T] (or [T] when the three axes agree: text, decode) -> cos, sin [T, head_dim / 2],
        each frequency taken from its own axis's position."""
        if positions.dim() == 1 or not self.multi_axis:
            p = positions if positions.dim() == 1 else positions[0]
            return self.cos_table[p], self.sin_table[p]
        # [T, half], row-major: the kernels index cos/sin as t * half + j (a transposed index would make
        # a transposed gather, whose rows are not the tokens' rows)
        per_freq = positions.long().t().index_select(1, self.rope_axes).contiguous()
        flat = per_freq * self.cos_table.shape[1] + self.rope_cols
        return self.cos_table.view(-1)[flat], self.sin_table.view(-1)[flat]

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.enabled:
            return F.embedding(input_ids, self.embed)
        local = input_ids.long() - self.vocab_start
        mine = (local >= 0) & (local < self.embed.shape[0])
        x = F.embedding(local.clamp(0, self.embed.shape[0] - 1), self.embed) * mine.unsqueeze(1).to(self.dtype)
        return self.tp.all_reduce(x)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, vision: VisionBatch | None = None) -> torch.Tensor:
        """-> final-normed hidden states [T, hidden]. positions [3, T] or [T]; kv_cache [layers, 2, KV
        slots, kv_heads, head_dim]; slots: each token's KV slot (its place in the cache)."""
        x = self.embed_tokens(input_ids)
        on = None
        if vision is not None:
            on = (vision.mask != 0).unsqueeze(1)
            x = torch.where(on, vision.main, x)
        cos, sin = self.rotary(positions)
        residual, pending = x, None
        deepstack = vision.deepstack if vision is not None else None
        for i, layer in enumerate(self.layers):
            residual, h = add_rmsnorm(residual, pending, layer.input_norm, self.spec.eps)
            o = self._attention(layer, h, cos, sin, kv_cache[i, 0], kv_cache[i, 1], slots, meta)
            residual, h = add_rmsnorm(residual, o, layer.post_attention_norm, self.spec.eps)
            pending = self._feed_forward(layer, h)
            if deepstack is not None and i < deepstack.shape[0]:
                # transformers adds the features to the layer's output on the vision rows: the same sum,
                # rounded the same way, selected per row
                if pending.dim() == 3:  # an MoE block's experts, unsummed (_feed_forward)
                    pending = sum_over_k(pending)
                residual = residual + pending
                residual = torch.where(on, residual + deepstack[i], residual)
                pending = None
        _, h = add_rmsnorm(residual, pending, self.norm, self.spec.eps)
        return h

    def _attention(self, layer: DecoderLayer, h, cos, sin, k_cache, v_cache, slots, meta) -> torch.Tensor:
        local = self.local
        qkv = self.gemv.linear(h, layer.qkv_weight, layer.qkv_bias)
        q = qk_norm_rope_store(qkv, layer.q_norm, layer.k_norm, cos, sin, k_cache, v_cache, slots, local.heads,
                               local.kv_heads, self.spec.eps)
        o = paged_attention(q, k_cache, v_cache, meta, self.scale)
        return self.tp.all_reduce(self.gemv.linear(o.view(h.shape[0], -1), layer.o_weight))

    def _feed_forward(self, layer: DecoderLayer, h: torch.Tensor) -> torch.Tensor:
        if layer.sparse:
            # On one rank a few tokens' k expert rows may come back unsummed ([T, k, hidden]): the next
            # add+RMSNorm sums them, one kernel less per layer. Across ranks the sum comes first, so
            # that the all-reduce moves one row per token.
            out = moe_forward(h, layer.router_weight, layer.experts_gate_up, layer.experts_down, self.spec, self.tp,
                              sum_k=self.tp.enabled, linear=self.gemv.linear)
        else:
            out = self.gemv.linear(silu_mul(self.gemv.linear(h, layer.gate_up_weight)), layer.down_weight)
        return self.tp.all_reduce(out)

    def projection_weights(self) -> dict[tuple[int, int], list[torch.Tensor]]:
        """Every layer's weight of each projection shape (N, K) that `gemv` may take: qkv, o, the MoE
        router, the dense MLP's gate/up and down (GemvTable.tune reads them in turn)."""
        out: dict[tuple[int, int], list[torch.Tensor]] = {}
        for layer in self.layers:
            names = ("qkv_weight", "o_weight") + (("router_weight",) if layer.sparse else
                                                   ("gate_up_weight", "down_weight"))
            for name in names:
                w = getattr(layer, name)
                out.setdefault(tuple(w.shape), []).append(w)
        return out

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[T, vocab]; into `out` when given (a CUDA graph's fixed output buffer)."""
        if not self.tp.enabled:
            return F.linear(hidden, self.head_weight) if out is None else torch.mm(hidden, self.head_weight.t(), out=out)
        full = self.tp.all_gather_columns(F.linear(hidden, self.head_weight))[:, :self.spec.vocab]
        return full if out is None else out.copy_(full)
