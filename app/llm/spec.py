"""What the engine needs to know about a checkpoint's text decoder, read once from its config.json.

`TextSpec` holds the shapes and what differs between the families we serve:
- Qwen3-VL: q/k RMSNorm, interleaved M-RoPE, deepstack features added to the first layers' output;
- Qwen3-VL-MoE: the same, with a mixture of SwiGLU experts in place of the MLP in its sparse layers;
- Qwen2.5-VL: q/k/v biases, M-RoPE in three contiguous sections, no deepstack;
- Qwen3 (text only, e.g. under MiniCPM-V): q/k RMSNorm, ordinary RoPE.
"""

from __future__ import annotations

from dataclasses import dataclass

# model_type -> the family whose positions, prompt and vision tower it shares
FAMILY_OF = {"qwen3_vl_moe": "qwen3_vl"}


def family(config: dict) -> str:
    """The checkpoint's family for everything but the decoder's MLP (an MoE model is its dense sibling there)."""
    model_type = config.get("model_type", "")
    return FAMILY_OF.get(model_type, model_type)


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
    # mixture of experts (0 experts: a dense model): which layers route, over how many experts, to how many
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    sparse_layers: tuple[int, ...] = ()
    norm_topk: bool = True  # the chosen experts' weights renormalised to sum to 1
    # where the text model's tensors live in the checkpoint: the decoder's prefixes (the first one that
    # matches a name wins) and the LM head's name
    prefixes: tuple[str, ...] = ("model.language_model.",)
    head_name: str = "lm_head.weight"

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers

    @classmethod
    def from_config(cls, config: dict) -> TextSpec:
        """From a checkpoint's config.json (Qwen3-VL, Qwen3-VL-MoE, Qwen2.5-VL, MiniCPM-V, or a Qwen2/Qwen3
        text model).

        Tensor names: transformers 5.x holds a VL model's decoder under `model.language_model.`, but
        saves Qwen2.5-VL under its legacy names (`model.layers.*`), so both are accepted; MiniCPM-V
        keeps a whole Qwen3 causal LM under `llm.` (`llm.model.*`, `llm.lm_head.weight`)."""
        text = config.get("text_config") or config
        head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        theta = rope.get("rope_theta", text.get("rope_theta", 10000.0))
        axes = _rope_axes(head_dim // 2, rope.get("mrope_section"), rope.get("mrope_interleaved", False))
        model_type = config.get("model_type", "")
        qwen2 = model_type.startswith(("qwen2", "qwen2_5"))
        tie = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        if model_type == "minicpmv":
            prefixes, head = ("llm.model.",), "llm.lm_head.weight"
        elif "text_config" in config:
            prefixes, head = ("model.language_model.", "model."), "lm_head.weight"
        else:
            prefixes, head = ("model.",), "lm_head.weight"
        layers = text["num_hidden_layers"]
        experts = int(text.get("num_experts") or text.get("num_local_experts") or 0)
        sparse: tuple[int, ...] = ()
        if experts:  # transformers' rule: every decoder_sparse_step-th layer, except mlp_only_layers
            step, dense = text.get("decoder_sparse_step", 1) or 1, set(text.get("mlp_only_layers") or ())
            sparse = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
        return cls(vocab=text["vocab_size"], hidden=text["hidden_size"], layers=layers,
                   heads=text["num_attention_heads"], kv_heads=text["num_key_value_heads"], head_dim=head_dim,
                   intermediate=text.get("intermediate_size") or 0, eps=text.get("rms_norm_eps", 1e-6),
                   rope_theta=theta, rope_axes=axes, qkv_bias=text.get("attention_bias", qwen2), qk_norm=not qwen2,
                   tie_embeddings=bool(tie), prefixes=prefixes, head_name=head,
                   deepstack_layers=len((config.get("vision_config") or {}).get("deepstack_visual_indexes") or ()),
                   experts=experts, experts_per_token=int(text.get("num_experts_per_tok") or 0),
                   expert_intermediate=int(text.get("moe_intermediate_size") or 0), sparse_layers=sparse,
                   # transformers' Qwen3-VL-MoE router always renormalises, whatever the config says
                   norm_topk=model_type == "qwen3_vl_moe" or bool(text.get("norm_topk_prob", True)))


def _rope_axes(half: int, section, interleaved: bool) -> tuple[int, ...]:
    """Which position axis each rotary frequency reads."""
    if section is None:
        axes = [0] * half
    elif interleaved:  # Qwen3-VL: T H W T H W ... for the first sections
        axes = [0] * half
        for axis in (1, 2):
            for j in range(axis, 3 * section[axis], 3):
                axes[j] = axis
    else:  # Qwen2-VL / Qwen2.5-VL: contiguous sections
        axes = [a for a, n in enumerate(section) for _ in range(n)]
    if len(axes) != half:
        raise ValueError(f"rotary sections {section} do not cover head_dim/2 = {half}")
    return tuple(axes)
