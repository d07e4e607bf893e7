"""transformers' tensors into our parameters: by name, each rank reading only its share.

Our layout fuses what runs as one GEMM (`qkv`, `gate_up`), so a checkpoint tensor lands in rows of one
of our parameters, after the rank's slice is taken (parallel.py). `TensorSource`s read only the rows or
columns asked for (`get_slice`): no rank reads the whole of a large tensor.

Experts come per expert (`mlp.experts.E.gate_proj.weight`, Qwen3-MoE), stacked as files hold them
(`gate_up_proj` [E, hidden, 2 units], `down_proj` [E, units, hidden]) or stacked as transformers'
modules hold them (last two dimensions swapped); the shape tells which unless hidden == 2 units, where
the file layout is assumed unless the caller says `module_layout`. `init_random` fills parameters on
the device instead, for checkpoints too large to write (235B is ~470 GB in bf16): speed ignores values.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoints.checkpoint_tokenizer import mute_unspoken_rows
from .model import TextModel

# one slice per leading dimension; ALL for the whole tensor
Index = tuple[slice, ...]
ALL: Index = (slice(None),)


@dataclass
class TensorSource:
    """A named tensor that can give a slice of itself without producing the rest."""

    name: str
    shape: tuple[int, ...]
    read: Callable[[Index], torch.Tensor]

    @classmethod
    def of(cls, name: str, t: torch.Tensor) -> TensorSource:
        return cls(name, tuple(t.shape), lambda idx: t[idx])


def state_dict_sources(named: Iterable[tuple[str, torch.Tensor]]) -> Iterable[TensorSource]:
    for name, t in named:
        yield TensorSource.of(name, t)


def checkpoint_sources(path: str | Path, device: torch.device, prefixes: tuple[str, ...]) -> Iterable[TensorSource]:
    """The text model's tensors of a checkpoint folder's safetensors files, read lazily: the vision
    tower's are never read, and each is read only as far as the loader slices it."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no .safetensors files in {path}")
    for f in files:
        with safe_open(str(f), framework="pt", device=str(device)) as sf:
            for name in sf.keys():
                if name.startswith(prefixes):
                    part = sf.get_slice(name)
                    yield TensorSource(name, tuple(part.get_shape()), lambda idx, part=part: part[idx])


_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_PLAIN = {"self_attn.o_proj.weight": "o_weight", "self_attn.q_norm.weight": "q_norm",
          "self_attn.k_norm.weight": "k_norm", "input_layernorm.weight": "input_norm",
          "post_attention_layernorm.weight": "post_attention_norm", "mlp.down_proj.weight": "down_weight",
          "mlp.gate.weight": "router_weight"}


