"""Qwen3-VL vision tower with a static-shape body that CUDA graphs can capture.

It runs on the parameters of transformers' `Qwen3VLVisionModel` (same modules, no copy of the
weights). What the reference computes from `grid_thw` on the host inside its forward is passed
in as tensors (see metadata.py), and attention is one block-diagonal variable-length call over
the whole packed batch instead of one call per frame.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import sdpa_kernel

from .. import sdpa_backends
from . import attention
from .kernels import add_bias_layernorm, linear_gelu_tanh, rotary_qk, triton_available

DENSE_MIN_LENGTH = 512  # equal-length sequences at least this long take one dense attention call

try:  # torch >= 2.10
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
except ImportError:  # pragma: no cover - older torch
    _varlen_attn = None


@dataclass
class TowerInputs:
    """One packed batch, on the tower's device. Shapes are static for a given token budget."""

    pixels: torch.Tensor  # [N, C*T*P*P]
    pos_taps: torch.Tensor  # [N, 4] int64 indices into the learned position table
    pos_weights: torch.Tensor  # [N, 4] float32 bilinear weights
    rot_ids: torch.Tensor  # [N, 2] int64 (row, col) for the 2-D rotary embedding
    cu_seqlens: torch.Tensor  # [S + 1] int32, monotonic
    max_seqlen: int  # host int: an upper bound of every sequence length
    uniform: tuple[int, int] | None = None  # (sequences, length) when all sequences are equally long
    attn_table: torch.Tensor | None = None  # query-block table for attention.varlen_attention (CUDA)
    attn_block_m: int = attention.BLOCK_M  # the table's query rows per block
    static: bool = False  # a graph's static buffers (a fixed shape), not an eager batch


