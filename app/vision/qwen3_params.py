"""Qwen3-VL's vision tower as plain parameter modules, without transformers' modeling code.

`VisionTower` (tower.py) computes the tower itself and needs from its module only the parameters and a
few small sub-modules (layer norms, the MLPs, the patch mergers). transformers' `Qwen3VLVisionModel`
brings them along with `modeling_utils`, `activations` and the generation stack: 4-5 s of the tower's
build on the CPU machine (2026-12-02). On the GPU host the phase's time was mostly
`AutoConfig.from_pretrained` instead, which qwen3_config.py replaces.
`Qwen3VisionParams` holds the same parameters under the same names and shapes (one checkpoint loads
into either; tests/test_qwen3_params.py compares them with transformers' module), and the same
sub-module calls, op for op. It has no forward of its own: the tower is the only caller.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


# transformers' activation names for the Qwen-family towers, as the functions its modules call (no
# lambdas: the tree pickles, as transformers' module does)
ACTIVATIONS = {
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "gelu": F.gelu,
    "silu": F.silu,
    "quick_gelu": quick_gelu,
}


# torch's layers without their initialisation at construction: the loader overwrites every value, and
# `Qwen3VisionParams.random` initialises explicitly. A default init would cost seconds of host time for
# a large tower, and on the meta device it runs torch's Python meta kernels, which import torch._dynamo.
class Linear(nn.Linear):
    def reset_parameters(self) -> None:
        pass


class LayerNorm(nn.LayerNorm):
    def reset_parameters(self) -> None:
        pass


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        pass


class Conv3d(nn.Conv3d):
    def reset_parameters(self) -> None:
        pass


class Activation(nn.Module):
    def __init__(self, name: str):
        super().__init__()
        if name not in ACTIVATIONS:
            raise ValueError(f"unsupported vision activation {name!r}; known: {', '.join(ACTIVATIONS)}")
        self.name, self.fn = name, ACTIVATIONS[name]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)

    def extra_repr(self) -> str:
        return self.name


class MLP(nn.Module):
    def __init__(self, width: int, inner: int, act: str, **dd):
        super().__init__()
        self.linear_fc1 = Linear(width, inner, **dd)
        self.linear_fc2 = Linear(inner, width, **dd)
        self.act_fn = Activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))


class PatchMerger(nn.Module):
    """Each 2x2 group of patch rows (merge_size² consecutive rows) into one LLM token. The main merger
    normalises rows before grouping them; the deepstack mergers normalise the group (`post_shuffle`)."""

    def __init__(self, width: int, merge_size: int, out_width: int, post_shuffle: bool, **dd):
        super().__init__()
        self.hidden_size = width * merge_size**2
        self.use_postshuffle_norm = post_shuffle
        self.norm = LayerNorm(self.hidden_size if post_shuffle else width, eps=1e-6, **dd)
        self.linear_fc1 = Linear(self.hidden_size, self.hidden_size, **dd)
        self.act_fn = Activation("gelu")
        self.linear_fc2 = Linear(self.hidden_size, out_width, **dd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_postshuffle_norm:
            x = self.norm(x.view(-1, self.hidden_size))
        else:
            x = self.norm(x).view(-1, self.hidden_size)
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))


class Attention(nn.Module):
    def __init__(self, width: int, **dd):
        super().__init__()
        self.qkv = Linear(width, 3 * width, **dd)
        self.proj = Linear(width, width, **dd)


class Block(nn.Module):
    def __init__(self, width: int, inner: int, act: str, **dd):
        super().__init__()
        self.norm1 = LayerNorm(width, eps=1e-6, **dd)
        self.norm2 = LayerNorm(width, eps=1e-6, **dd)
        self.attn = Attention(width, **dd)
        self.mlp = MLP(width, inner, act, **dd)


class PatchEmbed(nn.Module):
    def __init__(self, channels: int, width: int, patch: int, temporal_patch: int, **dd):
        super().__init__()
        kernel = (temporal_patch, patch, patch)
        self.proj = Conv3d(channels, width, kernel_size=kernel, stride=kernel, **dd)


class AxialRotary(nn.Module):
    """The rotary frequencies, rebuilt at load (checkpoints do not store them; loading.py fills them). They
    stay float32 through the module's casts (`.to(bf16)`, `.half()`), as transformers' `from_pretrained`
    keeps them: rounded to bf16, an angle at row 100 moves by up to 0.18 rad (the 8B tower's heads)."""

    def __init__(self, head_dim: int, device=None):
        super().__init__()
        self.inv_freq = nn.Buffer(torch.empty(head_dim // 4, device=device), persistent=False)

    def _apply(self, fn, recurse=True):
        table = self.inv_freq
        super()._apply(fn, recurse)
        self.inv_freq = table.to(self.inv_freq.device, torch.float32)  # the cast's device, not its dtype
        return self


class Qwen3VisionParams(nn.Module):
    """The parameters of `Qwen3VLVisionModel(config)`, by the same names; `config` is kept as it is. Made
    in `dtype` on `device` (default: torch's), values unset: see `empty` and `random`."""

    def __init__(self, config, dtype: torch.dtype | None = None, device: str | torch.device | None = None):
        super().__init__()
        self.config = config
        width, act, dd = config.hidden_size, config.hidden_act, {"dtype": dtype, "device": device}
        self.patch_embed = PatchEmbed(config.in_channels, width, config.patch_size, config.temporal_patch_size, **dd)
        self.pos_embed = Embedding(config.num_position_embeddings, width, **dd)
        self.rotary_pos_emb = AxialRotary(width // config.num_heads, device)
        self.blocks = nn.ModuleList(Block(width, config.intermediate_size, act, **dd) for _ in range(config.depth))
        merge, out = config.spatial_merge_size, config.out_hidden_size
        self.merger = PatchMerger(width, merge, out, post_shuffle=False, **dd)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(width, merge, out, post_shuffle=True, **dd) for _ in config.deepstack_visual_indexes)

    @classmethod
    def from_module(cls, module: nn.Module) -> Qwen3VisionParams:
        """This tree with another module's parameters and rotary table (transformers' `Qwen3VLVisionModel`:
        the tests and benchmarks that hold a reference beside the tower), on its device and in the dtype of
        its patch embedding."""
        w = module.patch_embed.proj.weight
        params = cls.empty(module.config, w.dtype, w.device)
        params.load_state_dict(module.state_dict(), strict=True)
        params.rotary_pos_emb.inv_freq = module.rotary_pos_emb.inv_freq.clone()
        return params.eval()

    @classmethod
    def empty(cls, config, dtype: torch.dtype, device: str | torch.device = "cpu") -> Qwen3VisionParams:
        """The tree with its values unset (`torch.empty` on `device`, in `dtype`), for a loader to fill.
        Made on the device itself: a meta tree's `to_empty` runs torch's Python meta kernels (0.7-1 s of
        imports), and made in `dtype` (no float32 copy to cast, which the allocator would keep)."""
        return cls(config, dtype, device)

    @classmethod
    def random(cls, config, dtype: torch.dtype, device: str | torch.device = "cpu") -> Qwen3VisionParams:
        """Random weights made on `device` (benchmarks and `load_format: dummy`: speed ignores values): normal
        with the config's initializer range, as transformers initialises the module; zero biases, unit norms."""
        model = cls.empty(config, dtype, device)
        std = getattr(config, "initializer_range", 0.02)
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, (nn.Linear, nn.Conv3d, nn.Embedding)):
                    m.weight.normal_(0.0, std)
                    if getattr(m, "bias", None) is not None:
                        m.bias.zero_()
                elif isinstance(m, nn.LayerNorm):
                    m.weight.fill_(1.0)
                    m.bias.zero_()
        return model.eval()  # (the rotary frequencies are the loader's: loading._set_inv_freq)
