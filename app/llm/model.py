"""Our own forward for the Qwen-family text decoder, over the flattened tokens of a whole step.

One forward serves every step: decodes and prefill chunks of different requests side by side, as
one [tokens, hidden] matrix (no padding, no batch dimension). Per layer: RMSNorm, one fused qkv
GEMM, q/k RMSNorm + rotary + KV-cache write in one kernel, paged attention, o GEMM, residual +
RMSNorm, one gate/up GEMM, SiLU*mul, down GEMM.

The parameters are transformers' own, loaded by name from the checkpoint (q/k/v and gate/up are
concatenated on load; there is no second copy of the weights). `TextSpec` holds what differs
between the families we serve:
- Qwen3-VL: q/k RMSNorm, interleaved M-RoPE, deepstack features added to the first layers' output;
- Qwen2.5-VL: q/k/v biases, M-RoPE in three contiguous sections, no deepstack;
- Qwen3 (text only, e.g. under MiniCPM-V): q/k RMSNorm, ordinary RoPE.
Vision embeddings replace the placeholder tokens' embeddings.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionMetadata, paged_attention
from .kernels import add_rmsnorm, qk_norm_rope_store, silu_mul


@dataclass(frozen=True)
class TextSpec:
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    rope_theta: float
    rope_axes: tuple[int, ...]  # per rotary frequency: 0 = time/text, 1 = height, 2 = width position
    qkv_bias: bool = False
    qk_norm: bool = True
    tie_embeddings: bool = False
    deepstack_layers: int = 0  # how many first layers take the vision tower's deepstack features (Qwen3-VL)
    # where the text model's tensors live in the checkpoint: the decoder's prefixes (the first one that
    # matches a name wins) and the LM head's name
    prefixes: tuple[str, ...] = ("model.language_model.",)
    head_name: str = "lm_head.weight"

    @classmethod
    def from_config(cls, config: dict) -> TextSpec:
        """From a checkpoint's config.json (Qwen3-VL, Qwen2.5-VL, MiniCPM-V, or a Qwen2/Qwen3 text model).

        Tensor names: transformers 5.x holds a VL model's decoder under `model.language_model.`, but
        saves Qwen2.5-VL under its legacy names (`model.layers.*`), so both are accepted; MiniCPM-V
        keeps a whole Qwen3 causal LM under `llm.` (`llm.model.*`, `llm.lm_head.weight`)."""
        text = config.get("text_config") or config
        head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        theta = rope.get("rope_theta", text.get("rope_theta", 10000.0))
        half = head_dim // 2
        section = rope.get("mrope_section")
        if section is None:
            axes = [0] * half
        elif rope.get("mrope_interleaved"):  # Qwen3-VL: T H W T H W ... for the first sections
            axes = [0] * half
            for axis in (1, 2):
                for j in range(axis, 3 * section[axis], 3):
                    axes[j] = axis
        else:  # Qwen2-VL / Qwen2.5-VL: contiguous sections
            axes = [a for a, n in enumerate(section) for _ in range(n)]
        if len(axes) != half:
            raise ValueError(f"rotary sections {section} do not cover head_dim/2 = {half}")
        family = config.get("model_type", "")
        qwen2 = family.startswith(("qwen2", "qwen2_5"))
        tie = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        if family == "minicpmv":
            prefixes, head = ("llm.model.",), "llm.lm_head.weight"
        elif "text_config" in config:
            prefixes, head = ("model.language_model.", "model."), "lm_head.weight"
        else:
            prefixes, head = ("model.",), "lm_head.weight"
        return cls(vocab=text["vocab_size"], hidden=text["hidden_size"], layers=text["num_hidden_layers"],
                   heads=text["num_attention_heads"], kv_heads=text["num_key_value_heads"], head_dim=head_dim,
                   intermediate=text["intermediate_size"], eps=text.get("rms_norm_eps", 1e-6), rope_theta=theta,
                   rope_axes=tuple(axes), qkv_bias=text.get("attention_bias", qwen2), qk_norm=not qwen2,
                   tie_embeddings=bool(tie), prefixes=prefixes, head_name=head,
                   deepstack_layers=len((config.get("vision_config") or {}).get("deepstack_visual_indexes") or ()))


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


class DecoderLayer(nn.Module):
    def __init__(self, s: TextSpec, param):
        super().__init__()
        qkv = (s.heads + 2 * s.kv_heads) * s.head_dim
        self.qkv_weight = param(qkv, s.hidden)
        self.qkv_bias = param(qkv) if s.qkv_bias else None
        self.o_weight = param(s.hidden, s.heads * s.head_dim)
        self.q_norm = param(s.head_dim) if s.qk_norm else None
        self.k_norm = param(s.head_dim) if s.qk_norm else None
        self.input_norm = param(s.hidden)
        self.post_attention_norm = param(s.hidden)
        self.gate_up_weight = param(2 * s.intermediate, s.hidden)
        self.down_weight = param(s.hidden, s.intermediate)


class TextModel(nn.Module):
    def __init__(self, spec: TextSpec, dtype: torch.dtype, device: torch.device, max_position: int):
        super().__init__()
        self.spec, self.dtype, self.device = spec, dtype, device

        def param(*shape):
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)

        self.embed = param(spec.vocab, spec.hidden)
        self.layers = nn.ModuleList(DecoderLayer(spec, param) for _ in range(spec.layers))
        self.norm = param(spec.hidden)
        self.lm_head = None if spec.tie_embeddings else param(spec.vocab, spec.hidden)
        self.scale = spec.head_dim ** -0.5
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

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata, vision: VisionBatch | None = None) -> torch.Tensor:
        """-> final-normed hidden states [T, hidden]. positions [3, T] or [T]; kv_cache [layers, 2, slots,
        kv_heads, head_dim]; slots: each token's KV-cache slot."""
        s = self.spec
        x = F.embedding(input_ids, self.embed)
        on = None
        if vision is not None:
            on = (vision.mask != 0).unsqueeze(1)
            x = torch.where(on, vision.main, x)
        cos, sin = self.rotary(positions)
        t = x.shape[0]
        residual, pending = x, None
        deepstack = vision.deepstack if vision is not None else None
        for i, layer in enumerate(self.layers):
            residual, h = add_rmsnorm(residual, pending, layer.input_norm, s.eps)
            qkv = F.linear(h, layer.qkv_weight, layer.qkv_bias)
            k_cache, v_cache = kv_cache[i, 0], kv_cache[i, 1]
            q = qk_norm_rope_store(qkv, layer.q_norm, layer.k_norm, cos, sin, k_cache, v_cache, slots, s.heads,
                                   s.kv_heads, s.eps)
            o = paged_attention(q, k_cache, v_cache, meta, self.scale)
            o = F.linear(o.view(t, -1), layer.o_weight)
            residual, h = add_rmsnorm(residual, o, layer.post_attention_norm, s.eps)
            pending = F.linear(silu_mul(F.linear(h, layer.gate_up_weight)), layer.down_weight)
            if deepstack is not None and i < deepstack.shape[0]:
                # transformers adds the features to the layer's output on the vision rows: the same sum,
                # rounded the same way, selected per row
                residual = residual + pending
                residual = torch.where(on, residual + deepstack[i], residual)
                pending = None
        _, h = add_rmsnorm(residual, pending, self.norm, s.eps)
        return h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.head_weight)

    # ------------------------------------------------------------------ weights
    _LAYER_NAMES = {"self_attn.o_proj.weight": "o_weight", "self_attn.q_norm.weight": "q_norm",
                    "self_attn.k_norm.weight": "k_norm", "input_layernorm.weight": "input_norm",
                    "post_attention_layernorm.weight": "post_attention_norm", "mlp.down_proj.weight": "down_weight"}

    def _target(self, name: str) -> tuple[str, int | None] | None:
        """transformers' tensor name -> (our parameter, first row for a fused one, else None)."""
        s = self.spec
        if name == s.head_name:
            return ("lm_head", None) if self.lm_head is not None else None
        pre = next((p for p in s.prefixes if name.startswith(p)), None)
        if pre is None:
            return None
        rest = name[len(pre):]
        if rest in ("embed_tokens.weight", "norm.weight"):
            return ("embed" if rest.startswith("embed") else "norm"), None
        if not rest.startswith("layers."):
            return None
        idx, _, tail = rest[len("layers."):].partition(".")
        q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
        fused = {"self_attn.q_proj": ("qkv", 0), "self_attn.k_proj": ("qkv", q), "self_attn.v_proj": ("qkv", q + kv),
                 "mlp.gate_proj": ("gate_up", 0), "mlp.up_proj": ("gate_up", s.intermediate)}
        module, _, kind = tail.rpartition(".")
        if module in fused:
            base, row = fused[module]
            return f"layers.{idx}.{base}_{kind}", row
        ours = self._LAYER_NAMES.get(tail)
        return (f"layers.{idx}.{ours}", None) if ours else None

    @torch.no_grad()
    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy transformers-named tensors into our parameters (q/k/v and gate/up concatenated on
        load). Vision-tower tensors and unknown names are skipped; every parameter must be filled."""
        params = dict(self.named_parameters())
        filled: dict[str, int] = {}
        for name, w in named:
            target = self._target(name)
            if target is None or target[0] not in params:
                continue
            pname, row = target
            dst = params[pname] if row is None else params[pname][row:row + w.shape[0]]
            dst.copy_(w)
            filled[pname] = filled.get(pname, 0) + w.shape[0] if row is not None else params[pname].shape[0]
        missing = [n for n, p in params.items() if filled.get(n, 0) != p.shape[0]]
        if missing:
            raise ValueError(f"checkpoint lacks text-model weights for {missing[:5]}{' ...' if len(missing) > 5 else ''}")


def checkpoint_tensors(path: str | Path, device: torch.device, prefix_filter: tuple[str, ...]):
    """(name, tensor) for the safetensors files of a checkpoint folder, only names starting with
    one of `prefix_filter` (the vision tower's tensors are never read)."""
    from safetensors import safe_open

    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no .safetensors files in {path}")
    for f in files:
        with safe_open(str(f), framework="pt", device=str(device)) as sf:
            for name in sf.keys():
                if name.startswith(prefix_filter):
                    yield name, sf.get_tensor(name)


def load_text_model(path: str | Path, dtype: torch.dtype, device: torch.device, max_position: int) -> TextModel:
    config = json.loads((Path(path) / "config.json").read_text())
    spec = TextSpec.from_config(config)
    model = TextModel(spec, dtype, device, max_position)
    model.load_weights(checkpoint_tensors(path, device, (*spec.prefixes, spec.head_name)))
    return model.eval()
