"""Chat prompt -> token ids with every media placeholder expanded to its exact token count.

The checkpoint's own chat template renders the messages; each image placeholder becomes
`<|vision_start|>` + n x `<|image_pad|>` + `<|vision_end|>`. A video becomes, in Qwen3-VL's format, per
temporal group `<t seconds>` + `<|vision_start|>` + n x `<|video_pad|>` + `<|vision_end|>`; in
Qwen2.5-VL's (no timestamps: its positions carry time instead) one `<|vision_start|>` + all groups'
`<|video_pad|>` + `<|vision_end|>`. Text between placeholders is tokenized piecewise, so the counts are
exact by construction.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ClientError

IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
_PLACEHOLDER = re.compile(
    r"(?:<\|vision_start\|>)?(<\|image_pad\|>|<\|video_pad\|>)(?:<\|vision_end\|>)?"
)
TEXT, IMAGE_TYPE, VIDEO_TYPE = 0, 1, 2


@dataclass
class MediaSlot:
    """What the prompt needs to know about one media item."""

    kind: str  # "image" | "video"
    grid: tuple[int, int, int]  # (t, h, w) in patches
    timestamps: list[float] = field(default_factory=list)  # video: seconds per temporal group
    merge: int = 2
    # MiniCPM-V: tower items of this media item (thumbnail + slices, or frames) and the slice grid
    parts: int = 1
    slice_grid: tuple[int, int] | None = None

    @property
    def tokens_per_group(self) -> int:
        _, h, w = self.grid
        return h * w // (self.merge * self.merge)

    @property
    def num_tokens(self) -> int:
        return self.grid[0] * self.tokens_per_group


@dataclass
class Prompt:
    input_ids: list[int]
    mm_token_type_ids: list[int]  # 0 text, 1 image, 2 video (as transformers' processor)

    def count(self, kind: int) -> int:
        return sum(1 for t in self.mm_token_type_ids if t == kind)


# model_type -> whether videos are expanded with per-group timestamps
_VIDEO_TIMESTAMPS = {"qwen3_vl": True, "qwen2_5_vl": False}


def video_timestamps_for(checkpoint: str | Path | None) -> bool:
    """Whether the checkpoint's family writes `<t seconds>` before each temporal group (Qwen3-VL) or
    not (Qwen2.5-VL). Unknown or unreadable: Qwen3-VL's format."""
    try:
        model_type = json.loads((Path(checkpoint) / "config.json").read_text()).get("model_type", "")
    except (OSError, TypeError, ValueError):
        return True
    return _VIDEO_TIMESTAMPS.get(model_type, True)


VISION_MARKERS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)


def has_vision_marker(text: str) -> bool:
    """Whether `text` holds a token the tokenizer would read as a vision marker."""
    return "<|" in text and any(marker in text for marker in VISION_MARKERS)


def _forged() -> ClientError:
    return ClientError("message text forms a reserved vision marker (text parts are joined as they are); send "
                       "media as image_url or video_url parts", param="messages", code="reserved_token")


def _plain(text: str) -> str:
    """Rendered text between media placeholders, which must hold no vision marker. Each text part was
    checked on its own (schemas.py), but the template joins adjacent parts: "<|image" + "_pad|>" would
    be a placeholder no media item backs (a 500 before), "<|vision_" + "start|>" a stray marker."""
    if has_vision_marker(text):
        raise _forged()
    return text


