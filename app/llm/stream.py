"""The consumer side of a request: token ids from the engine become text chunks.

The engine thread only hands over token ids, once per step; text is made by whoever reads the chunks
(the replica's event loop, or a caller's thread), so detokenization and stop strings never lengthen a step:
- `Detokenizer` decodes a small window of recent ids, not the whole output, and holds back an
  incomplete UTF-8 sequence;
- stop strings are searched in the new text only, text that may begin one held back until known not
  to; stop strings and `stop_token_ids` follow vLLM's rules (`include_stop_str_in_output`, `min_tokens`);
- `OutputStream.push` takes all that arrived since the last read, so a reader that falls behind gets
  one chunk for many tokens. A stop ends the request here and the reader cancels it (the engine frees
  its blocks next step, dropping tokens made meanwhile); end-of-sequence ends it in the engine.
"""

from __future__ import annotations

import queue
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from .sampling import SamplingParams


@dataclass
class Chunk:
    """New text since the last chunk; on the last one, the finish reason and counts."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    vision_embeddings: int = 0
    # with `SamplingParams.logprobs`: one (log-probability, top ids, top log-probabilities) per token id
    logprobs: list | None = None
    index: int = 0  # which of the request's choices (OpenAI's `n`) this chunk belongs to
    cached_tokens: int = 0  # on the last one: prompt tokens taken from the prefix cache (OpenAI's usage)
    # on a choice's first chunk: where its time to first token went, in seconds (`queue_s` waiting for the
    # engine, `prefill_s` from its first step to its first token; under `fused`, `encode_s` its media, and
    # `encode_wait_s`, `encode_run_s`, `encode_wake_s` that time's parts: app/vision/batcher.py's submit)
    timing: dict | None = None

    def as_dict(self) -> dict:
        """The chunk as the dict a backend streams (what `dataclasses.asdict` gives, without its deep
        copy of every list: a chunk's lists are its own slices, never changed after it is made). Without
        the copy the `fused` backend's event loop spent 0.88-0.91 ms of CPU a request against 0.95-0.99 on
        the CPU machine (tiny model, 16 tokens, alternated three times)."""
        return dict(self.__dict__)


@dataclass
class TokenDelta:
    """What the engine hands over for one request after a step."""

    token_ids: list[int]
    finish_reason: str | None = None  # "stop" (EOS), "length", "cancelled"
    error: BaseException | None = None
    logprobs: list | None = None  # one entry per token id, for requests that asked (model_runner.StepResult)
    cached_tokens: int | None = None  # on a request's first delta: its prompt tokens from the prefix cache
    timing: dict | None = None  # on a request's first delta: Chunk.timing's engine part


class Cancelled(Exception):
    """Raised to a reader of a request that was cancelled."""


def backend_decode(tokenizer) -> Callable[[list[int], bool], str] | None:
    """The `tokenizers` library's own decode where it gives exactly what `tokenizer.decode` does, else
    None. A request's detokenizer decodes twice per chunk; transformers' wrapper around the Rust decode
    (argument conversion, clean-up checks) took about 2 of every 3.5 us a call on the CPU machine, and a
    16-token answer's chunks 0.050 against 0.094 ms of CPU with the Rust decode called directly. Used
    only for a fast tokenizer whose `decode` and `_decode` are transformers' own, with no clean-up of
    spaces, and once it decoded a sample (every special token, the first and last ids, both settings)
    as `decode` does; decided once per tokenizer."""
    try:
        return _BACKEND_DECODE[tokenizer]
    except (KeyError, TypeError):  # not decided yet, or a tokenizer that cannot be a weak key
        pass
    fn = None
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase

        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and not tokenizer.clean_up_tokenization_spaces \
                and type(tokenizer).decode is PreTrainedTokenizerBase.decode \
                and type(tokenizer)._decode is PreTrainedTokenizerFast._decode:
            n = len(tokenizer)
            sample = sorted(set(tokenizer.all_special_ids) | {0, 1, 2, n // 2, n - 2, n - 1})
            samples = [sample, sample[::-1], [i for i in sample if i not in tokenizer.all_special_ids], []]
            if all(backend.decode(ids, skip_special_tokens=skip) == tokenizer.decode(ids, skip_special_tokens=skip)
                   for ids in samples for skip in (True, False)):
                fn = backend.decode
    except Exception:  # noqa: BLE001 - any doubt: transformers' decode
        fn = None
    try:
        _BACKEND_DECODE[tokenizer] = fn
    except TypeError:
        pass
    return fn


_BACKEND_DECODE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> its decode, or None


class Detokenizer:
    """Incremental detokenization: the concatenated deltas equal `decode(all ids)`."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tok, self.skip = tokenizer, skip_special_tokens
        self.fast = backend_decode(tokenizer)
        self.ids: list[int] = []
        self.prefix_offset = 0  # ids before this are settled text
        self.read_offset = 0  # ids before this have been turned into text

    def _decode(self, ids: list[int]) -> str:
        if self.fast is not None:
            return self.fast(ids, skip_special_tokens=self.skip)
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def feed(self, ids: list[int], final: bool = False) -> str:
        out = []
        for t in ids:
            self.ids.append(t)
            out.append(self._advance(force=False))
        if final:
            out.append(self._advance(force=True))
        return "".join(out)

    def feed_all(self, ids: list[int], final: bool = False) -> str:
        """Like `feed`, one window decode for all of `ids` (a reader that fell behind catches up in one go)."""
        self.ids.extend(ids)
        return self._advance(force=final)

    def _advance(self, force: bool) -> str:
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and (force or not full.endswith("\ufffd")):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix):]
        return ""


