"""Text generation with Qwen3-VL's language model, fed precomputed vision embeddings.

The vision encoder runs elsewhere; this engine splices its main embeddings into the prompt's
placeholder positions, injects the deepstack features into the first decoder layers and uses
M-RoPE positions from the items' grids — the same computation as transformers' own forward.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ..errors import ClientError
from .mrope import mrope_positions
from .sampling import Sampler, SamplingParams, StopChecker


@dataclass
class VisionInput:
    """Encoder output for one media item, in prompt order."""

    grid: tuple[int, int, int]
    main: torch.Tensor  # [n, hidden]
    deepstack: list[torch.Tensor]


@dataclass
class GenerationRequest:
    input_ids: list[int]
    mm_token_type_ids: list[int]
    vision: list[VisionInput] = field(default_factory=list)
    params: SamplingParams = field(default_factory=SamplingParams)


def request_from_dict(gen: dict, encoded: list) -> GenerationRequest:
    """The router's generation dict plus the encoder's (main, deepstack) per item, in prompt order."""
    vision = [VisionInput(tuple(g), main, ds) for g, (main, ds) in zip(gen["grids"], encoded, strict=True)]
    return GenerationRequest(gen["input_ids"], gen["mm_token_type_ids"], vision, SamplingParams(**gen["params"]))


@dataclass
class Chunk:
    """One streamed step: new text, and on the last chunk the finish reason and counts."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    vision_embeddings: int = 0


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


class Engine:
    def __init__(self, path: str, device: str = "cpu", dtype: str = "auto", max_model_len: int = 32768):
        from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration

        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        model = Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=self.dtype)
        model.model.visual = None  # the encoder deployment owns the vision tower
        self.model = model.to(self.device).eval()
        self.text = model.model.language_model
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        cfg = model.config
        self.merge = cfg.vision_config.spatial_merge_size
        self.image_id, self.video_id = cfg.image_token_id, cfg.video_token_id
        eos = model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) | {self.tokenizer.eos_token_id}
        self.max_model_len = max_model_len
        self._lock = threading.Lock()  # one forward at a time on this replica

    # ------------------------------------------------------------------ prefill inputs
    def _prefill_inputs(self, req: GenerationRequest):
        ids = torch.tensor([req.input_ids], device=self.device)
        embeds = self.text.embed_tokens(ids)
        mask = (ids == self.image_id) | (ids == self.video_id)
        n_slots = int(mask.sum())
        n_rows = sum(v.main.shape[0] for v in req.vision)
        if n_slots != n_rows:
            raise ValueError(f"prompt has {n_slots} vision placeholders but the encoder produced {n_rows} embeddings")
        deepstack = None
        if req.vision:
            main = torch.cat([v.main for v in req.vision]).to(self.device, embeds.dtype)
            embeds = embeds.masked_scatter(mask[..., None], main)
            layers = len(req.vision[0].deepstack)
            deepstack = [torch.cat([v.deepstack[j] for v in req.vision]).to(self.device, embeds.dtype)
                         for j in range(layers)]
        pos, delta = mrope_positions(req.mm_token_type_ids, [v.grid for v in req.vision], self.merge)
        length = len(req.input_ids)
        position_ids = torch.cat([torch.arange(length)[None], pos]).to(self.device)[:, None, :]  # [4, 1, L]
        return embeds, position_ids, mask, deepstack, delta, n_rows

    @torch.inference_mode()
    def _forward(self, embeds, position_ids, cache, mask=None, deepstack=None) -> torch.Tensor:
        with self._lock:
            out = self.text(inputs_embeds=embeds, position_ids=position_ids, past_key_values=cache, use_cache=True,
                            visual_pos_masks=mask, deepstack_visual_embeds=deepstack)
            return self.model.lm_head(out.last_hidden_state[:, -1])[0]

    # ------------------------------------------------------------------ generation
    def generate(self, req: GenerationRequest) -> Iterator[Chunk]:
        """Yields text as it becomes safe to emit; the last chunk carries finish_reason and usage."""
        from transformers import DynamicCache

        length = len(req.input_ids)
        if length >= self.max_model_len:
            raise ClientError(f"prompt of {length} tokens exceeds max_model_len {self.max_model_len}",
                              param="messages", code="context_length_exceeded")
        max_new = min(req.params.max_tokens, self.max_model_len - length)
        embeds, position_ids, mask, deepstack, delta, n_vision = self._prefill_inputs(req)
        cache = DynamicCache(config=self.model.config.text_config)
        sampler, stops = Sampler(req.params, self.device), StopChecker(req.params.stop)
        logits = self._forward(embeds, position_ids, cache, mask, deepstack)
        out_ids: list[int] = []
        emitted, sent_ids, finish = 0, 0, None
        while True:
            token = sampler(logits)
            if token in self.eos_ids:
                finish = "stop"
            else:
                out_ids.append(token)
            text = self.tokenizer.decode(out_ids, skip_special_tokens=True)
            cut = stops.find(text) if finish is None else None
            if cut is not None:
                text, finish = text[:cut], "stop"
            if finish is None and len(out_ids) >= max_new:
                finish = "length"
            upto = len(text) if finish else stops.safe_length(text)
            delta_text = text[emitted:upto]
            emitted = max(emitted, upto)
            if finish:
                yield Chunk(delta_text, out_ids[sent_ids:], finish, length, len(out_ids), n_vision)
                return
            if delta_text:
                yield Chunk(delta_text, out_ids[sent_ids:])
                sent_ids = len(out_ids)
            pos = length + len(out_ids) - 1
            step_pos = torch.tensor([pos, pos + delta, pos + delta, pos + delta], device=self.device).view(4, 1, 1)
            step_embeds = self.text.embed_tokens(torch.tensor([[token]], device=self.device))
            logits = self._forward(step_embeds, step_pos, cache)