@dataclass(frozen=True)
class TemplateOptions:
    """How a request asks the chat template to render it (vLLM's extensions): the generation prompt
    (`add_generation_prompt`), or the last message left open for the model to continue
    (`continue_final_message`), the template variables of `chat_template_kwargs` (those it reads) and
    `documents`."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    kwargs: dict = field(default_factory=dict)
    documents: list | None = None


DEFAULT_TEMPLATE_OPTIONS = TemplateOptions()


def template_variables(tokenizer) -> frozenset[str] | None:
    """The variables the tokenizer's chat template(s) read, from their Jinja source (None when there is
    no template or it cannot be parsed: then every chat_template_kwargs name is passed on)."""
    import jinja2
    from jinja2 import meta

    templates = tokenizer.chat_template
    if isinstance(templates, dict):
        templates = list(templates.values())
    elif isinstance(templates, str):
        templates = [templates]
    else:
        return None
    names: set[str] = set()
    try:
        env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
        for t in templates:
            names |= meta.find_undeclared_variables(env.parse(t))
    except Exception:  # noqa: BLE001 - an unparsable template: its variables are unknown, not none
        return None
    return frozenset(names)


def render_chat(tokenizer, messages: list[dict], tools: list[dict] | None,
                options: TemplateOptions = DEFAULT_TEMPLATE_OPTIONS) -> str:
    """The chat template's text for `messages`, with the generation prompt (or the last message left
    open: `options`); `tools` listed, which a template that does not mention tools would silently drop
    (a 400 instead), and so `documents`."""
    import jinja2

    kw = dict(options.kwargs)
    if tools:
        if "tools" not in str(tokenizer.chat_template or ""):  # a str, or a dict of named templates
            raise ClientError("this model's chat template does not render tools", param="tools",
                              code="unsupported_parameter")
        kw["tools"] = tools
    if options.documents is not None:
        if "documents" not in str(tokenizer.chat_template or ""):
            raise ClientError("this model's chat template does not render documents", param="documents",
                              code="unsupported_parameter")
        kw["documents"] = options.documents
    if options.continue_final_message:
        kw["continue_final_message"] = True
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=options.add_generation_prompt, **kw)
    except jinja2.TemplateError as e:  # the template's own check (raise_exception) of what the request gave it
        raise ClientError(f"the chat template refused the request: {e}", param="messages",
                          code="invalid_chat_template_input") from None
    except ValueError as e:
        if not options.continue_final_message:
            raise
        # transformers: no text in the last message to continue from
        raise ClientError(f"continue_final_message: {e}", param="continue_final_message",
                          code="invalid_continue_final_message") from None


class PromptBuilder:
    def __init__(self, tokenizer, video_timestamps: bool | None = None):
        """`video_timestamps` None: from the family of the checkpoint the tokenizer was loaded from."""
        self.tok = tokenizer
        self.video_timestamps = (video_timestamps_for(getattr(tokenizer, "name_or_path", None))
                                 if video_timestamps is None else video_timestamps)
        ids = tokenizer.convert_tokens_to_ids
        self.vs, self.ve = ids(VISION_START), ids(VISION_END)
        self.image_id, self.video_id = ids(IMAGE_PAD), ids(VIDEO_PAD)

    def render(self, messages: list[dict], tools: list[dict] | None = None,
               options: TemplateOptions = DEFAULT_TEMPLATE_OPTIONS) -> str:
        return render_chat(self.tok, messages, tools, options)

    def _text(self, s: str) -> list[int]:
        return self.tok.encode(s, add_special_tokens=False) if s else []

    def build(self, messages: list[dict], slots: list[MediaSlot], tools: list[dict] | None = None,
              options: TemplateOptions = DEFAULT_TEMPLATE_OPTIONS) -> Prompt:
        """`messages` content parts use types text/image/video; `slots` are in the same order; `tools`
        (OpenAI's function tools) are listed by the chat template; `options`: how it renders them."""
        text = self.render(messages, tools, options)
        ids: list[int] = []
        types: list[int] = []

        def add(tokens: list[int], kind: int = TEXT) -> None:
            ids.extend(tokens)
            types.extend([kind] * len(tokens))

        pos, queue = 0, list(slots)
        for m in _PLACEHOLDER.finditer(text):
            add(self._text(_plain(text[pos:m.start()])))
            pos = m.end()
            if not queue:  # the template joins a message's text parts as they are: two made a marker
                raise _forged()
            slot = queue.pop(0)
            want = IMAGE_PAD if slot.kind == "image" else VIDEO_PAD
            if m.group(1) != want:  # text the template joined (a tool's description, say) forged a marker
                raise _forged()
            if slot.kind == "image":
                add([self.vs]); add([self.image_id] * slot.num_tokens, IMAGE_TYPE); add([self.ve])  # noqa: E702
            elif not self.video_timestamps:
                add([self.vs]); add([self.video_id] * slot.num_tokens, VIDEO_TYPE); add([self.ve])  # noqa: E702
            else:
                for ts in slot.timestamps:
                    add(self._text(f"<{ts:.1f} seconds>"))
                    add([self.vs]); add([self.video_id] * slot.tokens_per_group, VIDEO_TYPE); add([self.ve])  # noqa: E702
        add(self._text(_plain(text[pos:])))
        if queue:
            raise ValueError("the chat template dropped media placeholders; it must render image and video parts")
        return Prompt(ids, types)
