"""MiniCPM-V 4.5's vision forward batched the way the published remote code batches it, for the
encoder benchmark's "reference" column (the Hub's code itself is not used here).

Per call, as published: the slices' pixels padded to the longest slice in its [3, P, L*P] layout, one
Conv2d, bucketed position ids computed per slice on the host, SigLIP over the padded batch with a
4-D additive padding mask (transformers' `SiglipEncoder`, SDPA), post-layernorm; then the resampler
with one `nn.MultiheadAttention` call over the padded batch with a key padding mask and 2-D sin-cos
keys gathered per slice. It shares the weights of our `MiniCPMVision` module.
"""

from __future__ import annotations

import torch

from app.vision.minicpmv_metadata import bucketed_positions, row_cols
from app.vision.minicpmv_resampler import key_positions, sincos_frequencies
from app.vision.minicpmv_tower import MiniCPMVision


class PublishedStyleMiniCPMV:
    def __init__(self, model: MiniCPMVision):
        from transformers import SiglipVisionConfig
        from transformers.models.siglip.modeling_siglip import SiglipEncoder

        self.model = model
        v = dict(model.vpm.config)
        v.pop("model_type", None)
        cfg = SiglipVisionConfig(**{**v, "num_hidden_layers": len(model.vpm.encoder.layers)})
        cfg._attn_implementation = "sdpa"
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
        mask = torch.zeros(b, 1, longest, longest, dtype=x.dtype, device=x.device)
        mask.masked_fill_(~valid[:, None, None, :], torch.finfo(x.dtype).min)
        x = vpm.post_layernorm(self.encoder(inputs_embeds=x, attention_mask=mask).last_hidden_state)
        kv = res.ln_kv(res.kv_proj(x)).transpose(0, 1)  # L x B x E
        pos2d = torch.zeros_like(kv)
        for i, (_, h, w) in enumerate(grids):
            pos2d[:h * w, i] = self._pos2d(h, w, kv.dtype)
        q = res.ln_q(res.query)[:, None].expand(-1, b, -1)
        out = res.attn(q, kv + pos2d, kv, key_padding_mask=~valid)[0].transpose(0, 1)
        return [(res.ln_post(out) @ res.proj).reshape(-1, out.shape[-1])]


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
