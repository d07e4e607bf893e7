"""Structured output: OpenAI's `response_format` (`json_object`, `json_schema`) as a token mask.

The grammar engine is llguidance (one small wheel, no dependencies): a JSON schema becomes a grammar,
and a matcher per sequence says, at each step, which tokens may come next. The API layer turns
`response_format` into a grammar string (`grammar_for`), checked there, so a bad schema is a 400
before anything runs; it travels in `SamplingParams.grammar`, and the engine's side is `Grammars`.

JSON is generated compact (no whitespace between tokens): with flexible whitespace a weak or unlucky
model can spend its whole budget on spaces. A schema's own `x-guidance` options override this.
"""

from __future__ import annotations

import functools
import json
import os
import re
import threading
from collections import OrderedDict

import torch

from ..errors import ClientError

_COMPACT = {"whitespace_flexible": False}
MAX_CHOICE_STRINGS = 1024  # `structured_outputs.choice`


def _llguidance():
    try:
        import llguidance
    except ImportError as e:  # a dependency (pyproject.toml); an install without it still serves free text
        raise ClientError("'response_format' needs the llguidance package, which this server lacks",
                          param="response_format", code="unsupported_parameter") from e
    return llguidance


def grammar_for(response_format, param: str = "response_format") -> str | None:
    """The grammar for an OpenAI `response_format` (None: free text), or a 400 naming `param`."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise _bad("'response_format' must be an object with a 'type'")
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        schema = {"type": "object"}
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise _bad("'response_format.json_schema' must be an object whose 'schema' is a JSON schema object")
        schema = spec.get("schema", {})  # OpenAI: no schema means any JSON value
    else:
        raise _bad(f"'response_format.type' must be 'text', 'json_object' or 'json_schema', not {kind!r}")
    try:
        text = json.dumps(schema)  # not sorted: the answer's properties come in the schema's order
    except RecursionError as e:  # nested deeper than Python's stack: a 400, not the Router's 500
        raise _bad("invalid JSON schema: nested too deeply", param) from e
    except (ValueError, TypeError) as e:
        raise _bad(f"invalid JSON schema: {e}", param) from e
    return _schema_grammar(text, param)


@functools.lru_cache(maxsize=256)
def _schema_grammar(schema: str, param: str) -> str:
    """A schema's grammar, checked; kept, since clients and batch jobs send one schema many times and
    the Router's process is a busy one."""
    try:
        grammar = _llguidance().LLMatcher.grammar_from_json_schema(schema, defaults=_COMPACT)
    except (ValueError, TypeError) as e:
        raise _bad(f"invalid JSON schema: {e}", param) from e
    return _checked(grammar, "JSON schema", param)


def _checked(grammar: str, what: str, param: str) -> str:
    """`grammar`, if llguidance accepts it; else a 400 naming `param`."""
    error = _llguidance().LLMatcher.validate_grammar(grammar)
    if error:
        raise _bad(f"invalid {what}: {error}", param)
    return grammar


def grammar_for_structured(spec) -> str | None:
    """The grammar for vLLM's `structured_outputs` extension (None: absent): exactly one of `choice`
    (one of these strings, verbatim: a label without JSON quotes), `regex`, `json` (a schema) or
    `grammar` (Lark, llguidance's dialect). A 400 naming `structured_outputs` otherwise."""
    if spec is None:
        return None
    kinds = ("choice", "regex", "json", "grammar")
    given = [k for k in kinds if isinstance(spec, dict) and spec.get(k) is not None]
    if not isinstance(spec, dict) or len(given) != 1 or set(spec) - set(kinds):
        raise _bad("'structured_outputs' must be an object with exactly one of 'choice', 'regex', 'json', "
                   "'grammar'", "structured_outputs")
    kind, value = given[0], spec[given[0]]
    if kind == "json":
        if not isinstance(value, dict):
            raise _bad("'structured_outputs.json' must be a JSON schema object", "structured_outputs")
        return grammar_for({"type": "json_schema", "json_schema": {"schema": value}}, "structured_outputs")
    if kind == "choice":
        if (not isinstance(value, list) or not value or len(value) > MAX_CHOICE_STRINGS
                or not all(isinstance(c, str) and c for c in value)):
            raise _bad(f"'structured_outputs.choice' must be a list of 1 to {MAX_CHOICE_STRINGS} non-empty strings",
                       "structured_outputs")
        value = "|".join(re.escape(c) for c in value)
        kind = "regex"
    if not isinstance(value, str) or not value:
        raise _bad(f"'structured_outputs.{kind}' must be a non-empty string", "structured_outputs")
    if kind == "grammar":
        return lark_grammar(value, kind, "structured_outputs")
    return _checked(_llguidance().LLMatcher.grammar_from_regex(value), kind, "structured_outputs")


def lark_grammar(lark: str, what: str, param: str) -> str:
    """A grammar from Lark text (llguidance's dialect): a client's (`structured_outputs.grammar`) or one
    the server writes (forced tool calls); a 400 naming `param` if llguidance refuses it."""
    try:
        grammar = _llguidance().LLMatcher.grammar_from_lark(lark)
    except (ValueError, TypeError) as e:
        raise _bad(f"invalid {what}: {e}", param) from e
    return _checked(grammar, what, param)


