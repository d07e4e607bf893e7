"""A whole (non-streamed) answer, assembled from a request's engine chunks: one OpenAI choice per
chunk `index` (the request's `n`), and the usage over all of them.

The server (`ChatService.complete`) and batch jobs (app/batch/workers.py) both build their
chat.completion objects here, so that a batch row equals what the server answers.
"""

from __future__ import annotations

from .logprobs import TokenText
from .schemas import ChatRequest, choice, completion_response, usage
from .tools import split_tool_calls, tool_calls_finish


class Answer:
    def __init__(self, choices: int, token_text: TokenText | None = None, token_ids_as_text: bool = False):
        """`token_text`: makes the entries of requests that asked for log-probabilities (None: the
        request did not ask, and its choices carry `"logprobs": null`); `token_ids_as_text`: their
        tokens written `token_id:<id>` (vLLM's `return_tokens_as_token_ids`)."""
        self.token_text, self.as_ids = token_text, token_ids_as_text
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
        return usage(prompt, completion, gen["image_tokens"], gen["video_tokens"], self.last[0]["vision_embeddings"])

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
