"""Generation on the tiny model against transformers: our text forward's logits, `generate` token for
token, M-RoPE positions, the prompt, incremental text and stop strings."""

import numpy as np
import pytest
import torch

from app.llm.engine import VisionInput
from app.llm.mrope import mrope_positions
from app.llm.stream import Detokenizer, OutputStream, StopChecker, TokenDelta
from helpers import make_request, ours, reference_generate


@pytest.mark.parametrize("kinds", [[], ["image"], ["video"], ["image", "video", "image"]])
def test_greedy_equals_transformers_generate(world, kinds):
    req, items, prompt = make_request(world, kinds)
    got, chunks = ours(world, req)
    want = reference_generate(world, prompt, items)
    eos = world["engine"].eos_ids
    assert got == [t for t in want if t not in eos]
    assert chunks[-1].finish_reason == ("stop" if want[-1] in eos else "length")
    assert chunks[-1].completion_tokens == len(got) and chunks[-1].prompt_tokens == len(prompt.input_ids)
    assert chunks[-1].vision_embeddings == prompt.count(1) + prompt.count(2)
    assert "".join(c.text for c in chunks) == world["tok"].decode(got, skip_special_tokens=True)


def test_mrope_positions_equal_get_rope_index(world):
    _, items, prompt = make_request(world, ["video", "image", "video"])
    grids = [p.grid for p in items]
    imgs = [g for g in grids if g[0] == 1]
    vids = [g for g in grids if g[0] > 1]
    ref, ref_delta = world["ref"].model.get_rope_index(torch.tensor([prompt.input_ids]),
                                                       torch.tensor([prompt.mm_token_type_ids]),
                                                       torch.tensor(imgs), torch.tensor(vids))
    pos, delta = mrope_positions(prompt.mm_token_type_ids, grids, 2)
    assert torch.equal(ref[:, 0], pos) and int(ref_delta) == delta


def test_a_sequence_counts_image_and_video_placeholders_against_the_embeddings():
    """Sequence(): the prompt's image and video placeholders together must equal the embeddings' rows
    (here 4 + 8 against 12, then against 11: refused), and its positions are mrope_positions' as int32."""
    from app.llm.mrope import Rope
    from app.llm.sampling import SamplingParams
    from app.llm.sequence import GenerationRequest, Sequence, VisionInput

    img, vid = 900, 901
    ids = [5, 6, img, img, img, img, 7, vid, vid, vid, vid, 9, vid, vid, vid, vid, 8]  # a video's two groups
    types = [0, 0, 1, 1, 1, 1, 0, 2, 2, 2, 2, 0, 2, 2, 2, 2, 0]
    grids = [(1, 4, 4), (2, 4, 4)]
    kw = dict(rope=Rope("qwen3_vl"), vision_ids=(img, vid), max_model_len=64, block_size=4,
              device=torch.device("cpu"), dtype=torch.float32)

    def request(rows):
        vision = [VisionInput(g, torch.zeros(n, 8), [], key=f"k{i}") for i, (g, n) in enumerate(zip(grids, rows))]
        return GenerationRequest(ids, types, vision, SamplingParams(max_tokens=4))

    seq = Sequence(request([4, 8]), **kw)
    want, delta = mrope_positions(types, grids, 2)
    assert seq.prompt_positions.dtype == np.int32 and np.array_equal(seq.prompt_positions, want.numpy())
    assert seq.rope_delta == delta and seq.block_keys[0] == (5, 6, ("k0", 0), ("k0", 1))
    with pytest.raises(ValueError, match="12 vision placeholders but the encoder produced 11"):
        Sequence(request([4, 7]), **kw)


def test_prompt_placeholders_match_the_grids(world):
    _, items, prompt = make_request(world, ["image", "video"])
    img, vid = items
    assert prompt.count(1) == img.num_tokens and prompt.count(2) == vid.num_tokens
    text = world["tok"].decode(prompt.input_ids)
    assert "<0.2 seconds><|vision_start|><|video_pad|>" in text and "<1.2 seconds><|vision_start|>" in text
    assert text.count("<|vision_start|>") == 1 + vid.grid[0]


