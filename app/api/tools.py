"""OpenAI tool calling (`tools`, `tool_choice`, `parallel_tool_calls`) in the Hermes format that
Qwen3-VL and MiniCPM-V 4.5 are trained on (Qwen2.5-VL's published chat template lists no tools).

- The chat template lists the tools in the system turn and renders earlier calls and results.
- The model writes `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`; `ToolCallStream`
  cuts these blocks out of the streamed text, each naming a known tool becoming one of OpenAI's
  `tool_calls` (anything else stays content). A whole answer goes through the same parser
  (`split_tool_calls`), so streamed and whole answers carry the same calls and content.
- `tool_choice: "required"` or a named function forces calls with a grammar (llguidance's Lark, each
  tool's parameters as a JSON schema), so even a weak model answers with a valid call. `"auto"` leaves
  the model free; `"none"` does not show the tools.
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from dataclasses import dataclass

from ..errors import ClientError
from ..llm.grammar import _bad, lark_grammar

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128  # as OpenAI
MAX_DEPTH = 100  # nesting of a tool definition (dict and list levels)
# close tags inside one block's argument strings before the next one ends it: each costs a parse of
# the block so far on the Router's thread
MAX_CLOSE_TAGS_IN_STRINGS = 16
MAX_CACHED_SCHEMA_CHARS = 64 << 10  # forced-call grammars kept only for tool lists this small
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True)
class ToolSpec:
    """A request's tools, as the chat template takes them, and how calls may be made."""

    tools: list[dict]  # OpenAI's {"type": "function", "function": {...}}
    choice: str  # "auto" | "required" | the name of the one function to call
    parallel: bool = True

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t["function"]["name"] for t in self.tools)

    @property
    def forced(self) -> bool:
        return self.choice != "auto"