class WeightLoader:
    """Copies sources into one model's parameters (this rank's share), counting what was filled."""

    def __init__(self, model: TextModel, module_layout: bool = False):
        self.model, self.module_layout = model, module_layout
        self.s, self.tp, self.local = model.spec, model.tp, model.local
        self.params = dict(model.named_parameters())
        self.filled: dict[str, int] = {}  # parameter -> elements written

    def load(self, sources: Iterable[TensorSource]) -> None:
        for src in sources:
            self._one(src)
        missing = [n for n, p in self.params.items() if self.filled.get(n, 0) != p.numel()]
        if missing:
            raise ValueError(f"checkpoint lacks text-model weights for {missing[:5]}{' ...' if len(missing) > 5 else ''}")

    def _put(self, pname: str, dst: torch.Tensor, value: torch.Tensor) -> None:
        dst.copy_(value)
        self.filled[pname] = self.filled.get(pname, 0) + dst.numel()

    def _one(self, src: TensorSource) -> None:
        s = self.s
        if src.name == s.head_name:
            if self.model.lm_head is not None:
                self._vocab("lm_head", src)
            return
        pre = next((p for p in s.prefixes if src.name.startswith(p)), None)
        if pre is None:
            return
        rest = src.name[len(pre):]
        if rest == "embed_tokens.weight":
            return self._vocab("embed", src)
        if rest == "norm.weight":
            return self._put("norm", self.params["norm"], src.read(ALL))
        m = _LAYER.fullmatch(rest)
        if m is None:
            return
        layer, tail = m.group(1), m.group(2)
        prefix = f"layers.{layer}."
        if f"{prefix}qkv_weight" not in self.params:
            return  # a layer this spec does not have
        module, _, kind = tail.rpartition(".")
        if module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
            return self._qkv(prefix + f"qkv_{kind}", module[-6], src)
        if module in ("mlp.gate_proj", "mlp.up_proj"):
            return self._units(prefix + "gate_up_weight", module == "mlp.up_proj", src, self.local.intermediate)
        if tail.startswith("mlp.experts."):
            return self._experts(prefix, tail, src)
        ours = _PLAIN.get(tail)
        if ours is None or prefix + ours not in self.params:
            return
        name = prefix + ours
        if ours == "o_weight":
            a, b = self.tp.part(s.heads, "attention heads")
            self._put(name, self.params[name], src.read((slice(None), slice(a * s.head_dim, b * s.head_dim))))
        elif ours == "down_weight":
            a, b = self.tp.part(s.intermediate, "MLP units")
            self._put(name, self.params[name], src.read((slice(None), slice(a, b))))
        else:  # replicated: norms, the router
            self._put(name, self.params[name], src.read(ALL))

    def _vocab(self, pname: str, src: TensorSource) -> None:
        a, b, _ = self.tp.padded_part(self.s.vocab)
        dst = self.params[pname]
        self._put(pname, dst[:b - a], src.read((slice(a, b),)))
        if b - a < dst.shape[0]:  # padding rows: never looked up, their logits cut off
            self._put(pname, dst[b - a:], torch.zeros_like(dst[b - a:]))

    def _qkv(self, pname: str, which: str, src: TensorSource) -> None:
        s, local, d = self.s, self.local, self.s.head_dim
        if which == "q":
            h0, _ = self.tp.part(s.heads, "attention heads")
            rows, at = slice(h0 * d, (h0 + local.heads) * d), 0
        else:
            k0, n = self.tp.kv_heads(s.heads, s.kv_heads)
            rows = slice(k0 * d, (k0 + n) * d)
            at = (local.heads + (local.kv_heads if which == "v" else 0)) * d
        part = src.read((rows,))
        self._put(pname, self.params[pname][at:at + part.shape[0]], part)

    def _units(self, pname: str, up: bool, src: TensorSource, local_units: int) -> None:
        """A gate or up projection [units, hidden]: the rank's units, into the first or second half."""
        a = self.tp.rank * local_units
        part = src.read((slice(a, a + local_units),))
        at = local_units if up else 0
        self._put(pname, self.params[pname][at:at + local_units], part)

    def _held_experts(self) -> tuple[int, int]:
        held = self.local.experts
        first = self.tp.rank * held if self.tp.enabled and self.tp.moe == "ep" else 0
        return first, held

    def _experts(self, prefix: str, tail: str, src: TensorSource) -> None:
        s, local = self.s, self.local
        first, held = self._held_experts()
        units = local.expert_intermediate
        u0 = self.tp.rank * units if self.tp.moe == "tp" else 0
        gate_up, down = self.params[prefix + "experts_gate_up"], self.params[prefix + "experts_down"]
        m = _EXPERT.fullmatch(tail)
        if m is not None:  # one expert's projection
            e = int(m.group(1)) - first
            if not 0 <= e < held:
                return
            if m.group(2) == "down_proj":
                self._put(prefix + "experts_down", down[e], src.read((slice(None), slice(u0, u0 + units))))
            else:
                at = units if m.group(2) == "up_proj" else 0
                self._put(prefix + "experts_gate_up", gate_up[e, at:at + units], src.read((slice(u0, u0 + units),)))
            return
        experts = slice(first, first + held)
        full = s.expert_intermediate
        if tail == "mlp.experts.gate_up_proj":
            module = self._module_layout(src.shape, (s.experts, 2 * full, s.hidden))
            for at, start in ((0, u0), (units, full + u0)):
                if module:  # [E, 2 units, hidden]
                    part = src.read((experts, slice(start, start + units)))
                else:  # [E, hidden, 2 units]
                    part = src.read((experts, slice(None), slice(start, start + units))).transpose(1, 2)
                self._put(prefix + "experts_gate_up", gate_up[:, at:at + units], part)
        elif tail == "mlp.experts.down_proj":
            if self._module_layout(src.shape, (s.experts, s.hidden, full)):  # [E, hidden, units]
                part = src.read((experts, slice(None), slice(u0, u0 + units)))
            else:  # [E, units, hidden]
                part = src.read((experts, slice(u0, u0 + units))).transpose(1, 2)
            self._put(prefix + "experts_down", down, part)

    def _module_layout(self, shape: tuple[int, ...], module_shape: tuple[int, ...]) -> bool:
        file_shape = (module_shape[0], module_shape[2], module_shape[1])
        if shape == module_shape and shape != file_shape:
            return True
        if shape == file_shape and shape != module_shape:
            return False
        if shape != module_shape:
            raise ValueError(f"expert tensor of shape {shape} fits neither {module_shape} nor {file_shape}")
        return self.module_layout


def load_weights(model: TextModel, sources: Iterable[TensorSource], module_layout: bool = False) -> None:
    """Fill every parameter of `model` from `sources` (transformers' names); unknown names are skipped."""
    with torch.no_grad():
        WeightLoader(model, module_layout).load(sources)


@torch.no_grad()
def init_random(model: TextModel, seed: int = 0, std: float = 0.02, spoken: int | None = None) -> None:
    """Random weights straight on the model's device (norm weights 1), as `load_format: dummy` asks:
    no file is read or written. Each rank draws its own shard. `spoken`: the tokenizer's size; the
    embedding and LM-head rows of ids past it are zeros, as the checkpoint builder writes them (else
    answers stream no text)."""
    gen = torch.Generator(device=model.device).manual_seed(seed + 7919 * model.tp.rank)
    for name, p in model.named_parameters():
        if name.endswith("norm") or name.endswith("_norm"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, std, generator=gen)
    if spoken is not None:
        mute_unspoken_rows([model.embed, model.head_weight], spoken, first_row=model.vocab_start)
