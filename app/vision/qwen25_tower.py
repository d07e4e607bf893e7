"""Qwen2.5-VL vision tower with a static-shape body that CUDA graphs can capture.

It runs on the parameters of transformers' `Qwen2_5_VisionTransformerPretrainedModel` (the same
modules, no copy of the weights). The reference derives the window permutation, the window and frame
`cu_seqlens` and the rotary position ids from `grid_thw` with host code inside its forward; here they
come in as tensors built outside any graph (qwen25_metadata.py): pixels --perm--> patch embed (a
matmul) -> blocks (window attention, full attention at fullatt_block_indexes; RMSNorm, SwiGLU, 2-D
rotary) -> merger --unperm--> embeddings. Attention is one block-diagonal call per layer
(attention.packed_attention) over windows (at most 64 patches) or frames. On CUDA the layers are
fused (`_forward_fused`, kernels.py: float32 residual stream, rotary straight from the qkv GEMM); the
CPU keeps the reference's op-for-op math.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import attention
from .kernels import add_bias_rmsnorm, rotary_qk, silu_mul, triton_available
from .metadata import BatchLayout, Grid, layout
from .qwen25_metadata import WindowGeometry, qwen25_metadata, window_slots
from .tower_api import GraphTower, TowerBatch

WINDOW_BLOCK_M = 64  # query rows per attention block for windows (a full window is 64 patches)


class Qwen25Tower(GraphTower):
    """Wraps a transformers `Qwen2_5_VisionTransformerPretrainedModel`; forward -> (embeddings, [])."""

    def __init__(self, visual: nn.Module, pixel_norm: tuple | None = None, fused: bool | None = None):
        """`fused` (default: on CUDA with Triton) picks the fused body; forced on, the CPU runs it with the
        kernels' torch fallbacks (the tests compare it with the reference ops)."""
        super().__init__(pixel_norm)
        self.visual = visual
        cfg = visual.config
        self.geo = WindowGeometry.from_config(cfg)
        self.budget_unit = self.geo.unit
        self.hidden = cfg.hidden_size
        self.heads = cfg.num_heads
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.full_attention = frozenset(cfg.fullatt_block_indexes)
        self.inv_freq = visual.rotary_pos_emb.inv_freq
        self.eps = visual.blocks[0].norm1.variance_epsilon
        if fused is None:
            fused = triton_available(self.device) and cfg.hidden_act == "silu"
        self.fused = fused
        self.split_attention = attention.available(self.head_dim, self.device) and self.dtype != torch.float32
        if self.fused:
            self._fuse_gate_up()
        self._init_pixel_norm()

    def _fuse_gate_up(self) -> None:
        """One [gate; up] weight per block for a single GEMM, each half's width padded (kernels.pad_mlp:
        zero units, exact; down_projection.py says why), and the down projection padded to match. The
        modules' own parameters become views of these, so no memory is added and the reference module
        still runs on the same weights."""
        mlps = self._pad_mlps([((b.mlp.gate_proj, b.mlp.up_proj), b.mlp.down_proj) for b in self.visual.blocks])
        self.gate_up = [(w, b) for w, b, _ in mlps]

    @property
    def dtype(self) -> torch.dtype:
        return self.visual.patch_embed.proj.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.visual.patch_embed.proj.weight.device

    @property
    def patch_dim(self) -> int:
        return self.visual.patch_embed.proj.weight[0].numel()

    @property
    def out_dim(self) -> int:
        return self.visual.merger.mlp[2].out_features

    # ------------------------------------------------------------------ metadata (host, outside graphs)
    def layout(self, grids: list[Grid]) -> BatchLayout:
        return layout(grids, self.geo.merge)

    def metadata(self, lay: BatchLayout, budget: int | None, uniform: tuple[int, int] | None,
                 seq_slots: int) -> dict[str, torch.Tensor]:
        meta = qwen25_metadata(lay, self.geo, budget, seq_slots)
        if self.split_attention:
            bm = attention.block_m_for(uniform[1] if uniform else None)
            meta["table"] = attention.padded_block_table(lay.seq_lens, budget, seq_slots, bm)
            windows = torch.diff(meta["cu_win"]).tolist()  # padding windows included, empty slots are 0
            meta["table_win"] = attention.padded_block_table(
                [n for n in windows if n], budget, window_slots(budget, self.geo) if budget else 0, WINDOW_BLOCK_M)
        return meta

    def metadata_rows(self, budget: int, uniform: tuple[int, int] | None, seq_slots: int) -> dict[str, int]:
        rows = {"perm": budget, "rot": budget, "unperm": budget // self.geo.unit, "cu": seq_slots + 1,
                "cu_win": window_slots(budget, self.geo) + 1}
        if self.split_attention:
            rows["table"] = attention.table_rows(budget, seq_slots, attention.block_m_for(uniform[1] if uniform else None))
            rows["table_win"] = attention.table_rows(budget, window_slots(budget, self.geo), WINDOW_BLOCK_M)
        return rows

    def metadata_buffers(self, max_budget: int, seq_slots: int) -> dict[str, torch.Tensor]:
        dev, long = self.device, torch.long
        rows = self.metadata_rows(max_budget, None, seq_slots)
        bufs = {"perm": torch.zeros(rows["perm"], dtype=long, device=dev),
                "rot": torch.zeros(rows["rot"], 2, dtype=long, device=dev),
                "unperm": torch.zeros(rows["unperm"], dtype=long, device=dev),
                "cu": torch.zeros(rows["cu"], dtype=torch.int32, device=dev),
                "cu_win": torch.zeros(rows["cu_win"], dtype=torch.int32, device=dev)}
        if self.split_attention:  # 64-row blocks (short uniform shapes) need the most rows
            bufs["table"] = torch.zeros(attention.table_rows(max_budget, seq_slots, 64), 3, dtype=torch.int32,
                                        device=dev)
            bufs["table_win"] = torch.zeros(rows["table_win"], 3, dtype=torch.int32, device=dev)
        return bufs

    def synthetic_grid(self, tokens: int) -> Grid:
        """A near-square image: window attention's cost depends on the shape (a 2-patch strip would be
        all partial windows)."""
        m, units = self.geo.merge, tokens // self.geo.unit
        side = max(d for d in range(1, int(units**0.5) + 1) if units % d == 0)
        return (1, side * m, units // side * m)

    def uniform_grids(self, shape: tuple[int, int]) -> list[Grid]:
        seqs, length = shape
        _, h, w = self.synthetic_grid(length)
        return [(seqs, h, w)]

    # ------------------------------------------------------------------ body (static shapes)
    def _rotary(self, rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [N, head_dim / 2] in float32: row frequencies then column frequencies (the reference
        repeats this half to the full head width, so rotary_qk takes the half)."""
        freqs = (rot[..., None].float() * self.inv_freq.float()).flatten(1)
        return freqs.cos(), freqs.sin()

    def _attention(self, q, k, v, batch: TowerBatch, full: bool) -> torch.Tensor:
        m = batch.meta
        if full:
            uniform = batch.uniform
            return attention.packed_attention(q, k, v, m["cu"], batch.max_seqlen, table=m.get("table"),
                                              block_m=attention.block_m_for(uniform[1] if uniform else None),
                                              uniform=uniform, static=batch.static, use_flash4=self.flash4)
        return attention.packed_attention(q, k, v, m["cu_win"], self.geo.window_tokens, table=m.get("table_win"),
                                          block_m=WINDOW_BLOCK_M, static=batch.static)

    def _embed(self, batch: TowerBatch) -> torch.Tensor:
        """Patch rows in window order, embedded (the Conv3d's kernel equals its stride: a matmul)."""
        w = self.visual.patch_embed.proj.weight
        px = self.normalized_pixels(batch.pixels, rows=batch.meta["perm"])
        return F.linear(px, w.view(w.shape[0], -1))

    def _qkv_attention(self, blk, h: torch.Tensor, cos, sin, batch: TowerBatch, full: bool) -> torch.Tensor:
        n = h.shape[0]
        qkv = blk.attn.qkv(h)
        q, k = rotary_qk(qkv, cos, sin, self.heads)  # float32 rotation, as the reference
        v = qkv.view(n, 3, self.heads, self.head_dim)[:, 2]
        return self._attention(q, k, v, batch, full).reshape(n, self.hidden)

    def _forward_reference_ops(self, batch: TowerBatch) -> torch.Tensor:
        x = self._embed(batch)
        cos, sin = self._rotary(batch.meta["rot"])
        for i, blk in enumerate(self.visual.blocks):
            x = x + blk.attn.proj(self._qkv_attention(blk, blk.norm1(x), cos, sin, batch, i in self.full_attention))
            x = x + blk.mlp(blk.norm2(x))
        return self.visual.merger(x)

    def _forward_fused(self, batch: TowerBatch) -> torch.Tensor:
        """Per layer: qkv GEMM, rotary, attention, proj GEMM, add+RMSNorm, gate/up GEMM, SiLU*mul, down
        GEMM, add+RMSNorm (the next layer's, or the merger's). Residual stream in float32."""
        blocks, eps = self.visual.blocks, self.eps
        x = self._embed(batch).float()
        cos, sin = self._rotary(batch.meta["rot"])
        x, h = add_bias_rmsnorm(x, None, None, blocks[0].norm1.weight, eps)
        for i, blk in enumerate(blocks):
            attn = self._qkv_attention(blk, h, cos, sin, batch, i in self.full_attention)
            x, h = add_bias_rmsnorm(x, F.linear(attn, blk.attn.proj.weight), blk.attn.proj.bias, blk.norm2.weight, eps)
            w, b = self.gate_up[i]
            u = silu_mul(F.linear(h, w, b))
            nxt = blocks[i + 1].norm1 if i + 1 < len(blocks) else self.visual.merger.ln_q
            x, h = add_bias_rmsnorm(x, self.down(u, self.down_weights[i]), blk.mlp.down_proj.bias,
                                    nxt.weight, nxt.variance_epsilon)
        merger = self.visual.merger
        return merger.mlp(h.view(-1, merger.hidden_size))

    def forward(self, batch: TowerBatch) -> tuple[torch.Tensor, list[torch.Tensor]]:
        merged = self._forward_fused(batch) if self.fused else self._forward_reference_ops(batch)
        return merged.index_select(0, batch.meta["unperm"]), []