def parse_tools(body: dict) -> ToolSpec | None:
    """The request's ToolSpec; None when it has no tools or `tool_choice` is "none"; a 400 naming the
    field for anything malformed. The legacy `functions` / `function_call` are refused (use `tools`)."""
    for legacy in ("functions", "function_call"):
        if body.get(legacy) not in (None, [], "none"):  # their off values are accepted
            raise ClientError(f"'{legacy}' is not supported by this server: send 'tools' and 'tool_choice'",
                              param=legacy, code="unsupported_parameter")
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    parallel = True if parallel is None else parallel
    if not isinstance(parallel, bool):
        raise _bad("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if tools is not None and not isinstance(tools, list):
        raise _bad("'tools' must be a list of function tools", "tools")
    tools = [_tool(t, i) for i, t in enumerate(tools or [])]
    if len(tools) > MAX_TOOLS:
        raise _bad(f"at most {MAX_TOOLS} tools per request", "tools")
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise _bad("tool names must be unique", "tools")
    if choice is None or choice == "none":
        return ToolSpec(tools, "auto", parallel) if tools and choice is None else None
    if choice in ("auto", "required"):
        name = choice
    elif (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
          and isinstance(choice["function"].get("name"), str)):
        name = choice["function"]["name"]
        if name not in names:
            raise _bad(f"'tool_choice' names {name!r}, which is not among the request's tools", "tool_choice")
    else:
        raise _bad("'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                   "\"function\": {\"name\": ...}}", "tool_choice")
    if not tools:
        if name == "auto":
            return None
        raise _bad("'tool_choice' requires 'tools'", "tool_choice")
    return ToolSpec(tools, name, parallel)


def _tool(t, i: int) -> dict:
    p = f"tools[{i}]"
    if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
        raise _bad(f"{p} must be {{\"type\": \"function\", \"function\": {{...}}}}", "tools")
    fn = t["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise _bad(f"{p}.function.name must be 1-64 letters, digits, '_' or '-'", "tools")
    if not isinstance(fn.get("description", ""), str):
        raise _bad(f"{p}.function.description must be a string", "tools")
    params = fn.get("parameters", {})
    kind = params.get("type", "object") if isinstance(params, dict) else None
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        raise _bad(f"{p}.function.parameters must be a JSON schema of an object", "tools")
    _check_text(fn, f"{p}.function", MAX_DEPTH)
    return {"type": "function", "function": fn}


def _check_text(value, param: str, depth: int) -> None:
    """Every string and key of a tool definition is shown to the model, so it must be what message text
    may be (valid Unicode, no vision markers: app/api/schemas.py); and nesting is bounded, as the
    template's JSON encoder recurses."""
    from .text_checks import _message_text

    if depth < 0:
        raise _bad(f"{param} is nested deeper than {MAX_DEPTH} levels", "tools")
    if isinstance(value, str):
        _message_text(value, param)
    elif isinstance(value, dict):
        for k, v in value.items():
            _message_text(k, param)
            _check_text(v, f"{param}.{k}", depth - 1)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_text(v, f"{param}[{i}]", depth - 1)


def tool_grammar(spec: ToolSpec, tag_tokens: bool = False) -> str | None:
    """For a forced choice, the llguidance grammar of its answers: one call of the named function, or
    with "required" one call of any tool (one or more, each on its own line, when parallel calls are
    allowed). Arguments are a JSON object valid for each tool's `parameters` schema, written compactly.
    None for "auto".

    `tag_tokens`: the vocabulary has `<tool_call>` and `</tool_call>` as tokens of their own (Qwen's
    real tokenizers), which the grammar must then name as tokens: llguidance treats added tokens as
    special, so the tags as text would force the model to spell them in pieces it was never trained
    to write."""
    if not spec.forced:
        return None
    chosen = [(t["function"]["name"], t["function"].get("parameters") or {})
              for t in spec.tools if spec.choice in ("required", t["function"]["name"])]
    key = json.dumps(chosen)  # in the given order: the grammar keeps the properties' order
    many = spec.parallel and spec.choice == "required"
    if len(key) > MAX_CACHED_SCHEMA_CHARS:  # kept only while small: a client could send huge ones
        return _forced_grammar.__wrapped__(key, many, tag_tokens)
    return _forced_grammar(key, many, tag_tokens)


@functools.lru_cache(maxsize=256)
def _forced_grammar(chosen_json: str, many: bool, tag_tokens: bool) -> str:
    """Kept per (name, parameters) list: agents send the same tools with every turn, and checking a
    grammar costs the Router's busy thread milliseconds."""
    open_, close = (OPEN, CLOSE) if tag_tokens else (json.dumps(OPEN), json.dumps(CLOSE))
    rules = []
    for i, (name, params) in enumerate(json.loads(chosen_json)):
        schema = {**params, "type": "object"}
        schema.setdefault("x-guidance", {"whitespace_flexible": False})
        head = json.dumps(f'\n{{"name": "{name}", "arguments": ')
        rules += [f"call_{i}: {open_} {head} args_{i} {json.dumps(chr(125) + chr(10))} {close}",
                  f"args_{i}: %json {json.dumps(schema)}"]
    calls = " | ".join(f"call_{i}" for i in range(len(rules) // 2))
    start = 'start: call ("\\n" call)*' if many else "start: call"
    return lark_grammar("\n".join([start, f"call: {calls}", *rules]), "tool parameters", "tools")


_NOT_JSON = object()


def _call(body: str, names: frozenset[str]):
    """One OpenAI tool call from a block's text; None when it is not a call of a known tool with object
    arguments; _NOT_JSON when the text ends inside a JSON string (a close tag inside an argument string
    cut it short: the block goes on)."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return _NOT_JSON if e.msg.startswith("Unterminated string") else None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", {})
    if args is None or args == "":  # a call without arguments
        args = {}
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = args if isinstance(json.loads(args), dict) else None
        except ValueError:
            args = None
    elif isinstance(args, dict):
        args = json.dumps(args, ensure_ascii=False)
    else:
        args = None
    if args is None:
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": args}}


def _held(text: str) -> int:
    """How many characters at the end of `text` could begin OPEN."""
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-k:]):
            return k
    return 0


class ToolCallStream:
    """One choice's text in, OpenAI deltas out: `{"content": ...}` and `{"tool_calls": [call]}`.

    Text that may begin a call block is held until it does or cannot; a block is held until it closes
    with its JSON whole (a close tag inside an argument string does not end it). Whitespace around the
    content is dropped (the model writes newlines between its text and its calls), so the content
    deltas joined are the whole answer's content. Each piece of text is searched once (a long block
    streamed in many chunks costs what its length does)."""

    def __init__(self, names: frozenset[str]):
        self.names = names
        self.calls = 0
        self._buf = ""
        self._in_call = False
        self._seen = 0  # how far into the held block the close tag has been looked for
        self._cuts = 0  # close tags found inside the held block's JSON strings
        self._space = ""  # whitespace after the content so far: sent only if more content follows
        self._started = False  # some content went out

    def _content(self, text: str) -> list[dict]:
        if not self._started:
            text = text.lstrip()
        if not text:
            return []
        stripped = text.rstrip()
        if not stripped:
            self._space += text
            return []
        out, self._space = self._space + stripped, text[len(stripped):]
        self._started = True
        return [{"content": out}]

    def _block(self, body: str, closed: bool, call=_NOT_JSON) -> list[dict]:
        """`call`: the block's parse, when the caller has it."""
        if call is _NOT_JSON:
            call = _call(body.strip(), self.names)
        if call is None or call is _NOT_JSON:
            return self._content(OPEN + body + (CLOSE if closed else ""))
        self.calls += 1
        return [{"tool_calls": [{"index": self.calls - 1, **call}]}]

    def feed(self, text: str) -> list[dict]:
        self._buf += text
        out: list[dict] = []
        while True:
            if self._in_call:
                end = self._buf.find(CLOSE, self._seen)
                if end < 0:
                    self._seen = max(self._seen, len(self._buf) - len(CLOSE) + 1)
                    return out
                body = self._buf[:end]
                call = _call(body.strip(), self.names)
                if call is _NOT_JSON and self._cuts < MAX_CLOSE_TAGS_IN_STRINGS:  # cut inside a string: go on
                    self._seen, self._cuts = end + 1, self._cuts + 1
                    continue
                self._buf, self._in_call, self._seen, self._cuts = self._buf[end + len(CLOSE):], False, 0, 0
                out += self._block(body, closed=True, call=call)
            else:
                start = self._buf.find(OPEN)
                if start < 0:
                    keep = _held(self._buf)
                    text, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                    return out + self._content(text)
                out += self._content(self._buf[:start])
                self._buf, self._in_call, self._seen = self._buf[start + len(OPEN):], True, 0

    def finish(self) -> list[dict]:
        """What is still held, at the end of the answer: an unclosed block is a call if its JSON is whole
        (or, when the block was closed but its JSON never became whole, the text as the model wrote it)."""
        buf, self._buf = self._buf, ""
        if self._in_call:
            self._in_call = False
            return self._block(buf, closed=False)
        return self._content(buf)


def tool_calls_finish(finish: str, calls) -> str:
    """OpenAI's finish reason for an answer that called tools: "tool_calls" where the model stopped
    by itself ("length" and errors stay)."""
    return "tool_calls" if calls and finish == "stop" else finish


def has_tag_tokens(tokenizer) -> bool:
    """Whether `<tool_call>` and `</tool_call>` are tokens of their own in this vocabulary (Qwen's)."""
    added = getattr(tokenizer, "get_added_vocab", dict)()
    return OPEN in added and CLOSE in added


def split_tool_calls(text: str, names: frozenset[str]) -> tuple[str | None, list[dict]]:
    """A whole answer's (content, tool calls), as its stream would give them; content None when empty."""
    stream = ToolCallStream(names)
    deltas = stream.feed(text) + stream.finish()
    content = "".join(d.get("content", "") for d in deltas)
    calls = [{k: v for k, v in c.items() if k != "index"} for d in deltas for c in d.get("tool_calls", [])]
    return content or None, calls