class StopChecker:
    """Finds stop strings in the text as it grows and holds back text that may begin one."""

    def __init__(self, stop: list[str]):
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) - 1 for s in self.stop), default=0)

    def find(self, text: str, start: int = 0) -> int | None:
        """Index where the earliest stop string starts at or after `start`, or None."""
        hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def match(self, text: str, boundary: int) -> tuple[int, str] | None:
        """(index, stop string) of the earliest stop string in `text` that ends after `boundary` (the
        text before it was searched already, or may not stop the answer); at one index, the first
        listed. None if there is none."""
        best = None
        for s in self.stop:
            i = text.find(s, max(0, boundary - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        return best

    def safe_length(self, text: str) -> int:
        """How much of `text` can be emitted without risking a stop string's prefix."""
        n = len(text)
        for k in range(min(self.hold, n), 0, -1):
            if any(s.startswith(text[n - k:]) for s in self.stop):
                return n - k
        return n


class OutputStream:
    """Turns a request's token deltas into chunks: text, stop strings, the final counts."""

    def __init__(self, tokenizer, params: SamplingParams, prompt_tokens: int, vision_embeddings: int):
        self.detok = Detokenizer(tokenizer, params.skip_special_tokens)
        self.stops = StopChecker(params.stop)
        self.stop_ids = frozenset(params.stop_token_ids)
        self.min_tokens, self.include_stop = params.min_tokens, params.include_stop_str_in_output
        self.prompt_tokens, self.vision_embeddings = prompt_tokens, vision_embeddings
        self.cached_tokens = 0
        self.timing: dict | None = None  # until the first chunk carries it
        self.text = ""
        self.emitted = 0
        self.ids: list[int] = []
        self.lps: list | None = [] if params.logprobs is not None else None  # beside `ids`, one per token
        self.sent_ids = 0
        self.finished = False
        self.stopped = False

    def push(self, deltas: list[TokenDelta]) -> Chunk | None:
        """Everything that arrived since the last call -> one chunk (None if it adds no text and does
        not finish). Errors in `deltas` are raised. `finished` is set once a chunk ends the request;
        `stopped` when a stop string ended it (the reader then cancels the request)."""
        finish = None
        new: list[int] = []
        new_lps: list = []
        for d in deltas:
            if d.cached_tokens is not None:
                self.cached_tokens = d.cached_tokens
            if d.timing is not None:
                self.timing = d.timing
            if d.error is not None:
                self.finished = True
                raise d.error
            new.extend(d.token_ids)
            if self.lps is not None:
                new_lps.extend(d.logprobs or [None] * len(d.token_ids))
            if d.finish_reason:
                finish = d.finish_reason
                break
        if finish == "cancelled":
            self.finished = True
            raise Cancelled("request cancelled")
        first = not self.ids and bool(new)
        if self.stops.stop or self.stop_ids:
            for i, tok in enumerate(new):  # token by token: the token that completes a stop string ends it
                last = finish is not None and i == len(new) - 1
                if tok in self.stop_ids and len(self.ids) >= self.min_tokens:  # ends before it, or with it
                    if self.include_stop:
                        self._add(tok, new_lps[i] if self.lps is not None else None, final=True)
                    else:
                        self.text += self.detok.feed([], final=True)
                    finish, self.stopped = "stop", True
                    break
                boundary = len(self.text)
                self._add(tok, new_lps[i] if self.lps is not None else None, final=last)
                hit = self.stops.match(self.text, boundary) if len(self.ids) > self.min_tokens else None
                if hit is not None:
                    cut, stop = hit
                    self.text = self.text[:cut + len(stop) if self.include_stop else cut]
                    finish, self.stopped = "stop", True
                    break
            else:
                if finish is not None and not new:
                    self.text += self.detok.feed([], final=True)
        else:  # no stop strings: one detokenizer step for everything that arrived
            self.ids.extend(new)
            if self.lps is not None:
                self.lps.extend(new_lps)
            self.text += self.detok.feed_all(new, final=finish is not None)
        upto = len(self.text) if finish else self.stops.safe_length(self.text)
        delta = self.text[self.emitted:upto]
        self.emitted = max(self.emitted, upto)
        timing, self.timing = self.timing, None  # the first chunk out carries it, once
        if finish:
            self.finished = True
            return Chunk(delta, self.ids[self.sent_ids:], finish, self.prompt_tokens, len(self.ids),
                         self.vision_embeddings, self._logprobs_since(), cached_tokens=self.cached_tokens,
                         timing=timing)
        if delta or first:  # the first token always goes out: it marks the time to first token
            chunk = Chunk(delta, self.ids[self.sent_ids:], logprobs=self._logprobs_since(), timing=timing)
            self.sent_ids = len(self.ids)
            return chunk
        self.timing = timing  # nothing went out yet
        return None

    def _add(self, tok: int, lp, final: bool) -> None:
        self.text += self.detok.feed([tok], final=final)
        self.ids.append(tok)
        if self.lps is not None:
            self.lps.append(lp)

    def _logprobs_since(self) -> list | None:
        return None if self.lps is None else self.lps[self.sent_ids:]


class ThreadReader:
    """Reads a request's chunks on a caller's thread (tests, benchmarks, in-process serving)."""

    def __init__(self, stream: OutputStream, cancel):
        self.stream, self.cancel = stream, cancel
        self.inbox: queue.SimpleQueue[TokenDelta] = queue.SimpleQueue()

    def put(self, delta: TokenDelta) -> None:
        self.inbox.put(delta)

    def next_chunk(self, timeout: float | None = None) -> Chunk:
        while True:
            deltas = [self.inbox.get(timeout=timeout)]
            while True:
                try:
                    deltas.append(self.inbox.get_nowait())
                except queue.Empty:
                    break
            chunk = self.stream.push(deltas)
            if self.stream.stopped:
                self.cancel()
            if chunk is not None:
                return chunk
