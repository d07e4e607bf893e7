"""Builders shared by tests: media made in the test, and the whole CPU encode path."""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from app.api.prompt import MediaSlot, PromptBuilder
from app.llm.engine import GenerationRequest, VisionInput
from app.llm.sampling import SamplingParams
from app.media.preprocess import frame_timestamps, preprocess_image, preprocess_video
from app.media.synthetic import image_bytes, mp4_bytes  # noqa: F401  (re-exported for tests)
from app.vision.graphs import VisionItem


def png_bytes(h: int = 64, w: int = 96, seed: int = 0, fmt: str = "PNG") -> bytes:
    return image_bytes(h, w, seed, fmt)


# ---------------------------------------------------------------- LLM requests (tiny model)
def make_request(world, kinds, data_seed=0, words=0, **params):
    rng = np.random.default_rng(data_seed)
    spec, items, slots, content = world["spec"], [], [], []
    for k in kinds:
        if k == "image":
            p = preprocess_image((rng.random((64, 96, 3)) * 255).astype(np.uint8), spec, 1024, 1 << 20)
            slots.append(MediaSlot("image", p.grid))
        else:
            p = preprocess_video((rng.random((4, 64, 64, 3)) * 255).astype(np.uint8), spec, 1024, 1 << 20)
            slots.append(MediaSlot("video", p.grid, frame_timestamps([0, 1, 2, 3], 2.0, 2)))
        items.append(p)
        content += [{"type": k}, {"type": "text", "text": f"item {len(items)}"}]
    if words:
        content.append({"type": "text", "text": " more" * words})
    prompt = PromptBuilder(world["tok"]).build([{"role": "user", "content": content or "Tell me a story"}], slots)
    outs = world["mgr"].encode([VisionItem(torch.from_numpy(p.pixel_values), p.grid) for p in items])
    # the content key, as the router computes it: equal pixels, equal key (prefix caching relies on it)
    vision = [VisionInput(p.grid, o.main, o.deepstack, hashlib.sha1(p.pixel_values.tobytes()).hexdigest())
              for p, o in zip(items, outs)]
    return GenerationRequest(prompt.input_ids, prompt.mm_token_type_ids, vision,
                             SamplingParams(**{"max_tokens": 10, "temperature": 0, **params})), items, prompt


def _pixels(prompt, items) -> dict:
    """transformers' pixel arguments for the request's media."""
    kw = {}
    imgs = [p for p, s in zip(items, prompt_kinds(prompt, items)) if s == "image"]
    vids = [p for p, s in zip(items, prompt_kinds(prompt, items)) if s == "video"]
    if imgs:
        kw.update(pixel_values=torch.from_numpy(np.concatenate([p.pixel_values for p in imgs])),
                  image_grid_thw=torch.tensor([p.grid for p in imgs]))
    if vids:
        kw.update(pixel_values_videos=torch.from_numpy(np.concatenate([p.pixel_values for p in vids])),
                  video_grid_thw=torch.tensor([p.grid for p in vids]))
    return kw


def reference_generate(world, prompt, items, max_new=10):
    ids = torch.tensor([prompt.input_ids])
    out = world["ref"].generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                mm_token_type_ids=torch.tensor([prompt.mm_token_type_ids]), max_new_tokens=max_new,
                                do_sample=False, **_pixels(prompt, items))
    return out[0, ids.shape[1]:].tolist()


def reference_logits(world, prompt, items, output: list[int]) -> torch.Tensor:
    """transformers' logits [len(output), vocab] at each output token's position, teacher-forced on
    `output` after the prompt (the distribution each output token was drawn from)."""
    ids = torch.tensor([prompt.input_ids + output[:-1]])
    types = torch.tensor([prompt.mm_token_type_ids + [0] * (len(output) - 1)])
    with torch.no_grad():
        logits = world["ref"](input_ids=ids, mm_token_type_ids=types, **_pixels(prompt, items)).logits[0]
    return logits[len(prompt.input_ids) - 1:]


def prompt_kinds(prompt, items):
    return [("image" if p.grid[0] == 1 else "video") for p in items]


