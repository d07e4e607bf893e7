"""Qwen3-VL vision tower with a static-shape body that CUDA graphs can capture.

It runs on the parameters of a module named as transformers' `Qwen3VLVisionModel` (a replica's is our
own tree, qwen3_params.py; tests also pass transformers' module itself), with no copy of the weights. What the reference computes from `grid_thw` on the host inside its forward is passed
in as tensors (see metadata.py), and attention is one block-diagonal variable-length call over
the whole packed batch instead of one call per frame.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import attention
from .kernels import add_bias_layernorm, linear_gelu_tanh, rotary_qk, triton_available
from .metadata import BatchLayout, Grid, TowerGeometry, cu_seqlens, layout, position_metadata
from .tower_api import GraphTower, TowerBatch


def padded_cu_seqlens(seq_lens: list[int], budget: int | None, seq_slots: int) -> torch.Tensor:
    return cu_seqlens(seq_lens) if budget is None else cu_seqlens(seq_lens, pad_to_tokens=budget, pad_to_seqs=seq_slots)


class VisionTower(GraphTower):
    """Wraps a Qwen3-VL vision module (qwen3_params.py's tree, or transformers' `Qwen3VLVisionModel`);
    `forward(TowerBatch)` -> (main, [deepstack...])."""

    def __init__(self, visual: nn.Module, pixel_norm: tuple | None = None, fused: bool | None = None):
        """`pixel_norm` = (scale, offset) per row column (`PatchSpec.column_norm`) lets the tower take
        uint8 patch rows and normalise them itself; without it, rows come normalised (float). `fused`
        (default: on CUDA with Triton) picks the fused body; forced on, the CPU runs it with the kernels'
        torch fallbacks (the tests compare it with the reference ops)."""
        super().__init__(pixel_norm)
        self.visual = visual
        cfg = visual.config
        self.geo = TowerGeometry.from_config(cfg)
        self.hidden = cfg.hidden_size
        self.heads = cfg.num_heads
        self.head_dim = cfg.hidden_size // cfg.num_heads
        # The heads and attention width this process computes: all of them here; a tensor-parallel rank's
        # share in app/vision/tensor_parallel.py, whose partial products `_reduce` completes.
        self.local_heads, self.local_width = self.heads, self.hidden
        self.merge_unit = self.budget_unit = cfg.spatial_merge_size**2
        self.deepstack_index = {layer: i for i, layer in enumerate(cfg.deepstack_visual_indexes)}
        self.inv_freq = visual.rotary_pos_emb.inv_freq
        self.eps = visual.blocks[0].norm1.eps
        # Fused kernels on CUDA (see kernels.py); the CPU keeps the reference's op-for-op math.
        if fused is None:
            fused = triton_available(self.device) and cfg.hidden_act == "gelu_pytorch_tanh"
        self.fused = fused
        # The fused body's MLPs, their width padded (kernels.pad_mlp: exact; down_projection.py says why).
        self.mlps = self._pad_mlps([(b.mlp.linear_fc1, b.mlp.linear_fc2) for b in visual.blocks]) if fused else []
        # Our Triton varlen attention (attention.py) where it applies; callers then pass a block table.
        self.split_attention = attention.available(self.head_dim, self.device) and self.dtype != torch.float32
        self._init_pixel_norm()

    @property
    def dtype(self) -> torch.dtype:
        return self.visual.patch_embed.proj.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.visual.patch_embed.proj.weight.device

    @property
    def patch_dim(self) -> int:
        w = self.visual.patch_embed.proj.weight
        return w[0].numel()

    @property
    def out_dim(self) -> int:
        return self.visual.merger.linear_fc2.out_features

    @property
    def num_deepstack(self) -> int:
        return len(self.deepstack_index)

    # ------------------------------------------------------------------ metadata (host, outside graphs)
    def layout(self, grids: list[Grid]) -> BatchLayout:
        return layout(grids, self.geo.merge)

    def metadata(self, lay: BatchLayout, budget: int | None, uniform: tuple[int, int] | None,
                 seq_slots: int) -> dict[str, torch.Tensor]:
        """Interpolation taps and weights into the learned position table, rotary (row, col) ids,
        cu_seqlens and (CUDA) the attention table. Padding rows are zeros: valid indices, finite values."""
        taps, weights, rot = position_metadata(lay.grids, self.geo)
        if budget is not None and budget > lay.num_tokens:
            pad = budget - lay.num_tokens
            taps, weights, rot = (torch.cat([t, t.new_zeros(pad, t.shape[1])]) for t in (taps, weights, rot))
        meta = {"taps": taps, "weights": weights, "rot": rot, "cu": padded_cu_seqlens(lay.seq_lens, budget, seq_slots)}
        if self.split_attention:
            bm = attention.block_m_for(uniform[1] if uniform else None)
            meta["table"] = attention.padded_block_table(lay.seq_lens, budget, seq_slots, bm)
        return meta

    def metadata_buffers(self, max_budget: int, seq_slots: int) -> dict[str, torch.Tensor]:
        n, dev = max_budget, self.device
        bufs = {"taps": torch.zeros(n, 4, dtype=torch.long, device=dev),
                "weights": torch.zeros(n, 4, dtype=torch.float32, device=dev),
                "rot": torch.zeros(n, 2, dtype=torch.long, device=dev),
                "cu": torch.zeros(seq_slots + 1, dtype=torch.int32, device=dev)}
        if self.split_attention:  # 64-row blocks (short uniform shapes) need the most rows
            bufs["table"] = torch.zeros(attention.table_rows(n, seq_slots, 64), 3, dtype=torch.int32, device=dev)
        return bufs

    def metadata_rows(self, budget: int, uniform: tuple[int, int] | None, seq_slots: int) -> dict[str, int]:
        rows = {"taps": budget, "weights": budget, "rot": budget, "cu": seq_slots + 1}
        if self.split_attention:
            rows["table"] = attention.table_rows(budget, seq_slots, attention.block_m_for(uniform[1] if uniform else None))
        return rows

    def synthetic_grid(self, tokens: int) -> Grid:
        m = self.geo.merge
        return (1, m, tokens // m)

    def uniform_grids(self, shape: tuple[int, int]) -> list[Grid]:
        seqs, length = shape
        m = self.geo.merge
        return [(seqs, m, length // m)]

    # ------------------------------------------------------------------ body (static shapes)
    def _rotary(self, rot_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [N, head_dim / 2] in float32: h-frequencies then w-frequencies. The reference's
        full-width table repeats this half, so rotary_qk takes the half."""
        freqs = (rot_ids[..., None].float() * self.inv_freq.float()).flatten(1)
        return freqs.cos(), freqs.sin()

    def _attention(self, q, k, v, batch: TowerBatch):
        uniform = batch.uniform
        return attention.packed_attention(
            q, k, v, batch.meta["cu"], batch.max_seqlen, table=batch.meta.get("table"),
            block_m=attention.block_m_for(uniform[1] if uniform else None), uniform=uniform, static=batch.static,
            use_flash4=self.flash4)

    def _reduce(self, y: torch.Tensor) -> torch.Tensor:
        """A row-parallel projection's partial product, completed (the whole tower: nothing to add)."""
        return y

    def _block(self, blk, x, cos, sin, inp: TowerBatch):
        n = x.shape[0]
        h = blk.norm1(x)
        qkv = blk.attn.qkv(h)
        q, k = rotary_qk(qkv, cos, sin, self.heads)  # float32 rotation, as the reference
        v = qkv.view(n, 3, self.heads, self.head_dim)[:, 2]
        attn = self._attention(q, k, v, inp)
        x = x + blk.attn.proj(attn.reshape(n, self.hidden))
        return x + blk.mlp(blk.norm2(x))

    def _embed(self, inp: TowerBatch, keep_float: bool = False) -> torch.Tensor:
        vis = self.visual
        proj = vis.patch_embed.proj
        # uint8 rows: the processor's rescale and normalise, in float32 as it does. The Conv3d's kernel
        # equals its stride: it is a matmul over flattened patches.
        px = self.normalized_pixels(inp.pixels)
        x = F.linear(px, proj.weight.view(proj.weight.shape[0], -1), proj.bias)
        pos = (vis.pos_embed.weight[inp.meta["taps"]] * inp.meta["weights"][:, :, None]).sum(1)
        return x.float() + pos if keep_float else x + pos.to(x.dtype)

    def _forward_fused(self, inp: TowerBatch) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Per layer: qkv GEMM, rotary, attention, proj GEMM, add+LN, fc1 GEMM+GELU, fc2 GEMM, add+LN."""
        vis, n = self.visual, inp.pixels.shape[0]
        x = self._embed(inp, keep_float=True)  # residual stream in float32
        cos, sin = self._rotary(inp.meta["rot"])
        blocks = vis.blocks
        n1 = blocks[0].norm1
        h = F.layer_norm(x, (self.hidden,), n1.weight.float(), n1.bias.float(), self.eps).to(self.dtype)
        deepstack: list[torch.Tensor] = [None] * self.num_deepstack  # type: ignore[list-item]
        for i, blk in enumerate(blocks):
            qkv = blk.attn.qkv(h)
            q, k = rotary_qk(qkv, cos, sin, self.local_heads)
            v = qkv.view(n, 3, self.local_heads, self.head_dim)[:, 2]
            attn = self._attention(q, k, v, inp).reshape(n, self.local_width)
            x, h = add_bias_layernorm(x, self._reduce(F.linear(attn, blk.attn.proj.weight)), blk.attn.proj.bias,
                                      blk.norm2.weight, blk.norm2.bias, self.eps)
            w1, b1, w2 = self.mlps[i]
            u = linear_gelu_tanh(h, w1, b1)
            nxt = blocks[i + 1].norm1 if i + 1 < len(blocks) else None
            x, h = add_bias_layernorm(x, self._reduce(self.down(u, w2)), blk.mlp.linear_fc2.bias,
                                      nxt.weight if nxt else None, nxt.bias if nxt else None, self.eps)
            j = self.deepstack_index.get(i)
            if j is not None:
                deepstack[j] = vis.deepstack_merger_list[j](x.to(self.dtype))
        return vis.merger(x.to(self.dtype)), deepstack

    def forward(self, inp: TowerBatch) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if self.fused:
            return self._forward_fused(inp)
        vis = self.visual
        x = self._embed(inp)
        cos, sin = self._rotary(inp.meta["rot"])
        deepstack: list[torch.Tensor] = [None] * self.num_deepstack  # type: ignore[list-item]
        for i, blk in enumerate(vis.blocks):
            x = self._block(blk, x, cos, sin, inp)
            j = self.deepstack_index.get(i)
            if j is not None:
                deepstack[j] = vis.deepstack_merger_list[j](x)
        return vis.merger(x), deepstack
