"""The LLM engine on the other families' text sides, against transformers, token for token (fp32, CPU).

- Qwen2.5-VL: our engine (Qwen2.5 text: qkv bias, no q/k norm, M-RoPE in three contiguous sections,
  video time positions spaced by tokens_per_second x second_per_grid_ts) fed the reference tower's
  embeddings, against `Qwen2_5_VLForConditionalGeneration.generate` on the pixel path.
- MiniCPM-V 4.5: its Qwen3 (`llm.*` in the checkpoint, 1-D RoPE, q/k norm) with our vision path's
  embeddings spliced at the `<unk>` placeholders, against transformers' `Qwen3ForCausalLM` (the same
  `llm.*` tensors) fed `inputs_embeds` whose placeholder rows are the same embeddings. The Hub's remote
  code is not available; the vision path itself is tested in test_minicpmv_tower.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from app.api.minicpmv_prompt import MiniCPMVPromptBuilder
from app.api.prompt import MediaSlot, PromptBuilder
from app.llm.engine import Engine, GenerationRequest, VisionInput
from app.llm.mrope import Rope
from app.llm.sampling import SamplingParams
from app.media.preprocess import PatchSpec, preprocess_image, preprocess_video
from app.media.spec import patch_spec_for

MAX_NEW = 10


def _run(engine: Engine, req: GenerationRequest) -> list[int]:
    return [t for c in engine.generate(req) for t in c.token_ids]


# ---------------------------------------------------------------------------------------- Qwen2.5-VL
@pytest.fixture(scope="module")
def qwen25(model_cache):
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    from app.checkpoints.model_builder import ensure_embedded

    path = ensure_embedded("tiny-qwen2.5-vl", model_cache)
    ref = Qwen2_5_VLForConditionalGeneration.from_pretrained(path).eval()
    return {"path": path, "ref": ref, "engine": Engine(str(path)), "tok": AutoTokenizer.from_pretrained(path),
            "spec": patch_spec_for(path)}


def _qwen25_request(w, kinds, seconds):
    rng = np.random.default_rng(7)
    items, slots, content, secs = [], [], [], []
    for k in kinds:
        if k == "image":
            p = preprocess_image((rng.random((70, 100, 3)) * 255).astype(np.uint8), w["spec"], 1024, 1 << 20)
            secs.append(None)
        else:
            p = preprocess_video((rng.random((6, 56, 84, 3)) * 255).astype(np.uint8), w["spec"], 1024, 1 << 20)
            secs.append(seconds.pop(0))
        items.append(p)
        slots.append(MediaSlot(k, p.grid))
        content += [{"type": k}, {"type": "text", "text": f"item {len(items)}"}]
    prompt = PromptBuilder(w["tok"]).build([{"role": "user", "content": content or "Tell me a story"}], slots)
    visual = w["ref"].model.visual
    vision = []
    with torch.no_grad():
        for p, s in zip(items, secs):
            main = visual(torch.from_numpy(p.pixel_values), grid_thw=torch.tensor([p.grid])).pooler_output
            vision.append(VisionInput(p.grid, main, [], None, s))
    req = GenerationRequest(prompt.input_ids, prompt.mm_token_type_ids, vision,
                            SamplingParams(max_tokens=MAX_NEW, temperature=0))
    return req, items, secs, prompt


def _qwen25_reference(w, prompt, items, secs) -> list[int]:
    ids = torch.tensor([prompt.input_ids])
    kw = {}
    imgs = [p for p, s in zip(items, secs) if p.grid[0] == 1 and s is None]
    vids = [(p, s) for p, s in zip(items, secs) if s is not None]
    if imgs:
        kw.update(pixel_values=torch.from_numpy(np.concatenate([p.pixel_values for p in imgs])),
                  image_grid_thw=torch.tensor([p.grid for p in imgs]))
    if vids:
        kw.update(pixel_values_videos=torch.from_numpy(np.concatenate([p.pixel_values for p, _ in vids])),
                  video_grid_thw=torch.tensor([p.grid for p, _ in vids]),
                  second_per_grid_ts=torch.tensor([s for _, s in vids]))
    out = w["ref"].generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                            mm_token_type_ids=torch.tensor([prompt.mm_token_type_ids]), max_new_tokens=MAX_NEW,
                            do_sample=False, **kw)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("kinds,seconds", [([], []), (["image"], []), (["video"], [1.0]), (["video"], [0.75]),
                                           (["image", "video", "image", "video"], [2.0, 0.5])],
                         ids=["text", "image", "video", "video-fractional-time", "mixed"])
def test_qwen25_greedy_equals_transformers_generate(qwen25, kinds, seconds):
    req, items, secs, prompt = _qwen25_request(qwen25, kinds, list(seconds))
    got = _run(qwen25["engine"], req)
    want = _qwen25_reference(qwen25, prompt, items, secs)
    eos = qwen25["engine"].eos_ids
    assert got == [t for t in want if t not in eos] and len(got) > 0


def test_qwen25_video_prompt_end_alone_takes_its_own_position(qwen25):
    """A Qwen2.5-VL video's time axis runs past its tokens, so the text after it does not sit at
    index + rope_delta. When a prompt's last token runs alone (the rest from the prefix cache here),
    it must take its own position: the first token's log-probability equals the cold run's (1e-5) and
    transformers' logits. It used to take index + delta (58 against 32 here)."""
    import dataclasses


    req, items, secs, prompt = _qwen25_request(qwen25, ["video"], [10.0])
    req.params = dataclasses.replace(req.params, logprobs=0, max_tokens=2)
    for v in req.vision:
        v.key = "video-1"
    length = len(prompt.input_ids)
    eng = Engine(str(qwen25["path"]), block_size=length - 1)
    firsts = []
    for _ in range(2):
        seq = eng.submit(req)
        lps = []
        while True:
            c = seq.next_chunk(timeout=120)
            lps += [float(e[0]) for e in c.logprobs or []]
            if c.finish_reason:
                break
        firsts.append(lps[0])
    assert seq.num_cached == length - 1 and eng.step_log[-2][:2] == (1, 1)  # the last token ran alone
    assert seq.prompt_positions[0, -1] != length - 1 + seq.rope_delta  # the case this is about
    assert abs(firsts[0] - firsts[1]) <= 1e-5, firsts
    eng.shutdown()


