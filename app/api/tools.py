"""OpenAI tool calling (`tools`, `tool_choice`, `parallel_tool_calls`) in the Hermes format that
Qwen2.5-VL, Qwen3-VL and MiniCPM-V 4.5 are trained on.

- The checkpoint's chat template lists the tools in the system turn and renders earlier calls and
  tool results (`PromptBuilder.build(..., tools=...)`).
- The model calls a tool by writing `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.
  `ToolCallStream` cuts these blocks out of the text as it streams: the text between them is the
  message's content, each block whose JSON names a known tool becomes one of OpenAI's `tool_calls`
  (anything else stays content, as the model wrote it). A whole answer goes through the same parser
  (`split_tool_calls`), so a streamed answer and a whole one carry the same calls and content.
- `tool_choice: "required"` or a named function forces calls: a grammar (llguidance's Lark, with each
  tool's parameters as a JSON schema) allows only call blocks, so even a weak model answers with a
  valid call whose arguments match the schema. `"auto"` leaves the model free; `"none"` ignores the
  tools (they are not shown to the model).
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from dataclasses import dataclass

from ..errors import ClientError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128  # as OpenAI
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


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


def _bad(message: str, param: str) -> ClientError:
    return ClientError(message, param=param, code=f"invalid_{param}")


def parse_tools(body: dict) -> ToolSpec | None:
    """The request's ToolSpec; None when it has no tools or `tool_choice` is "none"; a 400 naming the
    field for anything malformed. The legacy `functions` / `function_call` are refused (use `tools`)."""
    for legacy in ("functions", "function_call"):
        if body.get(legacy) is not None:
            raise ClientError(f"'{legacy}' is not supported by this server: send 'tools' and 'tool_choice'",
                              param=legacy, code="unsupported_parameter")
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
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
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise _bad(f"{p}.function.name must be 1-64 letters, digits, '_' or '-'", "tools")
    if not isinstance(fn.get("description", ""), str):
        raise _bad(f"{p}.function.description must be a string", "tools")
    if not isinstance(fn.get("parameters", {}), dict):
        raise _bad(f"{p}.function.parameters must be a JSON schema object", "tools")
    return {"type": "function", "function": fn}


def tool_grammar(spec: ToolSpec) -> str | None:
    """For a forced choice, the llguidance grammar of its answers: one call of the named function, or
    with "required" one call of any tool (one or more, each on its own line, when parallel calls are
    allowed). Arguments follow each tool's `parameters` schema, written compactly. None for "auto"."""
    if not spec.forced:
        return None
    return _forced_grammar(json.dumps(spec.tools, sort_keys=True), spec.choice, spec.parallel)


@functools.lru_cache(maxsize=256)
def _forced_grammar(tools_json: str, choice: str, parallel: bool) -> str:
    """Kept per tool list: agents send the same tools with every turn, and checking a grammar costs
    the Router's busy thread milliseconds."""
    from ..llm.grammar import lark_grammar

    tools = [t for t in json.loads(tools_json) if choice in ("required", t["function"]["name"])]
    rules = []
    for i, t in enumerate(tools):
        fn = t["function"]
        schema = dict(fn.get("parameters") or {"type": "object"})
        schema.setdefault("x-guidance", {"whitespace_flexible": False})
        head = json.dumps(f'{OPEN}\n{{"name": "{fn["name"]}", "arguments": ')
        rules += [f"call_{i}: {head} args_{i} {json.dumps(chr(125) + chr(10) + CLOSE)}",
                  f"args_{i}: %json {json.dumps(schema)}"]
    calls = " | ".join(f"call_{i}" for i in range(len(tools)))
    start = 'start: call ("\\n" call)*' if parallel and choice == "required" else "start: call"
    return lark_grammar("\n".join([start, f"call: {calls}", *rules]), "tools")


def _call(body: str, names: frozenset[str]) -> dict | None:
    """One OpenAI tool call from a block's text, or None when it is not a call of a known tool."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", {})
    args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
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

    Text that may begin a call block is held until it does or cannot; a block is held until it closes.
    Whitespace around the content is dropped (the model writes newlines between its text and its
    calls), so the content deltas joined are the whole answer's content."""

    def __init__(self, names: frozenset[str]):
        self.names = names
        self.calls = 0
        self._buf = ""
        self._in_call = False
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

    def _block(self, body: str, closed: bool) -> list[dict]:
        call = _call(body.strip(), self.names)
        if call is None:
            return self._content(OPEN + body + (CLOSE if closed else ""))
        self.calls += 1
        return [{"tool_calls": [{"index": self.calls - 1, **call}]}]

    def feed(self, text: str) -> list[dict]:
        self._buf += text
        out: list[dict] = []
        while True:
            if self._in_call:
                end = self._buf.find(CLOSE)
                if end < 0:
                    return out
                body, self._buf, self._in_call = self._buf[:end], self._buf[end + len(CLOSE):], False
                out += self._block(body, closed=True)
            else:
                start = self._buf.find(OPEN)
                if start < 0:
                    keep = _held(self._buf)
                    text, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                    return out + self._content(text)
                out += self._content(self._buf[:start])
                self._buf, self._in_call = self._buf[start + len(OPEN):], True

    def finish(self) -> list[dict]:
        """What is still held, at the end of the answer: an unclosed block is a call if its JSON is whole."""
        buf, self._buf = self._buf, ""
        if self._in_call:
            self._in_call = False
            return self._block(buf, closed=False)
        return self._content(buf)


def tool_calls_finish(finish: str, calls) -> str:
    """OpenAI's finish reason for an answer that called tools: "tool_calls" where the model stopped
    by itself ("length" and errors stay)."""
    return "tool_calls" if calls and finish == "stop" else finish


def split_tool_calls(text: str, names: frozenset[str]) -> tuple[str | None, list[dict]]:
    """A whole answer's (content, tool calls), as its stream would give them; content None when empty."""
    stream = ToolCallStream(names)
    deltas = stream.feed(text) + stream.finish()
    content = "".join(d.get("content", "") for d in deltas)
    calls = [{k: v for k, v in c.items() if k != "index"} for d in deltas for c in d.get("tool_calls", [])]
    return content or None, calls