class VisionTower(nn.Module):
    """Wraps a transformers `Qwen3VLVisionModel`; `forward(TowerInputs)` -> (main, [deepstack...])."""

    def __init__(self, visual: nn.Module, pixel_norm: tuple | None = None):
        """`pixel_norm` = (scale, offset) per row column (`PatchSpec.column_norm`) lets the tower take
        uint8 patch rows and normalise them itself; without it, rows come normalised (float)."""
        super().__init__()
        self.visual = visual
        cfg = visual.config
        self.hidden = cfg.hidden_size
        self.heads = cfg.num_heads
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.merge_unit = cfg.spatial_merge_size**2
        self.deepstack_index = {layer: i for i, layer in enumerate(cfg.deepstack_visual_indexes)}
        self.inv_freq = visual.rotary_pos_emb.inv_freq
        self.eps = visual.blocks[0].norm1.eps
        # Fused kernels on CUDA (see kernels.py); the CPU keeps the reference's op-for-op math.
        self.fused = triton_available(self.device) and cfg.hidden_act == "gelu_pytorch_tanh"
        # Our Triton varlen attention (attention.py) where it applies; callers then pass a block table.
        self.split_attention = attention.available(self.head_dim, self.device) and self.dtype != torch.float32
        self.pixel_scale = self.pixel_offset = None
        if pixel_norm is not None:
            self.pixel_scale, self.pixel_offset = (torch.as_tensor(t, dtype=torch.float32, device=self.device)
                                                   for t in pixel_norm)

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

    def uses_varlen(self) -> bool:
        return _varlen_attn is not None and self.device.type == "cuda" and self.dtype in (torch.bfloat16, torch.float16)

    def _rotary(self, rot_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [N, head_dim / 2] in float32: h-frequencies then w-frequencies. The reference's
        full-width table repeats this half, so rotary_qk takes the half."""
        freqs = (rot_ids[..., None].float() * self.inv_freq.float()).flatten(1)
        return freqs.cos(), freqs.sin()

    def _attention(self, q, k, v, inp: TowerInputs):
        uniform, table = inp.uniform, inp.attn_table
        if uniform is not None and (table is None or uniform[1] >= DENSE_MIN_LENGTH):
            # Long equal-length sequences (an image, same-size images): one dense batched attention,
            # in graphs cuDNN's kernel (faster than ours from about 512 tokens per sequence); eager
            # batches, of ever-new shapes, leave it out (sdpa_backends says why).
            s, length = uniform
            q, k, v = (t.reshape(s, length, self.heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
            backends = sdpa_backends.CAPTURED if inp.static else sdpa_backends.UNCAPTURED
            with sdpa_kernel(backends, set_priority=True):
                out = F.scaled_dot_product_attention(q, k, v)
            return out.transpose(1, 2).reshape(s * length, self.heads, self.head_dim)
        if table is not None:
            return attention.varlen_attention(q, k, v, table, inp.attn_block_m)
        cu_seqlens = inp.cu_seqlens
        if self.uses_varlen():
            return _varlen_attn(q, k, v, cu_seqlens, cu_seqlens, inp.max_seqlen, inp.max_seqlen)
        if q.device.type == "cpu":
            # No graph to keep static: one attention per sequence, as the reference does. A mask over
            # the whole padded batch costs (sum of lengths)^2 instead of the sum of squares: a batch of
            # 7 images of 784 tokens (budget 6144) took 2.5 s to encode instead of 0.08 s on 2 cores.
            # (4-D inputs: torch's CPU flash kernel; 3-D ones take the math path, 9x slower.)
            bounds = cu_seqlens.tolist()
            return torch.cat([F.scaled_dot_product_attention(*(t[None, a:b].transpose(1, 2) for t in (q, k, v)))[0]
                              .transpose(0, 1) for a, b in zip(bounds, bounds[1:]) if b > a])
        # Block-diagonal mask from cu_seqlens, without host synchronisation (graph-safe).
        n = q.shape[0]
        seg = torch.searchsorted(cu_seqlens[1:], torch.arange(n, device=q.device, dtype=cu_seqlens.dtype), right=True)
        mask = seg[:, None] == seg[None, :]
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
        return out.transpose(0, 1)

    def _block(self, blk, x, cos, sin, inp: TowerInputs):
        n = x.shape[0]
        h = blk.norm1(x)
        qkv = blk.attn.qkv(h)
        q, k = rotary_qk(qkv, cos, sin, self.heads)  # float32 rotation, as the reference
        v = qkv.view(n, 3, self.heads, self.head_dim)[:, 2]
        attn = self._attention(q, k, v, inp)
        x = x + blk.attn.proj(attn.reshape(n, self.hidden))
        return x + blk.mlp(blk.norm2(x))

    def _embed(self, inp: TowerInputs, keep_float: bool = False) -> torch.Tensor:
        vis = self.visual
        proj = vis.patch_embed.proj
        px = inp.pixels
        if px.dtype == torch.uint8:  # raw patches: the processor's rescale and normalise, in float32 as it does
            if self.pixel_scale is None:
                raise ValueError("uint8 pixel rows need the tower's pixel_norm")
            px = px.float() * self.pixel_scale + self.pixel_offset
        # The Conv3d's kernel equals its stride: it is a matmul over flattened patches.
        x = F.linear(px.to(self.dtype), proj.weight.view(proj.weight.shape[0], -1), proj.bias)
        pos = (vis.pos_embed.weight[inp.pos_taps] * inp.pos_weights[:, :, None]).sum(1)
        return x.float() + pos if keep_float else x + pos.to(x.dtype)

    def _forward_fused(self, inp: TowerInputs) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Per layer: qkv GEMM, rotary, attention, proj GEMM, add+LN, fc1 GEMM+GELU, fc2 GEMM, add+LN."""
        vis, n = self.visual, inp.pixels.shape[0]
        x = self._embed(inp, keep_float=True)  # residual stream in float32
        cos, sin = self._rotary(inp.rot_ids)
        blocks = vis.blocks
        n1 = blocks[0].norm1
        h = F.layer_norm(x, (self.hidden,), n1.weight.float(), n1.bias.float(), self.eps).to(self.dtype)
        deepstack: list[torch.Tensor] = [None] * self.num_deepstack  # type: ignore[list-item]
        for i, blk in enumerate(blocks):
            qkv = blk.attn.qkv(h)
            q, k = rotary_qk(qkv, cos, sin, self.heads)
            v = qkv.view(n, 3, self.heads, self.head_dim)[:, 2]
            attn = self._attention(q, k, v, inp).reshape(n, self.hidden)
            x, h = add_bias_layernorm(x, F.linear(attn, blk.attn.proj.weight), blk.attn.proj.bias,
                                      blk.norm2.weight, blk.norm2.bias, self.eps)
            mlp = blk.mlp
            u = linear_gelu_tanh(h, mlp.linear_fc1.weight, mlp.linear_fc1.bias)
            nxt = blocks[i + 1].norm1 if i + 1 < len(blocks) else None
            x, h = add_bias_layernorm(x, F.linear(u, mlp.linear_fc2.weight), mlp.linear_fc2.bias,
                                      nxt.weight if nxt else None, nxt.bias if nxt else None, self.eps)
            j = self.deepstack_index.get(i)
            if j is not None:
                deepstack[j] = vis.deepstack_merger_list[j](x.to(self.dtype))
        return vis.merger(x.to(self.dtype)), deepstack

    def forward(self, inp: TowerInputs) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if self.fused:
            return self._forward_fused(inp)
        vis = self.visual
        x = self._embed(inp)
        cos, sin = self._rotary(inp.rot_ids)
        deepstack: list[torch.Tensor] = [None] * self.num_deepstack  # type: ignore[list-item]
        for i, blk in enumerate(vis.blocks):
            x = self._block(blk, x, cos, sin, inp)
            j = self.deepstack_index.get(i)
            if j is not None:
                deepstack[j] = vis.deepstack_merger_list[j](x)
        return vis.merger(x), deepstack
