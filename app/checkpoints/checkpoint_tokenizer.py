"""The tokenizer, chat templates and generation config the embedded checkpoints ship
(app/checkpoints/model_builder.py, app/checkpoints/minicpmv_builder.py): a byte-level BPE trained offline on a small fixed
corpus, Qwen's special tokens, ChatML with Qwen's tool calling per family, and Qwen3-VL-Instruct's
recommended sampling.
"""

from __future__ import annotations

import json
from pathlib import Path

# The sampling Qwen3-VL's Instruct checkpoints recommend in their generation_config.json, which every
# embedded preset ships: omitted sampling parameters take these (app/api/defaults.py), as with the
# real checkpoints.
GENERATION_DEFAULTS = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.0}


def write_generation_config(folder: Path, bos: int, eos: int, pad: int) -> None:
    """generation_config.json as Qwen's checkpoints write it: the special ids and GENERATION_DEFAULTS."""
    config = {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad, **GENERATION_DEFAULTS}
    (Path(folder) / "generation_config.json").write_text(json.dumps(config, indent=2))

# Qwen's special tokens, in Qwen's order; they follow the byte-level vocabulary.
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]

# A message's content in Qwen's format: a string as it is, or its parts in order, each image or video as
# <|vision_start|><|image_pad|><|vision_end|> (or <|video_pad|>), expanded later per item, texts as they are.
_CONTENT_MACRO = (
    "{%- macro render_content(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part['type'] in ('image', 'image_url') -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] in ('video', 'video_url') -%}{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
)
# One plain message.
_MESSAGE = (
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{{- render_content(message['content']) -}}"
    "{{- '<|im_end|>\\n' -}}"
)
_GENERATION_PROMPT = "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"

# Tool calling in Hermes/Qwen style, shared by every family (MiniCPM-V 4.5's too). `tools_header(prefix)`:
# the system message that lists the tools, after `prefix` (the conversation's system message or a
# default, and a blank line). An assistant message with `tool_calls` (OpenAI's shape, or name and
# arguments without "function") renders each as <tool_call> JSON, arguments as they are when a string;
# a run of `tool` messages is one user turn of <tool_response> blocks (their text parts, joined with
# `joiner`).
_TOOLS_HEADER = (
    "{%- macro tools_header(prefix) -%}"
    "{{- '<|im_start|>system\\n' + prefix + '# Tools\\n\\nYou may call one or more functions to assist with the user "
    "query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' -}}{{- tool | tojson -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' -}}"
    "{%- endmacro -%}"
)


def _tool_turns(joiner: str) -> str:
    """`elif` branches of the message loop for assistant tool calls and tool responses."""
    return (
        "{%- elif message['role'] == 'assistant' and message['tool_calls'] -%}"
        "{{- '<|im_start|>assistant' -}}"
        "{%- if message['content'] -%}{{- '\\n' -}}{{- render_content(message['content']) -}}{%- endif -%}"
        "{%- for call in message['tool_calls'] -%}"
        "{%- set fn = call['function'] if call['function'] else call -%}"
        "{%- set args = fn['arguments'] if fn['arguments'] else {} -%}"
        "{{- '\\n<tool_call>\\n{\"name\": \"' -}}{{- fn['name'] -}}{{- '\", \"arguments\": ' -}}"
        "{%- if args is string -%}{{- args -}}{%- else -%}{{- args | tojson -}}{%- endif -%}"
        "{{- '}\\n</tool_call>' -}}"
        "{%- endfor -%}"
        "{{- '<|im_end|>\\n' -}}"
        "{%- elif message['role'] == 'tool' -%}"
        "{%- if loop.first or loop.previtem['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
        "{{- '\\n<tool_response>\\n' -}}"
        "{%- if message['content'] is string -%}{{- message['content'] -}}"
        "{%- else -%}{{- message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('"
        + joiner + "') -}}{%- endif -%}"
        "{{- '\\n</tool_response>' -}}"
        "{%- if loop.last or loop.nextitem['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    )


# Whether the first message is a system one (then the tools header holds it).
_FIRST_IS_SYSTEM = "{%- set first_is_system = messages and messages[0]['role'] == 'system' -%}"

def chatml_template(content_macro: str, joiner: str = "") -> str:
    """ChatML with Qwen's tool calling, over a family's `render_content` macro; `joiner` joins a tool
    result's text parts. The conversation's system message goes into the tools header when there are
    tools."""
    return (
        content_macro + _TOOLS_HEADER + _FIRST_IS_SYSTEM
        + "{%- if tools -%}"
        "{{- tools_header(render_content(messages[0]['content']) + '\\n\\n' if first_is_system else '') -}}"
        "{%- endif -%}"
        "{%- for message in messages -%}"
        "{%- if tools and loop.first and first_is_system -%}"  # already in the tools header
        + _tool_turns(joiner) + "{%- else -%}" + _MESSAGE + "{%- endif -%}"
        "{%- endfor -%}" + _GENERATION_PROMPT
    )


# Qwen3-VL's prompt format.
CHAT_TEMPLATE = chatml_template(_CONTENT_MACRO)

# Qwen2.5-VL's: a default system message when the conversation has none (with tools, the tools header
# follows it), then the same messages (a video is one <|vision_start|><|video_pad|><|vision_end|>,
# expanded without timestamps).
QWEN25_CHAT_TEMPLATE = (
    _CONTENT_MACRO + _TOOLS_HEADER + _FIRST_IS_SYSTEM
    + "{%- if tools -%}"
    "{{- tools_header((render_content(messages[0]['content']) if first_is_system else 'You are a helpful assistant.')"
    " + '\\n\\n') -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if loop.first and not first_is_system and not tools -%}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- if tools and loop.first and first_is_system -%}"
    + _tool_turns("") + "{%- else -%}" + _MESSAGE + "{%- endif -%}"
    "{%- endfor -%}" + _GENERATION_PROMPT
)


# A small fixed corpus so BPE training is deterministic and offline.
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Describe this image in detail. What is happening in the video?",
    "A photo of a cat sitting on a red chair next to a window.",
    "user assistant system You are a helpful assistant.",
    "0.5 1.0 1.5 2.0 2.5 3.0 seconds frames pixels colors shapes",
    "How many people are there? What color is the car? Where was this taken?",
] * 8


def build_tokenizer(vocab_size: int = 512, template: str = CHAT_TEMPLATE, specials: list[str] | None = None):
    """A byte-level BPE trained on a fixed corpus, with the family's special tokens appended (Qwen's by
    default) and its chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    tok.add_special_tokens(specials or SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        padding_side="left",
        extra_special_tokens={},
    )
    fast.chat_template = template
    return fast


def mute_unspoken_rows(weights: list, spoken: int, first_row: int = 0) -> None:
    """Zero the embedding and LM-head rows of token ids the small tokenizer does not have (`spoken` and up;
    `first_row`: the id of these tensors' row 0, a tensor-parallel rank's share). A real shape keeps its
    vocabulary size (151,936), and random weights then sample those ids nearly every time: they decode to
    "", so a streamed answer carried no text, only its role, finish and usage chunks. Benchmarks streamed
    4 events a request instead of one per token, and GuideLLM timed no first token (2026-11-28). Their
    logits become 0: greedy decoding and the presets' top_k (20) pick spoken ids; a request with no
    top-k at temperature 1 still draws mostly muted ids (151k zero logits against 440)."""
    import torch

    with torch.no_grad():
        for w in {id(w): w for w in weights}.values():  # the same tensor twice when tied
            w[max(0, spoken - first_row):].zero_()