def collect(seq, timeout: float = 120):
    """A submitted sequence's chunks read to its end -> (its tokens, the chunks)."""
    chunks = []
    while True:
        c = seq.next_chunk(timeout=timeout)
        chunks.append(c)
        if c.finish_reason:
            return [t for ch in chunks for t in ch.token_ids], chunks


def ours(world, req):
    chunks = list(world["engine"].generate(req))
    return [t for c in chunks for t in c.token_ids], chunks


def attention_calls(fn) -> tuple[int, int]:
    """(SDPA calls, of which cuDNN's) while `fn()` runs, from profiled op names. The profiler sees
    the calling thread only: run the work on it."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    ops = prof.key_averages()
    return (sum(e.count for e in ops if e.key == "aten::scaled_dot_product_attention"),
            sum(e.count for e in ops if "cudnn_attention" in e.key and "backward" not in e.key))


def skip_unless_cudnn_is_the_default(heads: int, head_dim: int, dtype=torch.bfloat16, masked: bool = False) -> None:
    """Tests that check we keep cuDNN's attention out of eager forwards mean something only where
    PyTorch would pick it by default for such a call: skip where it would not."""
    import pytest
    import torch.nn.functional as F

    q, k, v = (torch.randn(2, heads, 64, head_dim, device="cuda", dtype=dtype) for _ in range(3))
    mask = torch.ones(2, 1, 64, 64, dtype=torch.bool, device="cuda").tril() if masked else None
    if not attention_calls(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))[1]:
        pytest.skip("PyTorch does not pick cuDNN's attention by default here")


# ---------------------------------------------------------------- the in-process pipeline
def local_chat(cfg, checkpoint, backend=None):
    """ChatService over an in-process MediaPipeline: with the default backend (LocalBackend: each
    request alone, no batching, no cache) the reference that served answers must equal."""
    from transformers import AutoTokenizer

    from app.api.chat import ChatService
    from app.llm.engine import Engine
    from app.media.pipeline import MediaPipeline
    from app.media.spec import patch_spec_for
    from app.serving.local_backend import LocalBackend
    from app.vision.service import EncoderService

    if backend is None:
        backend = LocalBackend(EncoderService(cfg, str(checkpoint)), Engine(str(checkpoint)))
    return ChatService(cfg, AutoTokenizer.from_pretrained(checkpoint),
                       MediaPipeline(cfg.media, patch_spec_for(checkpoint)), backend)


def world_chat(world, encoder=None, tokenizer=None, on_unknown=None, **cfg):
    """ChatService over the `world` fixture's engine, tokenizer and patch spec, in this process (an
    encoder of the tiny checkpoint unless one is given); `cfg` overrides AppConfig's fields."""
    from app.api.chat import ChatService
    from app.config import AppConfig
    from app.media.pipeline import MediaPipeline
    from app.serving.local_backend import LocalBackend
    from app.vision.service import EncoderService

    checkpoint = world["tok"].name_or_path
    config = AppConfig(model=str(checkpoint), **cfg)
    encoder = encoder or EncoderService(config, str(checkpoint))
    return ChatService(config, tokenizer or world["tok"], MediaPipeline(config.media, world["spec"]),
                       LocalBackend(encoder, world["engine"]), on_unknown=on_unknown, checkpoint=checkpoint)


def sse_data(writes: list[str]) -> list:
    """The `data:` payloads of server-sent event writes, parsed (`[DONE]` kept as the string)."""
    import json

    out = []
    for w in writes:
        for block in w.split("\n\n"):
            if block.startswith("data: "):
                data = block[len("data: "):]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


def run_endpoint(service, body: dict, parse_stream):
    """A service's answer to `body` (completions, responses: `prepare`, then `complete` or
    `open_stream`), a stream's writes through `parse_stream`; or the ClientError it raised."""
    import asyncio

    from app.errors import ClientError

    async def go():
        req = await service.prepare(body)
        if req.stream:
            return parse_stream([w async for w in await service.open_stream(req)])
        return await service.complete(req)

    try:
        return asyncio.run(go())
    except ClientError as e:
        return e