def test_qwen25_positions_past_the_rotary_tables_are_refused_or_cut(qwen25):
    """Positions past the rotary tables were an IndexError in the step (a device-side assert, which ends
    the replica, on a GPU). A prompt whose video positions do not fit is a 400; one that fits has its
    output cut where its positions would leave the table ("length")."""
    from app.errors import ClientError

    eng = Engine(str(qwen25["path"]), max_model_len=256)
    rows = eng.model.cos_table.shape[0]
    with pytest.raises(ClientError) as e:
        eng.submit(_qwen25_request(qwen25, ["video"], [300.0])[0])
    assert (e.value.status, e.value.code) == (400, "context_length_exceeded")
    req = _qwen25_request(qwen25, ["video"], [240.0])[0]
    req.params.max_tokens, req.params.ignore_eos = 200, True
    seq = eng.submit(req)
    assert int(seq.prompt_positions.max()) < rows < len(req.input_ids) + 200 + seq.rope_delta
    chunks = []
    while not chunks or not chunks[-1].finish_reason:
        chunks.append(seq.next_chunk(timeout=120))
    assert chunks[-1].finish_reason == "length"
    assert sum(len(c.token_ids) for c in chunks) == rows - len(req.input_ids) - seq.rope_delta
    eng.shutdown()


def test_qwen25_positions_equal_get_rope_index(qwen25):
    _, items, secs, prompt = _qwen25_request(qwen25, ["video", "image", "video"], [0.75, 1.5])
    imgs = [p.grid for p, s in zip(items, secs) if s is None]
    vids = [p.grid for p, s in zip(items, secs) if s is not None]
    ref, ref_delta = qwen25["ref"].model.get_rope_index(
        torch.tensor([prompt.input_ids]), torch.tensor([prompt.mm_token_type_ids]), torch.tensor(imgs),
        torch.tensor(vids), second_per_grid_ts=torch.tensor([s for s in secs if s is not None]))
    rope = Rope.from_config(json.loads((qwen25["path"] / "config.json").read_text()))
    pos, delta = rope.positions(prompt.mm_token_type_ids, [p.grid for p in items], secs)
    assert rope.kind == "qwen2_5_vl" and rope.tokens_per_second == 2
    assert torch.equal(ref[:, 0], pos) and int(ref_delta) == delta
    assert len(set(pos[0, prompt.mm_token_type_ids.index(2):].tolist())) > 1  # time really advances