def test_seeded_sampling_is_reproducible(world):
    req, _, _ = make_request(world, ["image"], temperature=1.0, top_p=0.9, seed=1234)
    a, _ = ours(world, req)
    b, _ = ours(world, req)
    assert a == b
    runs = {tuple(ours(world, make_request(world, ["image"], temperature=1.5, seed=s)[0])[0]) for s in range(4)}
    assert len(runs) > 1


def test_mismatched_embeddings_are_refused_at_submit(world):
    req, _, _ = make_request(world, ["image"])
    v = req.vision[0]
    req.vision[0] = VisionInput(v.grid, v.main[:-1], [d[:-1] for d in v.deepstack])
    with pytest.raises(ValueError, match="placeholders"):
        world["engine"].submit(req)


def test_stop_strings_are_not_emitted(world):
    req, _, _ = make_request(world, [], max_tokens=12)
    full = "".join(c.text for c in ours(world, req)[1])
    assert len(full) > 4
    stop = full[2:5]
    req.params.stop = [stop]
    chunks = ours(world, req)[1]
    text = "".join(c.text for c in chunks)
    assert text == full[: full.find(stop)] and chunks[-1].finish_reason == "stop"


def test_stop_checker_holds_back_prefixes():
    s = StopChecker(["</end>"])
    assert s.safe_length("abc</e") == 3 and s.safe_length("abc") == 3 and s.find("ab</end>c") == 2
    assert s.find("</end> and </end>", start=3) == 11


def test_incremental_detokenization_equals_decoding_everything(world):
    """Random ids (incomplete UTF-8 included) and real text, fed in uneven pieces: the concatenated
    deltas are exactly `decode(all ids)`."""
    tok = world["tok"]
    rng = np.random.default_rng(0)
    cases = [rng.integers(0, len(tok), 60).tolist() for _ in range(20)]
    cases.append(tok.encode("Naïve café: ünïcödé — 猫 🐈 and emoji 👍🏽 end"))
    for ids in cases:
        d = Detokenizer(tok)
        out, i = [], 0
        while i < len(ids):
            n = int(rng.integers(1, 4))
            out.append(d.feed(ids[i:i + n], final=i + n >= len(ids)))
            i += n
        assert "".join(out) == tok.decode(ids, skip_special_tokens=True)


def test_the_backend_decode_is_used_only_where_it_equals_transformers_decode(world, tiny_checkpoint, tmp_path):
    """backend_decode: for the tokenizers the engine loads (app/checkpoints/tokenizer_loader.py: the
    Qwen presets' and MiniCPM-V's) and AutoTokenizer's, the Rust decode gives exactly `tokenizer.decode`'s
    text, special tokens kept or skipped, random ids and real text; a tokenizer that cleans up spaces, or
    whose class decodes its own way, keeps transformers' decode."""
    from transformers import AutoTokenizer

    from app.checkpoints.model_builder import build_checkpoint
    from app.checkpoints.tokenizer_loader import load_tokenizer
    from app.llm.stream import backend_decode

    minicpmv = build_checkpoint(tmp_path / "minicpmv", "tiny-minicpm-v-4.5", with_weights=False)
    rng = np.random.default_rng(1)
    for tok in (world["tok"], load_tokenizer(tiny_checkpoint), load_tokenizer(minicpmv)):
        fast = backend_decode(tok)
        assert fast is not None and backend_decode(tok) is fast  # decided once per tokenizer
        cases = [rng.integers(0, len(tok), int(rng.integers(0, 40))).tolist() for _ in range(50)]
        cases += [tok.encode("Naïve café 猫 🐈 <|im_start|>user") + tok.all_special_ids]
        for ids in cases:
            for skip in (True, False):
                assert fast(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip)
    tok = world["tok"]
    cleaning = AutoTokenizer.from_pretrained(tok.name_or_path, clean_up_tokenization_spaces=True)
    assert cleaning.clean_up_tokenization_spaces and backend_decode(cleaning) is None

    class OwnDecode(type(tok)):
        def decode(self, *a, **kw):
            return "mine"

    own = AutoTokenizer.from_pretrained(tok.name_or_path)
    own.__class__ = OwnDecode
    assert backend_decode(own) is None and Detokenizer(own)._decode([5]) == "mine"


