"""A request's sampling parameters: OpenAI's, plus vLLM's extensions (`top_k`, `min_p`,
`repetition_penalty`, `min_tokens`, `stop_token_ids`, `ignore_eos`, `skip_special_tokens`,
`include_stop_str_in_output`). The batched sampler that applies the logit-side ones is
app/llm/sampler.py; stop strings and stop token ids are handled where text is made (stream.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # most alternatives per token a request may ask for (OpenAI's `top_logprobs` limit)
MAX_CHOICES = 64  # most choices (OpenAI's `n`) per request: each is a sequence in the engine's batch
MAX_STOP_TOKEN_IDS = 32  # `stop_token_ids` per request (the sampler keeps them per row for `min_tokens`)


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
    # vLLM's: keep tokens whose probability is at least min_p x the most likely one's (after temperature)
    min_p: float = 0.0
    # vLLM's and transformers': a token of the prompt or the output so far has its logit divided by
    # this when positive, multiplied when negative (1 = off)
    repetition_penalty: float = 1.0
    # vLLM's: no end of sequence, stop token id or stop string before this many output tokens
    min_tokens: int = 0
    # vLLM's: these token ids end the answer as a stop string does ("stop"); not in the output unless
    # include_stop_str_in_output
    stop_token_ids: list[int] = field(default_factory=list)
    skip_special_tokens: bool = True  # vLLM's: special tokens' text left out of the output
    include_stop_str_in_output: bool = False  # vLLM's: the stop string (or stop token) that ended it stays
    # None: no log-probabilities; k >= 0: each output token's log-probability and the k most likely
    # tokens' at its position (OpenAI's `logprobs` / `top_logprobs`)
    logprobs: int | None = None
    # choices generated from the one prompt (OpenAI's `n`): choice i draws with `seed + i` when a seed
    # is given, so choice 0 is what the same request with n = 1 gives; the prompt is computed once
    n: int = 1
    # structured output: an llguidance grammar (app/llm/grammar.py, from OpenAI's `response_format`);
    # None = free text
    grammar: str | None = None