def test_qwen25_text_spec_reads_the_saved_names(qwen25):
    """transformers 5.x saves Qwen2.5-VL's decoder as `model.layers.*` and holds it in memory as
    `model.language_model.layers.*`: the engine loads both (the checkpoint above, the module here)."""
    spec = qwen25["engine"].spec
    assert spec.qkv_bias and not spec.qk_norm and spec.rope_axes == (0,) * 2 + (1,) * 3 + (2,) * 3
    mem = Engine.from_model(qwen25["ref"], qwen25["tok"])
    try:
        for a, b in zip(mem.model.parameters(), qwen25["engine"].model.parameters()):
            assert torch.equal(a, b)
    finally:
        mem.shutdown()


# ---------------------------------------------------------------------------------------- MiniCPM-V 4.5
@pytest.fixture(scope="module")
def minicpmv(model_cache):
    from transformers import AutoTokenizer

    from app.checkpoints.minicpmv_builder import _text_model
    from app.checkpoints.model_builder import ensure_embedded
    from app.vision.graphs import GraphManager, GraphSettings
    from app.vision.loading import build_tower, read_tensors

    path = ensure_embedded("tiny-minicpm-v-4.5", model_cache)
    config = json.loads((path / "config.json").read_text())
    ref = _text_model(config, seed=123)  # a Qwen3ForCausalLM of the checkpoint's shape; weights replaced below
    missing, unexpected = ref.load_state_dict(read_tensors(path, ("llm.",)), strict=True)
    ref.eval()
    mgr = GraphManager(build_tower(path, torch.float32), GraphSettings([256, 512], use_cuda_graphs=False))
    return {"path": path, "ref": ref, "engine": Engine(str(path)), "tok": AutoTokenizer.from_pretrained(path),
            "spec": patch_spec_for(path), "mgr": mgr, "config": config}


def _minicpmv_request(w, kinds):
    from dataclasses import replace

    from app.media.slicing import slice_image
    from app.vision.graphs import VisionItem

    rng = np.random.default_rng(3)
    spec = w["spec"]
    parts, slots, content = [], [], []
    for k in kinds:
        if k == "image":  # 250 x 160: sliced (scale_resolution 112)
            sliced = slice_image((rng.random((160, 250, 3)) * 255).astype(np.uint8), spec.slicing)
            images, grid = sliced.images, sliced.grid
            assert grid is not None
        else:
            whole = replace(spec.slicing, slice_mode=False)
            images = [slice_image((rng.random((60, 90, 3)) * 255).astype(np.uint8), whole).thumbnail for _ in range(3)]
            grid = None
        parts += [_rows(im, spec) for im in images]
        slots.append(MediaSlot(k, (1, 1, 1), parts=len(images), slice_grid=grid))
        content += [{"type": k}, {"type": "text", "text": f"item {len(slots)}"}]
    builder = MiniCPMVPromptBuilder(w["tok"], spec.slicing.queries, spec.slicing.use_image_id)
    prompt = builder.build([{"role": "user", "content": content or "Tell me a story"}], slots)
    outs = w["mgr"].encode([VisionItem(torch.from_numpy(p.pixel_values), p.grid) for p in parts])
    vision = [VisionInput(p.grid, o.main, [], None) for p, o in zip(parts, outs)]
    req = GenerationRequest(prompt.input_ids, prompt.mm_token_type_ids, vision,
                            SamplingParams(max_tokens=MAX_NEW, temperature=0))
    return req, prompt, torch.cat([o.main for o in outs]) if outs else None


def _rows(image: np.ndarray, spec: PatchSpec):
    from app.media.preprocess import patchify

    return patchify(image[None], spec, normalize=True)


@pytest.mark.parametrize("kinds", [[], ["image"], ["video"], ["image", "video", "image"]],
                         ids=["text", "sliced-image", "video-frames", "mixed"])
