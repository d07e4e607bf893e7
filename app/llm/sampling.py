"""A request's sampling parameters (OpenAI's, plus `ignore_eos` for benchmarks). The batched sampler
that applies them is app/llm/sampler.py; stop strings are handled where text is made (stream.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # most alternatives per token a request may ask for (OpenAI's `top_logprobs` limit)
MAX_CHOICES = 64  # most choices (OpenAI's `n`) per request: each is a sequence in the engine's batch


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    ignore_eos: bool = False  # benchmarks: always generate max_tokens
    # None: no log-probabilities; k >= 0: each output token's log-probability and the k most likely
    # tokens' at its position (OpenAI's `logprobs` / `top_logprobs`)
    logprobs: int | None = None
    # choices generated from the one prompt (OpenAI's `n`): choice i draws with `seed + i` when a seed
    # is given, so choice 0 is what the same request with n = 1 gives; the prompt is computed once
    n: int = 1
    # structured output: an llguidance grammar (app/llm/grammar.py, from OpenAI's `response_format`);
    # None = free text
    grammar: str | None = None
