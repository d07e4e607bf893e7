"""MiniCPM-V 4.5's vision path under the graph manager: SigLIP-NaViT, then the perceiver resampler.

MiniCPM-V is remote code on the Hub, not in transformers. The modules here are written from its
published architecture, with its parameter names, so an HF-format checkpoint (`vpm.*`, `resampler.*`)
loads by name (`MiniCPMVision` describes them). The graph-friendly body (`MiniCPMVTower`) never
synchronises with the host: SigLIP's attention is one block-diagonal call over the packed slices
(attention.packed_attention), the resampler's input-independent queries are projected once when the
tower is built, and equal-size slices take the resampler attention folded into those queries
(minicpmv_resampler.py). Images only: MiniCPM-V 4.5's temporal embedding for video is not implemented.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import sdpa_kernel

from ..gpu import sdpa_backends
from . import attention
from .kernels import add_bias_layernorm, linear_gelu_tanh, triton_available
from .metadata import BatchLayout, Grid
from .minicpmv_metadata import layout, minicpmv_metadata
from .minicpmv_resampler import fold_queries, folded_attention, normed_keys, sincos_frequencies
from .tower_api import GraphTower, TowerBatch


# ---------------------------------------------------------------------------- modules (published names)
class SiglipEmbeddings(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        dim, p = cfg["hidden_size"], cfg["patch_size"]
        self.patch_embedding = nn.Conv2d(cfg.get("num_channels", 3), dim, kernel_size=p, stride=p)
        self.side = cfg["image_size"] // p
        self.position_embedding = nn.Embedding(self.side * self.side, dim)


class SiglipAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(dim, dim) for _ in range(4))


class SiglipMLP(nn.Module):
    def __init__(self, dim: int, inter: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, inter), nn.Linear(inter, dim)


class SiglipLayer(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        dim, eps = cfg["hidden_size"], cfg.get("layer_norm_eps", 1e-6)
        self.layer_norm1, self.layer_norm2 = nn.LayerNorm(dim, eps=eps), nn.LayerNorm(dim, eps=eps)
        self.self_attn = SiglipAttention(dim, cfg["num_attention_heads"])
        self.mlp = SiglipMLP(dim, cfg["intermediate_size"])


class SiglipEncoder(nn.Module):
    def __init__(self, cfg: dict, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(SiglipLayer(cfg) for _ in range(layers))


class NaViTSiglip(nn.Module):
    """`vpm`: parameter names as the published checkpoint's."""

    def __init__(self, cfg: dict, drop_last_layer: bool = False):
        super().__init__()
        self.config = cfg
        layers = cfg["num_hidden_layers"] - (1 if drop_last_layer else 0)
        self.embeddings = SiglipEmbeddings(cfg)
        self.encoder = SiglipEncoder(cfg, layers)
        self.post_layernorm = nn.LayerNorm(cfg["hidden_size"], eps=cfg.get("layer_norm_eps", 1e-6))


