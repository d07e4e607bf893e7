"""vLLM's sampling extensions in the engine: `repetition_penalty` and `min_p` on the device (against
transformers' processors and the direct formula), `min_tokens` (the end-of-sequence and stop token ids
held back), `top_k: -1`; and, where text is made, `stop_token_ids`, `include_stop_str_in_output`,
`skip_special_tokens` and `min_tokens` deferring stop strings."""

from types import SimpleNamespace

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
)

from app.llm.engine import Engine
from app.llm.sampler import Sampler, SamplingBatch, uniform_noise
from app.llm.sampling import SamplingParams
from app.llm.stream import OutputStream, TokenDelta
from helpers import _pixels, make_request, ours

VOCAB = 64


def batch(rows, **flags) -> SamplingBatch:
    """A SamplingBatch of `rows` (dicts of SamplingBatch field -> value; defaults are 'off')."""
    def col(name, default, dtype):
        return torch.tensor([r.get(name, default) for r in rows], dtype=dtype)

    return SamplingBatch(col("temperature", 0.0, torch.float32), col("top_k", 0, torch.int32),
                         col("top_p", 1.0, torch.float32), col("seed", 0, torch.int64), col("step", 0, torch.int64),
                         col("frequency_penalty", 0.0, torch.float32), col("presence_penalty", 0.0, torch.float32),
                         col("row", 0, torch.int64), repetition_penalty=col("repetition_penalty", 1.0, torch.float32),
                         min_p=col("min_p", 0.0, torch.float32), min_tokens=col("min_tokens", 0, torch.int32), **flags)


def seq(row_prompt, output=(), **params):
    """What Sampler.admit reads of a sequence."""
    ids = list(row_prompt) + list(output)
    return SimpleNamespace(params=SamplingParams(**params), token_ids=ids, prompt_len=len(row_prompt),
                           output_ids=list(output), num_output=len(output))


# ---------------------------------------------------------------- the sampler, against references
def test_repetition_penalty_equals_transformers_processor_over_prompt_and_output():
    """Each row's penalised logits equal transformers' RepetitionPenaltyLogitsProcessor over its whole
    sequence (prompt and output so far), exactly; rows with other penalties or none in the same step
    keep theirs; with frequency and presence penalties too, those apply after it (vLLM's order)."""
    g = torch.Generator().manual_seed(0)
    s = Sampler(VOCAB, 4, torch.device("cpu"))
    seqs = [seq([1, 2, 3, 60, 2], [7, 7, 9], repetition_penalty=1.3),
            seq([5, 6], [8], repetition_penalty=0.7),
            seq([1, 2], [3]),  # no penalty
            seq([4, 4, 10], [11, 4], repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)]
    for row, q in enumerate(seqs):
        s.admit(row, q)
    logits = torch.randn(4, VOCAB, generator=g) * 3
    rows = [{"row": i, "repetition_penalty": q.params.repetition_penalty, "frequency_penalty": q.params.frequency_penalty,
             "presence_penalty": q.params.presence_penalty, "step": q.num_output} for i, q in enumerate(seqs)]
    got = s.penalized(logits.clone(), batch(rows, any_penalty=True, any_repetition=True))
    for i, q in enumerate(seqs):
        want = RepetitionPenaltyLogitsProcessor(q.params.repetition_penalty)(
            torch.tensor([q.token_ids]), logits[i:i + 1].clone())[0] if q.params.repetition_penalty != 1 else logits[i]
        counts = torch.bincount(torch.tensor(q.output_ids, dtype=torch.int64), minlength=VOCAB).float()
        want = want - q.params.frequency_penalty * counts - q.params.presence_penalty * (counts > 0)
        assert torch.equal(got[i], want), i
    # the step's tokens count for the next step (output so far), as transformers' input_ids grow
    b = batch(rows, any_penalty=True, any_repetition=True)
    s.count(torch.tensor([12, 13, 14, 15]), b)
    again = s.penalized(logits.clone(), b)
    want0 = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([seqs[0].token_ids + [12]]), logits[:1].clone())[0]
    assert torch.equal(again[0], want0)


