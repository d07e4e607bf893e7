"""MiniCPM-V's prompt: the chat template's `(<image>./</image>)` placeholders expanded to `<unk>` runs.

As the published processor does, each image's placeholder becomes (q = the resampler's queries per
slice) `<image_id>i</image_id><image> q x <unk> </image>`, then, if sliced into cols x rows, per row
cols x `<slice> q x <unk> </slice>`, rows joined by a newline. A video (our choice: the 4.5 checkpoint
format does not describe the published temporal resampler) is rendered as an image part whose
placeholder becomes one `<image> q x <unk> </image>` per frame, no image id, no slicing. The LLM
replaces the `<unk>` embeddings (`mm_token_type_ids` 1 image, 2 video); text between placeholders is
tokenized piecewise, so the counts are exact by construction.

Client text may not contain `<unk>` or the placeholder (400 `reserved_token`, as app/api/schemas.py
refuses Qwen's vision markers): either would forge media that no item backs.
"""

from __future__ import annotations

from ..errors import ClientError
from .prompt import (
    DEFAULT_TEMPLATE_OPTIONS,
    IMAGE_TYPE,
    TEXT,
    VIDEO_TYPE,
    MediaSlot,
    Prompt,
    TemplateOptions,
    render_chat,
)

PLACEHOLDER = "(<image>./</image>)"
UNK = "<unk>"
RESERVED = (UNK, PLACEHOLDER)


def _refuse(param: str) -> ClientError:
    return ClientError(f"{param} contains a reserved vision marker ({', '.join(RESERVED)}); send media as "
                       "image_url or video_url parts", param=param, code="reserved_token")


def check_text(messages: list[dict]) -> None:
    """Every text of the (parsed) messages, free of MiniCPM-V's reserved markers."""
    for i, m in enumerate(messages):
        content = m.get("content")
        texts = ([(f"messages[{i}].content", content)] if isinstance(content, str) else
                 [(f"messages[{i}].content[{j}].text", p.get("text")) for j, p in enumerate(content or [])
                  if isinstance(p, dict) and p.get("type") == "text"])
        for param, text in texts:
            if isinstance(text, str) and any(r in text for r in RESERVED):
                raise _refuse(param)


class MiniCPMVPromptBuilder:
    def __init__(self, tokenizer, queries: int, use_image_id: bool = True):
        self.tok, self.queries, self.use_image_id = tokenizer, queries, use_image_id
        self.unk = tokenizer.convert_tokens_to_ids(UNK)

    def render(self, messages: list[dict], tools: list[dict] | None = None,
               options: TemplateOptions = DEFAULT_TEMPLATE_OPTIONS) -> str:
        as_images = [{**m, "content": [{"type": "image"} if isinstance(p, dict) and p.get("type") == "video" else p
                                       for p in m["content"]]} if isinstance(m.get("content"), list) else m
                     for m in messages]
        return render_chat(self.tok, as_images, tools, options)

    def build(self, messages: list[dict], slots: list[MediaSlot], tools: list[dict] | None = None,
              options: TemplateOptions = DEFAULT_TEMPLATE_OPTIONS) -> Prompt:
        check_text(messages)
        text = self.render(messages, tools, options)
        pieces = text.split(PLACEHOLDER)
        if len(pieces) - 1 > len(slots) or any(UNK in p for p in pieces):
            raise _refuse("messages")  # a marker made of adjacent text parts (a template joining them as is)
        if len(pieces) - 1 != len(slots):
            raise ValueError(f"the chat template rendered {len(pieces) - 1} media placeholders for {len(slots)} items")
        ids: list[int] = []
        types: list[int] = []

        def add_text(s: str) -> None:
            if s:
                tokens = self.tok.encode(s, add_special_tokens=False)
                ids.extend(tokens)
                types.extend([TEXT] * len(tokens))

        def add_run(start: str, end: str, kind: int) -> None:
            add_text(start)
            ids.extend([self.unk] * self.queries)
            types.extend([kind] * self.queries)
            add_text(end)

        image_idx = 0
        for piece, slot in zip(pieces, slots):
            add_text(piece)
            if slot.kind == "image":
                if self.use_image_id:
                    add_text(f"<image_id>{image_idx}</image_id>")
                image_idx += 1
                add_run("<image>", "</image>", IMAGE_TYPE)
                if slot.slice_grid is not None:
                    cols, rows = slot.slice_grid
                    if cols * rows != slot.parts - 1:
                        raise ValueError(f"slice grid {slot.slice_grid} does not match {slot.parts - 1} slices")
                    for r in range(rows):
                        if r:
                            add_text("\n")
                        for _ in range(cols):
                            add_run("<slice>", "</slice>", IMAGE_TYPE)
            else:
                for f in range(slot.parts):
                    if f:
                        add_text("\n")
                    add_run("<image>", "</image>", VIDEO_TYPE)
        add_text(pieces[-1])
        return Prompt(ids, types)


def prompt_builder_for(tokenizer, spec):
    """The prompt builder of the checkpoint's family: MiniCPM-V's when its PatchSpec has slicing."""
    from .prompt import PromptBuilder

    if getattr(spec, "slicing", None) is not None:
        return MiniCPMVPromptBuilder(tokenizer, spec.slicing.queries, spec.slicing.use_image_id)
    return PromptBuilder(tokenizer)
