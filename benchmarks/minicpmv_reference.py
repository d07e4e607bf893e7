"""MiniCPM-V 4.5's vision forward batched the way the published remote code batches it, for the
encoder benchmark's "reference" columns (the Hub's code itself is not used here).

Per call, as published: the slices' pixels padded to the longest slice in its [3, P, L*P] layout, one
Conv2d, bucketed position ids computed per slice on the host, SigLIP over the padded batch, post-layernorm;
then the resampler with one `nn.MultiheadAttention` call over the padded batch with a key padding mask and
2-D sin-cos keys gathered per slice. It shares the weights of our `MiniCPMVision` module.

The published SigLIP has two attention paths, and `attention` picks one:
- "eager": what the published code runs unless it is loaded with `attn_implementation=
  "flash_attention_2"` (its `init_vision_module` sets the vision config to eager for anything else,
  "sdpa" included, the model card's example): per layer q @ k^T, the scale, the mask, a float32 softmax
  and the product with v, as separate ops (transformers' `eager_attention_forward`, the same math);
- "flash_attention_2": the fast path, when flash-attn is installed. Without padding it calls
  FlashAttention-2 on the dense batch; here PyTorch's SDPA restricted to its bundled FlashAttention-2
  kernel stands in (on CUDA in bf16/fp16; elsewhere SDPA picks). With padding the published code unpads
  every layer (a host sync each) and runs variable-length FlashAttention-2; the stand-in instead passes
  the additive mask to SDPA, which skips those syncs but computes the padded positions. Which of the
  two is faster was not measured; the headline workload (one 448^2 image, one slice) has no padding.

Both drop the mask when no slice is padded, as the published forward does (an all-ones patch mask).
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from app.vision.minicpmv_metadata import bucketed_positions, row_cols
from app.vision.minicpmv_resampler import key_positions, sincos_frequencies
from app.vision.minicpmv_tower import MiniCPMVision

ATTENTION = ("flash_attention_2", "eager")


class PublishedStyleMiniCPMV:
    def __init__(self, model: MiniCPMVision, attention: str = "flash_attention_2"):
        from transformers import SiglipVisionConfig
        from transformers.models.siglip.modeling_siglip import SiglipEncoder

        if attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, not {attention!r}")
        self.model, self.attention = model, attention
        v = dict(model.vpm.config)
        v.pop("model_type", None)
        cfg = SiglipVisionConfig(**{**v, "num_hidden_layers": len(model.vpm.encoder.layers)})
        cfg._attn_implementation = "eager" if attention == "eager" else "sdpa"
        self.encoder = SiglipEncoder(cfg).to(model.vpm.post_layernorm.weight)
        self.encoder.load_state_dict(model.vpm.encoder.state_dict())
        self.encoder.eval()
        p = model.vpm.embeddings.patch_embedding
        self.patch = p.kernel_size[0]
        self.side = model.vpm.embeddings.side
        e = model.resampler.query.shape[1]
        self.omega = sincos_frequencies(e).to(p.weight.device)

    def _pos2d(self, h: int, w: int, dtype) -> torch.Tensor:
        return key_positions(row_cols(h, w).to(self.omega.device), self.omega).to(dtype)

    @torch.inference_mode()
    def __call__(self, pixels: torch.Tensor, grids) -> list[torch.Tensor]:
        vpm, res, p = self.model.vpm, self.model.resampler, self.patch
        lens = [h * w for _, h, w in grids]
        longest, b = max(lens), len(grids)
        images = torch.zeros(b, 3, p, longest * p, dtype=pixels.dtype, device=pixels.device)
        off = 0
        for i, n in enumerate(lens):  # rows (C, P, P) per patch -> the published [3, P, L*P] layout
            images[i, :, :, :n * p] = pixels[off:off + n].view(n, 3, p, p).permute(1, 2, 0, 3).reshape(3, p, n * p)
            off += n
        x = vpm.embeddings.patch_embedding(images).flatten(2).transpose(1, 2)
        pos = torch.zeros(b, longest, dtype=torch.long)
        for i, (_, h, w) in enumerate(grids):
            pos[i, :h * w] = bucketed_positions(h, w, self.side)
        x = x + vpm.embeddings.position_embedding(pos.to(x.device))
        valid = torch.arange(longest, device=x.device)[None] < torch.tensor(lens, device=x.device)[:, None]
        mask = None  # the published forward passes none when every slice is of the longest length
        if min(lens) < longest:
            mask = torch.zeros(b, 1, longest, longest, dtype=x.dtype, device=x.device)
            mask.masked_fill_(~valid[:, None, None, :], torch.finfo(x.dtype).min)
        with self._attention_kernel(x, mask):
            x = vpm.post_layernorm(self.encoder(inputs_embeds=x, attention_mask=mask).last_hidden_state)
        kv = res.ln_kv(res.kv_proj(x)).transpose(0, 1)  # L x B x E
        pos2d = torch.zeros_like(kv)
        for i, (_, h, w) in enumerate(grids):
            pos2d[:h * w, i] = self._pos2d(h, w, kv.dtype)
        q = res.ln_q(res.query)[:, None].expand(-1, b, -1)
        out = res.attn(q, kv + pos2d, kv, key_padding_mask=~valid)[0].transpose(0, 1)
        return [(res.ln_post(out) @ res.proj).reshape(-1, out.shape[-1])]

    def _attention_kernel(self, x: torch.Tensor, mask: torch.Tensor | None):
        """SDPA restricted to FlashAttention-2 for the flash path's unmasked calls on CUDA half types
        (it raises where that kernel cannot run, e.g. before Ampere: no silent fallback)."""
        if (self.attention == "flash_attention_2" and mask is None and x.is_cuda
                and x.dtype in (torch.bfloat16, torch.float16)):
            return sdpa_kernel(SDPBackend.FLASH_ATTENTION)
        return contextlib.nullcontext()


def minicpmv_flops(model: MiniCPMVision, grids) -> float:
    """Matmul FLOPs of our forward (SigLIP linears + attention, resampler projections + attention)."""
    cfg = model.vpm.config
    d, i = cfg["hidden_size"], cfg["intermediate_size"]
    layers = len(model.vpm.encoder.layers)
    q, e = model.resampler.query.shape
    n = sum(h * w for _, h, w in grids)
    patch = 2 * n * d * 3 * cfg["patch_size"] ** 2
    siglip = layers * (2 * n * (4 * d * d + 2 * d * i) + sum(4 * (h * w) ** 2 * d for _, h, w in grids))
    resampler = 2 * n * (d * e + 2 * e * e) + len(grids) * (2 * q * e * e * 3 + 4 * q * n / len(grids) * e)
    return patch + siglip + resampler