def test_repetition_penalty_changes_greedy_choice():
    logits = torch.tensor([[0.0, 1.0, 2.0, 2.5] + [-5.0] * (VOCAB - 4)])
    s = Sampler(VOCAB, 1, torch.device("cpu"))
    s.admit(0, seq([3], repetition_penalty=1.5))
    assert s(logits, batch([{"repetition_penalty": 1.0}])).item() == 3  # no penalty in the flags: plain argmax
    assert s(logits, batch([{"repetition_penalty": 1.5}], any_penalty=True, any_repetition=True)).item() == 2


@pytest.mark.parametrize("min_p,temperature", [(0.05, 1.0), (0.2, 0.7), (0.5, 1.5), (0.0, 1.0), (1.0, 1.0)])
def test_min_p_keeps_what_the_direct_formula_and_transformers_keep(min_p, temperature):
    """Kept: the tokens whose probability after temperature is at least min_p x the most likely one's
    (vLLM's MinP), exactly the set transformers' MinPLogitsWarper keeps; seeded draws equal draws with
    the same noise from the direct formula's distribution."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(8, VOCAB, generator=g) * 2
    s = Sampler(VOCAB, 8, torch.device("cpu"))
    rows = [{"temperature": temperature, "min_p": min_p, "seed": 100 + i, "step": i} for i in range(8)]
    b = batch(rows, all_greedy=False, any_min_p=True)
    x = s.filtered(logits, b)
    probs = torch.softmax(logits / temperature, -1)
    direct = probs >= min_p * probs.max(-1, keepdim=True).values
    assert torch.equal(torch.isfinite(x), direct)
    if min_p > 0:
        hf = MinPLogitsWarper(min_p)(torch.zeros(8, 1, dtype=torch.long), logits / temperature)
        assert torch.equal(torch.isfinite(hf), direct)
    ref = (logits / temperature).masked_fill(~direct, float("-inf"))
    noise = uniform_noise(b.seeds, b.steps, VOCAB)
    want = (ref - torch.log(-torch.log(noise))).argmax(-1)
    assert torch.equal(s(logits, b), want)


def test_min_p_then_top_k_then_top_p_in_vllms_order():
    logits = torch.log(torch.tensor([[0.40, 0.30, 0.15, 0.10, 0.05] + [1e-9] * (VOCAB - 5)]))
    s = Sampler(VOCAB, 1, torch.device("cpu"))
    x = s.filtered(logits, batch([{"temperature": 1.0, "min_p": 0.3, "top_k": 4, "top_p": 0.9}], all_greedy=False,
                                 any_min_p=True, max_top_k=4, any_top_p=True))
    # min_p 0.3 of 0.40 keeps p >= 0.12: the top three; top_k 4 keeps them; top_p 0.9 of (0.4, 0.3, 0.15)/0.85
    assert torch.isfinite(x[0]).nonzero().flatten().tolist() == [0, 1, 2]


def test_min_tokens_holds_back_end_of_sequence_and_stop_token_ids_until_reached():
    s = Sampler(VOCAB, 3, torch.device("cpu"))
    s.eos_ids = [5, 6]
    s.admit(0, seq([1], min_tokens=3, stop_token_ids=[9]))
    s.admit(1, seq([1], min_tokens=3, ignore_eos=True))  # nothing to hold back: EOS does not end it
    s.admit(2, seq([1], min_tokens=3, stop_token_ids=[70, 9]))  # 70 is outside the vocabulary: dropped
    assert s.held_ids(SamplingParams(stop_token_ids=[70, 9])) == [5, 6, 9] and not s.holds[1]
    logits = torch.zeros(3, VOCAB)
    logits[:, [5, 6, 9]] = 10.0
    for step, want in ((0, True), (2, True), (3, False)):
        rows = [{"row": r, "step": step, "min_tokens": 3 if s.holds[r] else 0} for r in range(3)]
        out = s.penalized(logits.clone(), batch(rows, any_min_tokens=True))
        held = torch.isinf(out[:, [5, 6, 9]]).all(-1).tolist()
        assert held == [want, False, want], step
        assert torch.equal(out[1], logits[1]) and bool((out[:, :5] == 0).all())


def test_a_row_s_state_is_rewritten_when_another_request_takes_it():
    s = Sampler(VOCAB, 1, torch.device("cpu"))
    s.eos_ids = [5]
    s.admit(0, seq([1, 2, 3], repetition_penalty=2.0, min_tokens=2, stop_token_ids=[7]))
    s.admit(0, seq([4], repetition_penalty=2.0))
    logits = torch.ones(1, VOCAB)
    out = s.penalized(logits, batch([{"repetition_penalty": 2.0, "min_tokens": 0}], any_penalty=True,
                                    any_repetition=True, any_min_tokens=True))
    assert (out[0] == 0.5).nonzero().flatten().tolist() == [4] and not s.holds[0]


# ---------------------------------------------------------------- the tiny model, against transformers
def _reference(world, prompt, items, max_new, **generate_kw):
    ids = torch.tensor([prompt.input_ids])
    out = world["ref"].generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                mm_token_type_ids=torch.tensor([prompt.mm_token_type_ids]), max_new_tokens=max_new,
                                do_sample=False, **generate_kw, **_pixels(prompt, items))
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("kinds,penalty", [([], 0.5), (["image"], 1.3), (["image"], 1.8), (["image"], 0.8)])
def test_greedy_with_repetition_penalty_equals_transformers_generate(world, kinds, penalty):
    req, items, prompt = make_request(world, kinds, max_tokens=12, repetition_penalty=penalty)
    got, chunks = ours(world, req)
    want = _reference(world, prompt, items, 12, repetition_penalty=penalty)
    eos = world["engine"].eos_ids
    assert got == [t for t in want if t not in eos]
    plain = _reference(world, prompt, items, 12)
    assert want != plain  # the penalty changed the answer


def test_min_tokens_equals_transformers_min_new_tokens_and_stop_token_ids_end_after_it(world):
    """Two of the greedy answer's tokens become stop token ids with min_tokens 4: while the answer is
    shorter they are held back (transformers' MinNewTokensLengthLogitsProcessor over the same ids gives
    the same tokens); after that the first of them ends the answer, without it."""
    req, items, prompt = make_request(world, ["image"], max_tokens=12)
    greedy, _ = ours(world, req)
    stops = [greedy[1], greedy[5]]
    req, _, _ = make_request(world, ["image"], max_tokens=12, min_tokens=4, stop_token_ids=stops)
    got, chunks = ours(world, req)
    eos = sorted(world["engine"].eos_ids)
    proc = MinNewTokensLengthLogitsProcessor(len(prompt.input_ids), 4, eos + stops)
    want = _reference(world, prompt, items, 12, logits_processor=LogitsProcessorList([proc]))
    want = [t for t in want if t not in eos]
    cut = next((i for i, t in enumerate(want) if t in stops and i >= 4), len(want))
    assert got == want[:cut] and len(got) >= 4
    assert not any(t in stops for t in want[:4])
    if cut < len(want):
        assert chunks[-1].finish_reason == "stop"


def test_min_tokens_holds_the_end_of_sequence_back_on_the_device(tiny_checkpoint, world):
    """An engine whose end-of-sequence id is a token the greedy answer writes early (its second): a plain
    request ends there; with min_tokens 5 the id is never drawn before 5 tokens (the same tokens as
    transformers' MinNewTokensLengthLogitsProcessor over that id), and may end the answer after."""
    req, items, prompt = make_request(world, ["image"], max_tokens=12)
    greedy, _ = ours(world, req)
    eos = greedy[1]
    assert eos not in greedy[:1]
    eng = Engine(str(tiny_checkpoint))
    eng.eos_ids = {eos}
    eng.runner.sampler.eos_ids = [eos]
    try:
        plain = list(eng.generate(make_request(world, ["image"], max_tokens=12)[0]))
        assert [t for c in plain for t in c.token_ids] == greedy[:1] and plain[-1].finish_reason == "stop"
        chunks = list(eng.generate(make_request(world, ["image"], max_tokens=12, min_tokens=5)[0]))
        got = [t for c in chunks for t in c.token_ids]
        proc = MinNewTokensLengthLogitsProcessor(len(prompt.input_ids), 5, [eos])
        want = _reference(world, prompt, items, 12, logits_processor=LogitsProcessorList([proc]))
        cut = want.index(eos) if eos in want else len(want)
        assert got == want[:cut] and len(got) >= 5
        assert chunks[-1].finish_reason == ("stop" if cut < len(want) else "length")
    finally:
        eng.shutdown()


# ---------------------------------------------------------------- where text is made
def _stream(world, params, ids, pieces=None):
    s = OutputStream(world["tok"], params, prompt_tokens=3, vision_embeddings=0)
    chunks = []
    for p in pieces or [[t] for t in ids]:
        if s.finished:
            break
        c = s.push([TokenDelta(p)])
        if c is not None:
            chunks.append(c)
    return s, chunks


def test_stop_token_ids_end_the_text_before_the_token_or_with_it(world):
    tok = world["tok"]
    ids = tok.encode("one two three four five six")
    stop_at = 3
    for include in (False, True):
        for pieces in (None, [ids]):
            params = SamplingParams(stop_token_ids=[ids[stop_at]], include_stop_str_in_output=include)
            s, chunks = _stream(world, params, ids, pieces)
            kept = ids[:stop_at + include]
            assert s.stopped and chunks[-1].finish_reason == "stop"
            assert "".join(c.text for c in chunks) == tok.decode(kept)
            assert chunks[-1].completion_tokens == len(kept)
            assert [t for c in chunks for t in c.token_ids] == kept


def test_include_stop_str_in_output_keeps_the_stop_string(world):
    tok = world["tok"]
    ids = tok.encode("one two three four five six")
    text = tok.decode(ids)
    for include in (False, True):
        s, chunks = _stream(world, SamplingParams(stop=[" four", "zzz"], include_stop_str_in_output=include), ids)
        want = text[:text.find(" four") + (len(" four") if include else 0)]
        assert "".join(c.text for c in chunks) == want and chunks[-1].finish_reason == "stop"


def test_min_tokens_defers_stop_strings_and_stop_token_ids(world):
    """A stop string inside the first min_tokens tokens' text does not end the answer (vLLM's rule: the
    text of those tokens is not searched); one completed later does."""
    tok = world["tok"]
    ids = tok.encode("one two one two one two")
    first_two = next(n for n in range(1, len(ids)) if "two" in tok.decode(ids[:n]))
    params = SamplingParams(stop=["two"], min_tokens=first_two)
    s, chunks = _stream(world, params, ids)
    text = "".join(c.text for c in chunks)
    assert chunks[-1].finish_reason == "stop" and text.count("two") == 1 and text.endswith("one ")
    params = SamplingParams(stop_token_ids=[ids[0]], min_tokens=1)
    s, chunks = _stream(world, params, ids)
    later = ids.index(ids[0], 1)
    assert [t for c in chunks for t in c.token_ids] == ids[:later]


def test_skip_special_tokens_false_keeps_special_tokens_text(world):
    tok = world["tok"]
    ids = tok.encode("hello") + [tok.convert_tokens_to_ids("<|im_start|>")] + tok.encode(" there")
    for skip in (True, False):
        s = OutputStream(tok, SamplingParams(skip_special_tokens=skip), prompt_tokens=3, vision_embeddings=0)
        chunks = [s.push([TokenDelta(ids)]), s.push([TokenDelta([], "length")])]
        text = "".join(c.text for c in chunks if c is not None)
        assert ("<|im_start|>" in text) == (not skip)
        assert text == tok.decode(ids, skip_special_tokens=skip)