def test_minicpmv_greedy_equals_qwen3_with_spliced_embeddings(minicpmv, kinds):
    req, prompt, rows = _minicpmv_request(minicpmv, kinds)
    got = _run(minicpmv["engine"], req)
    ids = torch.tensor([prompt.input_ids])
    with torch.no_grad():
        embeds = minicpmv["ref"].get_input_embeddings()(ids)
        if rows is not None:
            mask = ids[0] == minicpmv["tok"].convert_tokens_to_ids("<unk>")
            assert int(mask.sum()) == rows.shape[0]
            embeds[0, mask] = rows
        out = minicpmv["ref"].generate(inputs_embeds=embeds, attention_mask=torch.ones_like(ids),
                                       max_new_tokens=MAX_NEW, do_sample=False)
    want = out[0].tolist()
    eos = minicpmv["engine"].eos_ids
    assert got == [t for t in want if t not in eos] and len(got) > 0


def test_minicpmv_prompt_expands_slices_as_published(minicpmv):
    """Thumbnail `<image_id>0</image_id><image>q x <unk></image>`, then the slices row by row (rows
    joined by a newline); the next image gets id 1; video frames are `<image>` runs without ids."""
    tok, q = minicpmv["tok"], minicpmv["spec"].slicing.queries
    builder = MiniCPMVPromptBuilder(tok, q)
    slots = [MediaSlot("image", (1, 1, 1), parts=7, slice_grid=(3, 2)), MediaSlot("video", (1, 1, 1), parts=2),
             MediaSlot("image", (1, 1, 1), parts=1)]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "video"}, {"type": "image"},
                                             {"type": "text", "text": "hi"}]}]
    prompt = builder.build(messages, slots)
    unk = "<unk>" * q
    thumb = f"<image>{unk}</image>"
    row = f"<slice>{unk}</slice>" * 3
    want = ("<|im_start|>user\n" + f"<image_id>0</image_id>{thumb}{row}\n{row}" + "\n" + f"{thumb}\n{thumb}"
            + "\n" + f"<image_id>1</image_id>{thumb}" + "\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert prompt.input_ids == tok.encode(want, add_special_tokens=False)
    assert prompt.count(1) == 8 * q and prompt.count(2) == 2 * q


@pytest.mark.parametrize("text", ["<unk>", "see (<image>./</image>) here"])
def test_minicpmv_reserved_markers_in_text_are_a_400(minicpmv, text):
    """`<unk>` is the token the LLM replaces and the placeholder is expanded: client text holding either
    forged media (the engine or the builder failed with a 500). Other MiniCPM-V tags stay plain text."""
    from app.errors import ClientError

    builder = MiniCPMVPromptBuilder(minicpmv["tok"], minicpmv["spec"].slicing.queries)
    image = MediaSlot("image", (1, 1, 1), parts=1)
    for content, slots, param in ((text, [], "messages[0].content"),
                                  ([{"type": "image"}, {"type": "text", "text": text}], [image],
                                   "messages[0].content[1].text")):
        with pytest.raises(ClientError) as e:
            builder.build([{"role": "user", "content": content}], slots)
        assert e.value.status == 400 and e.value.code == "reserved_token" and e.value.param == param
    prompt = builder.build([{"role": "user", "content": "an <image> tag and <slice>"}], [])
    assert prompt.count(1) == prompt.count(2) == 0


def test_a_qwen25_video_at_another_pace_never_shares_prefix_kv():
    """Qwen2.5-VL's video time positions depend on seconds_per_group: the same frames (same content
    key) sampled at another pace are rotated differently, so their KV blocks must not be shared."""
    import numpy as np
    import torch

    from app.llm.sequence import VisionInput, _block_keys

    def keys(spg):
        v = VisionInput((2, 4, 4), torch.zeros(8, 4), [], key="frames", seconds_per_group=spg)
        return _block_keys([7] * 8, np.ones(8, dtype=bool), [v], block_size=4)

    assert keys(0.5) == keys(0.5) and keys(None) == keys(None)
    assert keys(0.5) != keys(1.0) and keys(0.5) != keys(None)