def test_output_stream_cuts_at_a_stop_string_and_counts_the_tokens_that_made_it(world):
    tok = world["tok"]
    from app.llm.sampling import SamplingParams

    ids = tok.encode("one two three four five six")
    text = tok.decode(ids)
    stop = " four"
    want_tokens = next(n for n in range(1, len(ids) + 1) if stop in tok.decode(ids[:n]))
    for pieces in ([ids], [[t] for t in ids], [ids[:3], ids[3:]]):  # coalesced, one by one, split
        s = OutputStream(tok, SamplingParams(stop=[stop]), prompt_tokens=5, vision_embeddings=0)
        chunks = [c for p in pieces if not s.finished and (c := s.push([TokenDelta(p)])) is not None]
        assert "".join(c.text for c in chunks) == text[:text.find(stop)]
        assert chunks[-1].finish_reason == "stop" and s.stopped
        assert chunks[-1].completion_tokens == want_tokens


def test_our_text_forward_equals_transformers_logits(world):
    """Prefill logits of a prompt with an image and a video: our forward (fused qkv, paged cache,
    deepstack, M-RoPE) against transformers' model fed the same embeddings, fp32."""
    eng = world["engine"]
    req, items, prompt = make_request(world, ["image", "video"], words=5)
    ids = torch.tensor([prompt.input_ids])
    kw = {}
    img, vid = items
    kw.update(pixel_values=torch.from_numpy(img.pixel_values), image_grid_thw=torch.tensor([img.grid]),
              pixel_values_videos=torch.from_numpy(vid.pixel_values), video_grid_thw=torch.tensor([vid.grid]))
    with torch.no_grad():
        ref = world["ref"](input_ids=ids, mm_token_type_ids=torch.tensor([prompt.mm_token_type_ids]), **kw).logits[0]
    from app.llm.attention import AttentionMetadata
    from app.llm.model import VisionBatch
    from app.llm.sequence import Sequence

    seq = Sequence(req, rope=eng.rope, vision_ids=eng.vision_ids, max_model_len=4096, block_size=4,
                   device=torch.device("cpu"), dtype=torch.float32)
    n = len(seq)
    s = eng.spec
    kv = torch.zeros(s.layers, 2, 4 * (n // 4 + 1), s.kv_heads, s.head_dim)
    table = list(reversed(range(n // 4 + 1)))  # blocks out of order: the table, not adjacency, places them
    slots = torch.tensor([table[i // 4] * 4 + i % 4 for i in range(n)])
    meta = AttentionMetadata(*[None] * 6, block_q=8, block_size=4, host_query_start=np.array([0, n]),
                             host_seq_lens=np.array([n]), host_block_tables=[table])
    offs, r0, r1 = seq.vision_rows(0, n)
    vision = VisionBatch.from_rows(torch.from_numpy(offs), seq.vision_main[r0:r1], seq.vision_deepstack[:, r0:r1], n)
    with torch.no_grad():
        h = eng.model(torch.tensor(seq.token_ids), torch.from_numpy(seq.positions(0, n)), slots, kv, meta, vision)
        logits = eng.model.logits(h)
    assert (logits - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_the_in_process_pipeline_equals_transformers_generate_on_the_processors_rows(world, tiny_checkpoint):
    """Router media pipeline (uint8 rows) -> encoder service (normalises on its device) -> engine, for an
    image and a video, against transformers' generate fed the processor's float rows of the same media."""
    import asyncio
    import base64
    from types import SimpleNamespace

    from app.api.chat import ChatService
    from app.config import AppConfig
    from app.media.decode import decode_image, decode_video
    from app.media.pipeline import MediaPipeline
    from app.media.preprocess import preprocess_image, preprocess_video
    from app.serving.local_backend import LocalBackend
    from app.vision.service import EncoderService
    from helpers import mp4_bytes, png_bytes

    cfg = AppConfig(model=str(tiny_checkpoint))
    m, spec = cfg.media, world["spec"]
    chat = ChatService(cfg, world["tok"], MediaPipeline(m, spec),
                       LocalBackend(EncoderService(cfg, str(tiny_checkpoint)), world["engine"]))
    png, mp4 = png_bytes(80, 112, seed=3), mp4_bytes(8, seed=4)

    def url(data, mime):
        return f"data:{mime};base64," + base64.b64encode(data).decode()

    body = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url(png, "image/png")}},
        {"type": "video_url", "video_url": {"url": url(mp4, "video/mp4")}},
        {"type": "text", "text": "Compare them"}]}], "max_tokens": 8, "temperature": 0}
    req, gen, payload = asyncio.run(chat.prepare(body))
    assert all(px.dtype.name == "uint8" for px, _, _ in payload)
    got = asyncio.run(chat.complete(req, gen, payload))

    img = preprocess_image(decode_image(png, param="p", max_pixels=m.max_input_pixels), spec, m.image_min_pixels,
                           m.image_max_pixels)
    video = decode_video(mp4, param="p", fps=m.video_fps, min_frames=m.video_min_frames, max_frames=m.video_max_frames,
                         max_duration_s=m.max_video_duration_s, max_pixels=m.max_input_pixels)
    vid = preprocess_video(video.frames, spec, m.video_min_pixels, m.video_max_pixels)
    assert img.grid[0] == 1 < vid.grid[0]  # how reference_generate tells images from videos
    prompt = SimpleNamespace(input_ids=gen["input_ids"], mm_token_type_ids=gen["mm_token_type_ids"])
    want = [t for t in reference_generate(world, prompt, [img, vid], max_new=8) if t not in world["engine"].eos_ids]
    assert got["usage"]["completion_tokens"] == len(want)
    assert got["choices"][0]["message"]["content"] == world["tok"].decode(want, skip_special_tokens=True)


def test_rotary_tables_come_out_row_major(world):
    """The GPU kernels read cos/sin rows as token * (head_dim / 2): the multi-axis gather must not
    hand them a transposed layout (it once did, and every key was rotated by other tokens' angles)."""
    model = world["engine"].model
    pos = torch.stack([torch.arange(9), torch.arange(9) * 2, torch.arange(9) * 3]).int()
    cos, sin = model.rotary(pos)
    assert cos.is_contiguous() and sin.is_contiguous()
    axes = torch.tensor(model.spec.rope_axes)
    want = model.cos_table[pos.long()[axes, :].t(), torch.arange(len(axes))]
    assert torch.equal(cos, want)


def test_detokenizing_many_tokens_at_once_equals_one_by_one(world):
    tok = world["tok"]
    rng = np.random.default_rng(1)
    for _ in range(20):
        ids = rng.integers(0, len(tok), 50).tolist()
        d, out, i = Detokenizer(tok), [], 0
        while i < len(ids):
            n = int(rng.integers(1, 9))
            out.append(d.feed_all(ids[i:i + n], final=i + n >= len(ids)))
            i += n
        assert "".join(out) == tok.decode(ids, skip_special_tokens=True)


def test_step_buckets_hold_every_step_and_pad_as_documented():
    """Every step size up to the token budget has a step graph, padded by at most its own size up to 128
    tokens, then by fewer than 128, 256 or 512 tokens (up to 1024, 4096, beyond)."""
    from app.llm.step_inputs import step_buckets

    assert step_buckets(2048)[:6] == [16, 32, 64, 128, 256, 384] and len(step_buckets(2048)) == 15
    for top in (16, 48, 130, 2048, 3000, 8192):
        buckets = step_buckets(top)
        assert buckets == sorted(set(buckets)) and buckets[-1] == top
        for t in range(1, top + 1):
            pad = next(b for b in buckets if b >= t) - t
            assert pad <= max(t, 16) if t <= 128 else pad < (128 if t <= 1024 else 256 if t <= 4096 else 512)


def test_vision_with_another_number_of_deepstack_layers_is_refused_at_submit(world):
    """The step's dense deepstack buffers hold the text model's count of layers (its config's
    deepstack_visual_indexes): an encoder output with another count is refused before it is queued,
    where the forward would otherwise drop or misplace features."""
    eng = world["engine"]
    assert eng.spec.deepstack_layers == len(world["ref"].config.vision_config.deepstack_visual_indexes) > 0
    req = make_request(world, ["image"])[0]
    req.vision[0].deepstack = req.vision[0].deepstack[:-1]
    with pytest.raises(ValueError, match="deepstack layers"):
        eng.submit(req)


class _Prompt:
    """What the block manager reads of a sequence: its tokens' block keys and its engine state."""

    def __init__(self, tokens: list[int], bs: int, output: int = 0):
        self.token_ids = tokens + list(range(5000, 5000 + output))  # a preempted one's output too
        self.block_keys = [tuple(tokens[i:i + bs]) for i in range(0, len(tokens) // bs * bs, bs)]
        self.prompt_hashes, self.waits_on = None, None
        self.block_table, self.block_hashes, self.num_computed, self.num_cached = [], [], 0, 0

    def __len__(self):
        return len(self.token_ids)


def test_a_prompt_waits_for_shared_blocks_being_computed_only_when_they_are_worth_a_step():
    """A is admitted (its 25 blocks of 4 noted as being computed). D (A's prompt) and C (A's first 80
    tokens) wait for A; B shares only 8 tokens (two blocks, below WAIT_MIN_TOKENS) and does not. Once
    A's step is launched (its blocks registered), nobody waits and C takes A's 20 shared blocks."""
    from app.llm.block_manager import WAIT_MIN_TOKENS, BlockManager

    bm, bs = BlockManager(256, 4), 4
    assert WAIT_MIN_TOKENS == 64
    base = list(range(1000, 1100))
    a, d = _Prompt(base, bs), _Prompt(list(base), bs)
    b = _Prompt(base[:8] + list(range(2000, 2092)), bs)
    c = _Prompt(base[:80] + list(range(3000, 3020)), bs)
    assert bm.allocate(a) and len(bm.computing) == 25
    assert bm.computed_by(d) is a and bm.computed_by(c) is a and bm.computed_by(b) is None
    # while A is being computed, asking again costs no prefix lookup (the schedule asks every step)
    lookups = []
    real_lookup = bm._lookup
    bm._lookup = lambda s: lookups.append(s) or real_lookup(s)
    assert bm.computed_by(c) is a and bm.computed_by(d) is a and lookups == []
    # A's first 60 tokens computed (a chunk): C still waits for the rest of what they share (80 tokens)
    a.num_computed = 60
    bm.register_computed(a)
    assert bm.computed_by(c) is a and lookups == []
    a.num_computed = 100
    bm.register_computed(a)
    assert bm.computing == {} and bm.computed_by(c) is None
    assert bm.allocate(c) and c.num_cached == 80 and c.block_table[:20] == a.block_table[:20]
    bm.free_seq(c)
    assert bm.computing == {}  # c's own noted blocks are forgotten with it
    # A preempted sequence (its prompt, A's, all cached; 30 output tokens past it) waits for nothing,
    # while another prompt notes blocks as being computed
    e, f = _Prompt(list(base), bs, output=30), _Prompt(list(range(4000, 4100)), bs)
    assert bm.allocate(f) and bm.computing and bm.computed_by(e) is None


@pytest.mark.parametrize("parts", [["look <|image", "_pad|> here"], ["<|vision_", "start|> x"], ["a <|video", "_pad|>"]])
def test_text_parts_that_join_into_a_vision_marker_are_a_400(world, parts):
    """Each part passes the parser's check alone, but the chat template joins a message's text parts as
    they are: the prompt builder refuses the marker they make (a ValueError, so a 500, before), with
    and without a real image beside them."""
    from app.api.prompt import MediaSlot, PromptBuilder
    from app.api.schemas import parse_chat_request
    from app.errors import ClientError

    content = [{"type": "text", "text": t} for t in parts]
    parse_chat_request({"messages": [{"role": "user", "content": content}]}, 16, 4)
    for extra, slots in (([], []), ([{"type": "image"}], [MediaSlot("image", (1, 4, 4))])):
        with pytest.raises(ClientError) as e:
            PromptBuilder(world["tok"]).build([{"role": "user", "content": extra + content}], slots)
        assert (e.value.status, e.value.code, e.value.param) == (400, "reserved_token", "messages")