def _bad(message: str, param: str = "response_format") -> ClientError:
    return ClientError(message, param=param, code=f"invalid_{param}")


class Grammars:
    """The engine's side: matchers for its tokenizer, and the masks of a step's constrained rows.

    The engine gives each constrained sequence a matcher at submit (`matcher`; the choices of one
    request start from copies of one). The sampler reads a copy of the step's logits in which the
    rows of constrained sequences are masked (`masked`): disallowed tokens' logits are -inf, so every
    sampler setting (greedy, temperature, top-k/p, seeds) draws from the allowed ones, while
    log-probabilities come from the raw logits, the model's own distribution, as without a format.
    Each sampled token is then fed to its matcher (`accept`); when the grammar is complete, the
    sequence stops ("stop"). A mask needs the sequence's previous token on the host, so while
    constrained sequences run the engine does not overlap steps (engine.py).

    Compiled grammars are kept (the most recently used CACHED), each as a matcher in its start state
    that new sequences copy: a batch job or a client sending one schema with every request compiles it
    once. `compile` may run on any thread (the LLM replica runs it off its event loop)."""

    CACHED = 64

    def __init__(self, tokenizer, vocab: int):
        self.hf_tokenizer, self.vocab = tokenizer, vocab
        self.live = 0  # the engine's sequences with a matcher (while any, steps do not overlap)
        self._tokenizer = None  # llguidance's view of the vocabulary, built at the first grammar
        self._compiled: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()
        self._executor = None  # llguidance's thread pool for the masks of several rows

    def compile(self, grammar: str):
        """The start-state matcher of `grammar` (compiled once); a 400 if this vocabulary cannot
        generate it."""
        with self._lock:
            m = self._compiled.get(grammar)
            if m is not None:
                self._compiled.move_to_end(grammar)
                return m
            if self._tokenizer is None:
                _llguidance()
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab)
            tokenizer = self._tokenizer
        m = _llguidance().LLMatcher(tokenizer, grammar, log_level=0)  # drops the GIL while it compiles
        if m.is_error():
            raise _bad(f"the response format cannot be generated: {m.get_error()}")
        with self._lock:
            self._compiled[grammar] = m
            while len(self._compiled) > self.CACHED:
                self._compiled.popitem(last=False)
        return m

    def matcher(self, grammar: str):
        """A matcher of its own for a new sequence, in `grammar`'s start state."""
        return self.compile(grammar).deep_copy()

    def masked(self, logits: torch.Tensor, matchers: list) -> torch.Tensor:
        """The logits to sample from: a copy whose rows with a matcher keep only the tokens it allows
        (the others -inf), or `logits` itself when no row has one. The raw logits stay as they were:
        log-probabilities are the model's own, as for every other sampling setting."""
        idx = [i for i, m in enumerate(matchers) if m is not None]
        if not idx:
            return logits
        words, pinned = (self.vocab + 31) // 32, logits.device.type == "cuda"
        # pinned (PyTorch's caching host allocator keeps each buffer until its copy is done): a copy from
        # pageable memory would wait for the step's queued forward before the sampler could be queued
        bits = torch.empty((len(idx), words), dtype=torch.int32, pin_memory=pinned)
        if len(idx) == 1:  # the matcher writes its allowed-token bits into the row
            matchers[idx[0]].unsafe_compute_mask_ptr(bits.data_ptr(), 4 * words)
        else:  # several rows: on llguidance's threads, without the GIL
            if self._executor is None:
                self._executor = _llguidance().LLExecutor(min(8, os.cpu_count() or 1))
            self._executor.unsafe_compute_mask_ptr([(matchers[i], row) for row, i in enumerate(idx)],
                                                   bits.data_ptr(), 4 * words, len(idx))
        bits = bits.to(logits.device, non_blocking=True)
        shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
        allowed = ((bits.unsqueeze(-1) >> shifts) & 1).reshape(len(idx), words * 32)[:, :logits.shape[1]]
        rows = torch.tensor(idx, pin_memory=pinned).to(logits.device, non_blocking=True)
        out = logits.clone()
        out[rows] = logits[rows].masked_fill(allowed == 0, float("-inf"))
        return out

    @staticmethod
    def accept(matcher, token: int) -> bool:
        """Feed a sampled token to its matcher; True when the grammar is complete (the sequence stops)."""
        if not matcher.consume_token(token):
            raise Grammars.refusal(matcher, token)
        return matcher.is_stopped()

    @staticmethod
    def refusal(matcher, token: int) -> RuntimeError:
        """The error of a sequence whose token its grammar does not allow, e.g. an end of sequence before
        the answer is complete (a matcher in an error state, such as past llguidance's resource limits,
        allows only that): an error, never an answer cut short that looks complete."""
        why = matcher.get_error() if matcher.is_error() else "the answer is not complete"
        return RuntimeError(f"structured output: token {token} was not allowed: {why}")
