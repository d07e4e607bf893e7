"""Sampling defaults for the parameters a request leaves out: the checkpoint's, or OpenAI's.

As vLLM's OpenAI server does by default (`--generation-config auto`), a parameter a request omits
takes the value the checkpoint's `generation_config.json` recommends, for `temperature`, `top_p`,
`top_k`, `min_p`, `repetition_penalty` and `max_new_tokens` (the default `max_tokens`, never above
the server's `llm.default_max_tokens`). Like vLLM, only values the file sets to something other than
transformers' own defaults count (transformers' `top_k` of 50 is its default, not the checkpoint's
choice), and `do_sample` is not read: a checkpoint that sets a temperature is sampled at it. Qwen3-VL's
Instruct checkpoints ship temperature 0.7, top_p 0.8, top_k 20, repetition_penalty 1.0.

`sampling_defaults: openai` turns this off (vLLM's `--generation-config vllm`): OpenAI's defaults,
temperature 1, no top-p, top-k, min-p or repetition penalty. `/v1/models` lists the defaults in force.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

# OpenAI's defaults (vLLM's neutral ones): what a parameter is when neither the request nor the checkpoint says
OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
# transformers' GenerationConfig defaults: a generation config value equal to one of these is not the
# checkpoint's own choice (vLLM reads the config's difference from them)
_TRANSFORMERS_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}


def _valid(name: str, v) -> bool:
    """Whether a generation config value is one a request could send (else it is not used)."""
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return False
    if name == "temperature":
        return 0 <= v <= 2
    if name == "top_p":
        return 0 < v <= 1
    if name == "top_k":
        return isinstance(v, int) and v >= -1
    if name == "min_p":
        return 0 <= v <= 1
    if name == "repetition_penalty":
        return 0 < v <= 100
    return isinstance(v, int) and v >= 1  # max_new_tokens


@dataclass(frozen=True)
class SamplingDefaults:
    """The values omitted sampling parameters take, and where they come from."""

    values: dict = field(default_factory=lambda: dict(OPENAI_DEFAULTS))  # every name of OPENAI_DEFAULTS
    source: str = "openai"  # "openai", or the file the checkpoint's values come from
    max_tokens: int | None = None  # the checkpoint's max_new_tokens (caps the default max_tokens)

    def __getitem__(self, name: str):
        return self.values[name]

    def default_max_tokens(self, server_default: int) -> int:
        return server_default if self.max_tokens is None else min(server_default, self.max_tokens)

    def card(self, server_default_max_tokens: int) -> dict:
        """What `/v1/models` says of them."""
        return {"source": self.source, **self.values,
                "max_tokens": self.default_max_tokens(server_default_max_tokens)}


OPENAI = SamplingDefaults()


def from_generation_config(config: dict, source: str = "generation_config.json") -> SamplingDefaults:
    """The defaults a generation config (its parsed JSON) sets; values out of a request's range are left
    out with a warning."""
    values = dict(OPENAI_DEFAULTS)
    max_tokens = None
    for name in (*OPENAI_DEFAULTS, "max_new_tokens"):
        v = config.get(name)
        if v is None or v == _TRANSFORMERS_DEFAULTS.get(name):
            continue
        if not _valid(name, v):
            log.warning("the checkpoint's generation config sets %s = %r, which a request could not; not used", name, v)
            continue
        if name == "max_new_tokens":
            max_tokens = v
        else:
            values[name] = 0 if name == "top_k" and v == -1 else v
    return SamplingDefaults(values, source, max_tokens)


def load_sampling_defaults(checkpoint: str | Path | None, mode: str = "checkpoint") -> SamplingDefaults:
    """`mode` "checkpoint": the defaults of `checkpoint`'s generation_config.json (OpenAI's where it has
    none or sets none); "openai": OpenAI's."""
    if mode == "openai" or checkpoint is None:
        return OPENAI
    path = Path(checkpoint) / "generation_config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        return OPENAI
    except (OSError, ValueError) as e:
        log.warning("%s is unreadable (%s); OpenAI's sampling defaults apply", path, e)
        return OPENAI
    got = from_generation_config(config if isinstance(config, dict) else {})
    if got.values != OPENAI_DEFAULTS or got.max_tokens is not None:
        log.info("omitted sampling parameters take the checkpoint's generation config: %s", got.card(1 << 30))
        return got
    return OPENAI
