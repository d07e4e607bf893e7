"""A chat answer built from a request's engine chunks, whole (`Answer`) or streamed (`StreamedAnswer`):
one OpenAI choice per chunk `index` (the request's `n`), and the usage over all of them.

This module is where an answer takes its OpenAI shape: it calls the log-probability entries
(logprobs.py), the tool-call parsing (tools.py) and the JSON shapes (schemas.py). `ChatService`
(chat.py) only runs the request: media, the backend, retries, the stream's lifetime. The server and
batch jobs (app/batch/workers.py) both build their answers here, so a batch row equals the server's.
"""

from __future__ import annotations

from . import fastjson
from .logprobs import TokenText
from .schemas import ChatRequest, choice, completion_response, stream_chunk, usage
from .tools import ToolCallStream, split_tool_calls, tool_calls_finish

DONE = "[DONE]"  # the stream's last event


def sse(events: list) -> str:
    """Events as server-sent `data:` lines, in one string (one write)."""
    return "".join(f"data: {e if e == DONE else fastjson.dumps(e)}\n\n" for e in events)


class Answer:
    def __init__(self, choices: int, token_text: TokenText | None = None, token_ids_as_text: bool = False,
                 cached_tokens: bool = False):
        """`token_text`: makes the entries of requests that asked for log-probabilities (None: the
        request did not ask, and its choices carry `"logprobs": null`); `token_ids_as_text`: their
        tokens written `token_id:<id>` (vLLM's `return_tokens_as_token_ids`); `cached_tokens`: the usage
        says how many prompt tokens the prefix cache served (`enable_prompt_tokens_details`)."""
        self.token_text, self.as_ids, self.cached_tokens = token_text, token_ids_as_text, cached_tokens
        self.texts: list[list[str]] = [[] for _ in range(choices)]
        self.logprobs: list[list[dict]] = [[] for _ in range(choices)]
        self.last: list[dict | None] = [None] * choices  # each choice's chunk with its finish reason

    def add(self, chunk: dict) -> None:
        i = chunk.get("index", 0)
        self.texts[i].append(chunk["text"])
        if self.token_text is not None and chunk.get("logprobs"):
            self.logprobs[i] += self.token_text.content(chunk["token_ids"], chunk["logprobs"], self.as_ids)
        if chunk["finish_reason"]:
            self.finish(chunk)

    def finish(self, chunk: dict) -> None:
        """A choice's last chunk (a stream keeps only these)."""
        self.last[chunk.get("index", 0)] = chunk

    @property
    def done(self) -> bool:
        return all(c is not None for c in self.last)

    def tokens(self) -> tuple[int, int]:
        """(prompt tokens, completion tokens of every finished choice): the prompt counts once, as it is
        computed once."""
        ended = [c for c in self.last if c is not None]
        return (ended[0]["prompt_tokens"] if ended else 0), sum(c["completion_tokens"] for c in ended)

    def usage(self, gen: dict) -> dict:
        prompt, completion = self.tokens()
        first = self.last[0]
        return usage(prompt, completion, gen["image_tokens"], gen["video_tokens"], first["vision_embeddings"],
                     first.get("cached_tokens", 0) if self.cached_tokens else None)

    def response(self, req: ChatRequest, model: str, gen: dict) -> dict:
        lps = self.logprobs if self.token_text is not None else [None] * len(self.texts)
        choices = []
        for i, (text, last, lp) in enumerate(zip(self.texts, self.last, lps)):
            # `echo`: the answer starts with the last message's text (vLLM's extension)
            text, finish, calls = (req.echo or "") + "".join(text), last["finish_reason"], None
            if req.tools is not None:  # the answer's tool-call blocks become tool_calls (app/api/tools.py)
                text, calls = split_tool_calls(text, req.tools.names)
                finish = tool_calls_finish(finish, calls)
            choices.append(choice(i, text, finish, lp, calls, req.role))
        return completion_response(req, model, choices, self.usage(gen))


class StreamedAnswer:
    """A chat answer as stream events (`chat.completion.chunk` objects, then DONE): `opening()` (each
    choice's role, and vLLM's `echo`), then `events(chunk)` per engine chunk: its text (or, with tools,
    its tool-call deltas), its log-probabilities, each choice's finish, and after the last choice the
    usage and DONE. Events that are ready together come as one list, so the caller writes them at once
    (each write is one HTTP chunk and a fixed cost in the proxy and the Router: benchmarks/RESULTS.md).
    /v1/completions and /v1/responses read these objects and write their own shapes."""

    def __init__(self, req: ChatRequest, model: str, gen: dict, token_text: TokenText, cached_tokens: bool = False):
        self.req, self.model, self.gen, self.token_text = req, model, gen, token_text
        # only each choice's last chunk: the finishes and the usage
        self.whole = Answer(req.params.n, cached_tokens=cached_tokens)
        # per choice, the text's tool-call blocks become tool_calls deltas (app/api/tools.py)
        self.calls = None if req.tools is None else [ToolCallStream(req.tools.names) for _ in range(req.params.n)]
        self.generated, self.prompt_tokens = 0, len(gen["input_ids"])  # continuous usage: streamed so far
        self.finished = False  # [DONE] went out

    def _event(self, delta: dict, finish: str | None = None, **kw) -> dict:
        return stream_chunk(self.req, self.model, delta, finish, **kw)

    def opening(self) -> list:
        req, out = self.req, []
        for i in range(req.params.n):
            out.append(self._event({"role": req.role, "content": ""}, index=i))
            if req.echo:
                out.append(self._event({"content": req.echo}, index=i))
        return out

    def events(self, chunk: dict) -> list:
        req, i = self.req, chunk.get("index", 0)
        logprobs = None
        if req.params.logprobs is not None:  # chunks from replicas that predate log-probabilities carry none
            # a chunk whose tokens made no text yet (part of a character) still sends their logprobs
            entries = chunk.get("logprobs")
            logprobs = self.token_text.content(chunk["token_ids"], entries, req.token_ids_as_text) if entries else []
        finish = chunk["finish_reason"]
        if self.calls is None:
            deltas = [{"content": chunk["text"]}] if chunk["text"] else []
        else:
            deltas = self.calls[i].feed(chunk["text"]) + (self.calls[i].finish() if finish else [])
            finish = finish and tool_calls_finish(finish, self.calls[i].calls)
        if logprobs and not deltas:
            deltas = [{"content": ""}]
        self.generated += len(chunk.get("token_ids") or ())
        running = None
        if req.continuous_usage:
            running = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.generated,
                       "total_tokens": self.prompt_tokens + self.generated}
        out = [self._event(delta, logprobs=None if k else logprobs, index=i, usage_=running)
               for k, delta in enumerate(deltas)]  # the chunk's logprobs go with its first delta
        if finish:
            self.whole.finish(chunk)
            out.append(self._event({}, finish, index=i))
            if self.whole.done:
                if req.include_usage:
                    out.append(stream_chunk(req, self.model, {}, usage_=self.whole.usage(self.gen), choices=False))
                out.append(DONE)
                self.finished = True
        return out

    @property
    def done(self) -> bool:
        """Every choice finished."""
        return self.whole.done

    def tokens(self) -> tuple[int, int]:
        return self.whole.tokens()