class Resampler(nn.Module):
    """`resampler`: parameter names as the published checkpoint's."""

    def __init__(self, queries: int, embed_dim: int, kv_dim: int):
        super().__init__()
        self.query = nn.Parameter(torch.zeros(queries, embed_dim))
        self.kv_proj = nn.Linear(kv_dim, embed_dim, bias=False) if kv_dim != embed_dim else nn.Identity()
        self.attn = nn.MultiheadAttention(embed_dim, embed_dim // 128)
        self.ln_q, self.ln_kv, self.ln_post = (nn.LayerNorm(embed_dim, eps=1e-6) for _ in range(3))
        self.proj = nn.Parameter(torch.zeros(embed_dim, embed_dim))


class MiniCPMVision(nn.Module):
    """vpm + resampler, built from a MiniCPM-V config.json (a dict).

    - `vpm`: SigLIP (so400m: 27 layers, 1152 wide, 16 heads of 72) over variable-resolution slices. The
      patch embedding is a Conv2d whose kernel equals its stride (a matmul over (C, P, P) patch rows);
      learned positions are looked up at bucketed ids (minicpmv_metadata.py); pre-LN layers with
      GELU-tanh MLPs; `post_layernorm`. `drop_vision_last_layer` drops the last layer.
    - `resampler`: `query_num` learned queries (64) cross-attend to each slice's patches with one
      `nn.MultiheadAttention` (heads = embed_dim // 128): keys are ln_kv(kv_proj(x)) plus a 2-D sin-cos
      embedding of each patch's (row, col) (the first half encodes the column, the second the row; each
      half is [sin, cos] of the coordinate times 1 / 10000^(k / (E/4))), values ln_kv(kv_proj(x)); then
      ln_post and `proj`. MiniCPM-V 4.5's temporal embedding (for frames of a video grouped into one
      resampler call) is not implemented: images only."""

    def __init__(self, config: dict):
        super().__init__()
        self.config = config
        self.vpm = NaViTSiglip(config["vision_config"], config.get("drop_vision_last_layer", False))
        self.resampler = Resampler(config["query_num"], config["hidden_size"], config["vision_config"]["hidden_size"])


def load_minicpmv_vision(path: str | Path, dtype: torch.dtype, device: str | torch.device = "cpu") -> MiniCPMVision:
    """The vision path of a MiniCPM-V checkpoint, its `vpm.*` and `resampler.*` tensors loaded by name.
    A dropped last SigLIP layer's tensors, if the checkpoint has them, are ignored."""
    from .tensors import read_tensors

    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    with torch.device("meta"):
        model = MiniCPMVision(config)
    state = {prefix + k: v for prefix in ("vpm.", "resampler.") for k, v in read_tensors(path, (prefix,)).items()}
    kept = set(model.state_dict())
    dropped = len(model.vpm.encoder.layers)
    extra = [k for k in state if k not in kept and not k.startswith(f"vpm.encoder.layers.{dropped}.")]
    missing = [k for k in kept if k not in state]
    if missing or extra:
        raise ValueError(f"MiniCPM-V vision weights in {path} do not match its config: missing {missing[:5]}, "
                         f"unexpected {extra[:5]}")
    model = model.to_empty(device=device)
    model.load_state_dict({k: v for k, v in state.items() if k in kept})
    return model.to(dtype).eval()


# ---------------------------------------------------------------------------- the graph-friendly tower
class MiniCPMVTower(GraphTower):
    """`forward(TowerBatch)` -> (resampled embeddings [slots x query_num, embed_dim], []): slot order.

    Equal-size slices (a uniform graph, an image without slices) take the resampler attention with the
    key and value projections folded into the queries (minicpmv_resampler.py: half the work).
    Otherwise the keys and values are projected and the attention is, on CUDA in bf16/fp16 (Ampere or
    newer), one variable-length call (each slot's queries against its own slice's keys), on CUDA in
    float32 all slots' queries against all keys under a mask of slot ids, and on the CPU one small
    attention per slice."""

    budget_unit = 1

    def __init__(self, model: MiniCPMVision, pixel_norm: tuple | None = None, fused: bool | None = None):
        """`fused` (default: on CUDA with Triton) runs the fused body (`_siglip_fused`); forced on, the CPU
        runs it with the kernels' torch fallbacks (the tests compare it with the reference ops)."""
        super().__init__(pixel_norm)
        self.model = model
        vpm, res = model.vpm, model.resampler
        cfg = vpm.config
        self.hidden = cfg["hidden_size"]
        self.heads = cfg["num_attention_heads"]
        self.head_dim = self.hidden // self.heads
        self.side = vpm.embeddings.side
        self.queries, self.embed_dim = res.query.shape
        self.res_heads = res.attn.num_heads
        self.register_buffer("omega", sincos_frequencies(self.embed_dim).to(self.device), persistent=False)
        tanh = cfg.get("hidden_act", "gelu_pytorch_tanh") == "gelu_pytorch_tanh"
        self.fused = (triton_available(self.device) and tanh) if fused is None else fused
        self.split_attention = attention.available(self.head_dim, self.device) and self.dtype != torch.float32
        self._fuse_qkv()
        self._pad_patch_embedding()
        self.res_q = self._resampler_queries()
        # the queries through the key projection, for equal-size slices' folded attention
        self.res_qk = fold_queries(self.res_q, res.attn.in_proj_weight[self.embed_dim:2 * self.embed_dim])
        # The fused body's MLPs, their width padded (kernels.pad_mlp: exact; down_projection.py says why).
        self.mlps = self._pad_mlps([(la.mlp.fc1, la.mlp.fc2) for la in vpm.encoder.layers]) if self.fused else []
        self._init_pixel_norm()

    def _fuse_qkv(self) -> None:
        """One [q; k; v] weight per layer for a single GEMM; the modules' parameters become views of it
        (no memory added, the modules still hold the published names and values)."""
        self.qkv = []
        for layer in self.model.vpm.encoder.layers:
            a = layer.self_attn
            w = torch.cat([a.q_proj.weight.data, a.k_proj.weight.data, a.v_proj.weight.data])
            b = torch.cat([a.q_proj.bias.data, a.k_proj.bias.data, a.v_proj.bias.data])
            d = self.hidden
            for i, lin in enumerate((a.q_proj, a.k_proj, a.v_proj)):
                lin.weight.data, lin.bias.data = w[i * d:(i + 1) * d], b[i * d:(i + 1) * d]
            self.qkv.append((w, b))

    @torch.no_grad()
    def _resampler_queries(self) -> torch.Tensor:
        """The resampler's projected queries [heads, query_num, head_dim]: they depend on its weights
        only (ln_q of the learned queries, then the attention's query projection), so they are computed
        once here rather than in every forward (a 64-row GEMM and a LayerNorm in every graph replay:
        benchmarks/results/2026-11-25-minicpm-v-down-projection-patch-gemm-resampler.md). A copy: unlike
        the fused qkv weights (views of the modules' parameters), it would not follow weights loaded
        into the model after the tower is built; towers are built from loaded weights
        (loading.build_tower)."""
        res, e = self.model.resampler, self.embed_dim
        w, b = res.attn.in_proj_weight, res.attn.in_proj_bias
        q = F.linear(res.ln_q(res.query), w[:e], b[:e])
        return q.view(self.queries, self.res_heads, e // self.res_heads).transpose(0, 1).contiguous()

    def _pad_patch_embedding(self) -> None:
        """On CUDA, the patch embedding as a GEMM over rows padded with zero columns to a multiple of 8
        (3 x 14 x 14 = 588 values make rows of 1176 bytes, not 16-byte aligned, and cuBLAS falls back to
        a much slower old kernel, while the padded GEMM and its pad take little:
        benchmarks/results/2026-11-25-minicpm-v-down-projection-patch-gemm-resampler.md). Exact: the
        padded columns multiply zeros. The Conv2d's weight becomes a view of the padded matrix (no
        memory added; the module keeps its published name and values)."""
        conv = self.model.vpm.embeddings.patch_embedding
        w = conv.weight.data
        rows = w[0].numel()
        self.patch_pad = -rows % 8 if w.is_cuda else 0
        self.patch_weight = F.pad(w.reshape(w.shape[0], rows), (0, self.patch_pad))
        conv.weight.data = self.patch_weight[:, :rows].view(w.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.vpm.embeddings.patch_embedding.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.vpm.embeddings.patch_embedding.weight.device

    @property
    def patch_dim(self) -> int:
        return self.model.vpm.embeddings.patch_embedding.weight[0].numel()

    @property
    def out_dim(self) -> int:
        return self.embed_dim

    # ------------------------------------------------------------------ metadata (host, outside graphs)
    def layout(self, grids: list[Grid]) -> BatchLayout:
        return layout(grids, self.queries)

    def metadata(self, lay: BatchLayout, budget: int | None, uniform: tuple[int, int] | None,
                 seq_slots: int) -> dict[str, torch.Tensor]:
        slots = self._slots(budget, uniform, seq_slots)
        meta = minicpmv_metadata(lay, self.side, budget, slots if budget is not None else None)
        if self.split_attention:
            bm = attention.block_m_for(uniform[1] if uniform else None)
            meta["table"] = attention.padded_block_table(lay.seq_lens, budget, seq_slots, bm)
        return meta

    @staticmethod
    def _slots(budget: int | None, uniform: tuple[int, int] | None, seq_slots: int) -> int | None:
        """Query slots of a graph: a uniform graph's slices exactly, else every sequence slot."""
        if budget is None:
            return None
        return uniform[0] if uniform else seq_slots

    def metadata_rows(self, budget: int, uniform: tuple[int, int] | None, seq_slots: int) -> dict[str, int]:
        slots = self._slots(budget, uniform, seq_slots)  # a uniform graph's cu bounds its slices only
        rows = {"pos": budget, "rc": budget, "kseg": budget, "dead": slots, "cu": slots + 1}
        if self.split_attention:
            rows["table"] = attention.table_rows(budget, seq_slots, attention.block_m_for(uniform[1] if uniform else None))
        return rows

    def metadata_buffers(self, max_budget: int, seq_slots: int) -> dict[str, torch.Tensor]:
        dev, n = self.device, max_budget
        bufs = {"pos": torch.zeros(n, dtype=torch.long, device=dev),
                "rc": torch.zeros(n, 2, dtype=torch.float32, device=dev),
                "kseg": torch.zeros(n, dtype=torch.long, device=dev),
                "dead": torch.zeros(seq_slots, dtype=torch.bool, device=dev),
                "cu": torch.zeros(seq_slots + 1, dtype=torch.int32, device=dev)}
        if self.split_attention:
            bufs["table"] = torch.zeros(attention.table_rows(n, seq_slots, 64), 3, dtype=torch.int32, device=dev)
        return bufs

    def synthetic_grid(self, tokens: int) -> Grid:
        side = max(d for d in range(1, int(tokens**0.5) + 1) if tokens % d == 0)
        return (1, side, tokens // side)

    def uniform_grids(self, shape: tuple[int, int]) -> list[Grid]:
        seqs, length = shape
        return [self.synthetic_grid(length)] * seqs

    # ------------------------------------------------------------------ SigLIP
    def _embed(self, batch: TowerBatch) -> torch.Tensor:
        emb = self.model.vpm.embeddings
        x = F.linear(self.normalized_pixels(batch.pixels, self.patch_pad), self.patch_weight, emb.patch_embedding.bias)
        return x + emb.position_embedding.weight.index_select(0, batch.meta["pos"])

    def _self_attention(self, qkv: torch.Tensor, batch: TowerBatch) -> torch.Tensor:
        n = qkv.shape[0]
        q, k, v = qkv.view(n, 3, self.heads, self.head_dim).unbind(1)
        uniform = batch.uniform
        out = attention.packed_attention(q, k, v, batch.meta["cu"], batch.max_seqlen, table=batch.meta.get("table"),
                                         block_m=attention.block_m_for(uniform[1] if uniform else None),
                                         uniform=uniform, static=batch.static, use_flash4=self.flash4)
        return out.reshape(n, self.hidden)

    def _siglip(self, batch: TowerBatch) -> torch.Tensor:
        vpm = self.model.vpm
        x = self._embed(batch)
        for layer, (w, b) in zip(vpm.encoder.layers, self.qkv):
            attn = self._self_attention(F.linear(layer.layer_norm1(x), w, b), batch)
            x = x + layer.self_attn.out_proj(attn)
            mlp = layer.mlp
            x = x + mlp.fc2(F.gelu(mlp.fc1(layer.layer_norm2(x)), approximate="tanh"))
        return vpm.post_layernorm(x)

    def _siglip_fused(self, batch: TowerBatch) -> torch.Tensor:
        """Per layer: qkv GEMM, attention, out GEMM, add+LN, fc1 GEMM+GELU, fc2 GEMM, add+LN (the next
        layer's, or post_layernorm). Residual stream in float32."""
        vpm = self.model.vpm
        layers, emb, n1 = vpm.encoder.layers, vpm.embeddings, vpm.encoder.layers[0].layer_norm1
        # the embedding: the patch GEMM, then its bias, the learned positions and layer_norm1 in one pass
        y = F.linear(self.normalized_pixels(batch.pixels, self.patch_pad), self.patch_weight)
        x, h = add_bias_layernorm(emb.position_embedding.weight, y, emb.patch_embedding.bias, n1.weight, n1.bias,
                                  n1.eps, rows=batch.meta["pos"], residual_dtype=torch.float32)
        for i, (layer, (w, b), (w1, b1, w2)) in enumerate(zip(layers, self.qkv, self.mlps, strict=True)):
            attn = self._self_attention(F.linear(h, w, b), batch)
            out, ln2 = layer.self_attn.out_proj, layer.layer_norm2
            x, h = add_bias_layernorm(x, F.linear(attn, out.weight), out.bias, ln2.weight, ln2.bias, ln2.eps)
            u = linear_gelu_tanh(h, w1, b1)
            nxt = layers[i + 1].layer_norm1 if i + 1 < len(layers) else vpm.post_layernorm
            x, h = add_bias_layernorm(x, self.down(u, w2), layer.mlp.fc2.bias, nxt.weight, nxt.bias, nxt.eps)
        return h

    # ------------------------------------------------------------------ resampler
    def _resample(self, feats: torch.Tensor, batch: TowerBatch) -> torch.Tensor:
        res = self.model.resampler
        e, heads = self.embed_dim, self.res_heads
        d = e // heads
        x, keys = normed_keys(res.kv_proj(feats), res.ln_kv, batch.meta["rc"], self.omega)
        w, b = res.attn.in_proj_weight, res.attn.in_proj_bias
        if batch.uniform is not None:  # equal-size slices, no padding
            out = folded_attention(self.res_qk, x, keys, w[2 * e:], b[2 * e:], heads, batch.uniform)
        else:
            k = F.linear(keys, w[e:2 * e], b[e:2 * e]).view(-1, heads, d).transpose(0, 1)  # [H, N, d]
            v = F.linear(x, w[2 * e:], b[2 * e:]).view(-1, heads, d).transpose(0, 1)
            out = self._cross_attention(self.res_q, k, v, batch)  # [slots, Q, E]
        # out_proj's GEMM, then its bias and ln_post in one pass
        _, out = add_bias_layernorm(F.linear(out.reshape(-1, e), res.attn.out_proj.weight), None,
                                    res.attn.out_proj.bias, res.ln_post.weight, res.ln_post.bias, res.ln_post.eps)
        return out @ res.proj

    def _cross_attention(self, q, k, v, batch: TowerBatch) -> torch.Tensor:
        """Each slot's queries against its own slice's keys -> [slots, Q, E]. cuDNN's kernel only
        inside graphs, whose shapes are fixed (sdpa_backends says why)."""
        with sdpa_kernel(sdpa_backends.CAPTURED if batch.static else sdpa_backends.UNCAPTURED, set_priority=True):
            return self._cross_attention_any(q, k, v, batch)

    def _cross_attention_any(self, q, k, v, batch: TowerBatch) -> torch.Tensor:
        heads, nq, d = q.shape
        meta = batch.meta
        slots = meta["dead"].shape[0]
        if q.device.type == "cpu":  # no graph to keep static: one small attention per slice
            bounds = meta["cu"].tolist()
            out = q.new_zeros(slots, nq, heads * d)
            live = [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a][:slots - int(meta["dead"].sum())]
            for i, (a, b) in enumerate(live):
                o = F.scaled_dot_product_attention(q[None], k[None, :, a:b], v[None, :, a:b])[0]
                out[i] = o.transpose(0, 1).reshape(nq, heads * d)
            return out
        if attention.uses_torch_varlen(q.device, q.dtype):
            # each slot's queries against its own slice's keys (graph-safe: bounds on the device, static
            # maxima). An empty slot gets zeros, the padding slot the padding's keys: unused rows, finite.
            # Its cost is the keys' count, where the masked call below costs slots x keys
            # (benchmarks/results/2026-11-25-minicpm-v-down-projection-patch-gemm-resampler.md).
            cu_q = torch.arange(0, (slots + 1) * nq, nq, dtype=torch.int32, device=q.device)
            out = attention.varlen_attn(q.transpose(0, 1).repeat(slots, 1, 1), k.transpose(0, 1), v.transpose(0, 1),
                                        cu_q, meta["cu"], nq, batch.max_seqlen)
            return out.reshape(slots, nq, heads * d)
        # graph-safe: every slot's queries against all keys under a slot-id mask; empty slots see all
        qseg = torch.arange(slots, device=q.device).repeat_interleave(nq)
        mask = (qseg[:, None] == meta["kseg"][None, :]) | meta["dead"][qseg][:, None]
        out = F.scaled_dot_product_attention(q.repeat(1, slots, 1)[None], k[None], v[None], attn_mask=mask)[0]
        return out.transpose(0, 1).reshape(slots, nq, heads * d)

    def forward(self, batch: TowerBatch) -> tuple[torch.Tensor, list[torch.Tensor]]:
        feats = self._siglip_fused(batch) if self.fused else self._siglip(batch)
        return self._resample(feats, batch), []
