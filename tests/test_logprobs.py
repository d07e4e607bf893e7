"""Log-probabilities (OpenAI's `logprobs` / `top_logprobs`) from the engine, against transformers'
logits on the tiny model in fp32, alone and batched, with synchronous and overlapped steps; and their
OpenAI form (app/api/logprobs.py).

They are the model's own distribution at each output position: log_softmax of the raw logits, before
penalties, temperature, top-k and top-p."""

import threading

import pytest
import torch

from app.llm.engine import Engine
from app.llm.stream import OutputStream, TokenDelta
from helpers import make_request, ours, reference_logits

TOL = 1e-4  # our fp32 logits are within 1e-4 of transformers' (test_llm.py)


@pytest.fixture(scope="module")
def overlapped(tiny_checkpoint):
    return Engine(str(tiny_checkpoint), overlap_steps=True)


def entries(chunks) -> list:
    out = [e for c in chunks for e in c.logprobs]
    assert len(out) == sum(len(c.token_ids) for c in chunks)  # one per token id, chunk by chunk
    return out


def check_against_reference(world, prompt, items, got: list[int], lps: list, k: int, tol: float = TOL) -> None:
    ref = torch.log_softmax(reference_logits(world, prompt, items, got).double(), dim=-1)
    assert len(lps) == len(got)
    for pos, (tok, (lp, top_ids, top_vals)) in enumerate(zip(got, lps)):
        row = ref[pos]
        assert abs(lp - row[tok].item()) <= tol, (pos, lp, row[tok].item())
        assert len(top_ids) == len(top_vals) == k
        want_vals = row.topk(k).values
        assert torch.allclose(torch.tensor(top_vals, dtype=torch.float64), want_vals, atol=tol, rtol=0)
        # the ids are the reference's top k up to ties within the tolerance: each one scores its value
        assert torch.allclose(row[top_ids], torch.tensor(top_vals, dtype=torch.float64), atol=tol, rtol=0)
        assert top_vals == sorted(top_vals, reverse=True)


def run_concurrently(engine, reqs) -> list[list]:
    """Submit every request at once (they share steps) and read each one's chunks on its own thread."""
    seqs = [engine.submit(r) for r, _, _ in reqs]
    results = [None] * len(seqs)

    def read(i):
        chunks = []
        while not chunks or not chunks[-1].finish_reason:
            chunks.append(seqs[i].next_chunk(timeout=120))
        results[i] = chunks

    threads = [threading.Thread(target=read, args=(i,)) for i in range(len(seqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


# requests sharing steps: (media, top_logprobs or None for no logprobs)
MIXED = [(["image"], 4), ([], None), (["video"], 2), (["image"], None), ([], 6)]


def check_mixed(world, reqs, results, tol: float = TOL) -> None:
    for (_, items, prompt), (_, k), chunks in zip(reqs, MIXED, results):
        got = [t for c in chunks for t in c.token_ids]
        if k is None:
            assert all(c.logprobs is None for c in chunks)
        else:
            check_against_reference(world, prompt, items, got, entries(chunks), k, tol)


@pytest.mark.parametrize("kinds", [[], ["image"], ["image", "video"]])
def test_greedy_logprobs_equal_transformers_log_softmax(world, kinds):
    req, items, prompt = make_request(world, kinds, max_tokens=8, logprobs=5)
    got, chunks = ours(world, req)
    lps = entries(chunks)
    check_against_reference(world, prompt, items, got, lps, 5)
    for tok, (lp, top_ids, top_vals) in zip(got, lps):  # greedy: the chosen token is the most likely
        assert top_vals[0] == pytest.approx(lp, abs=1e-6) and lp == max(top_vals)
        assert tok in top_ids


def test_logprobs_describe_the_model_not_the_sampling_settings(world):
    """Sampled with temperature, top-k, top-p and penalties: the log-probabilities are still the raw
    model's at each position (what the token was drawn from, before the sampling transforms)."""
    req, items, prompt = make_request(world, ["image"], max_tokens=8, logprobs=3, temperature=1.7, top_k=7,
                                      top_p=0.9, frequency_penalty=1.5, presence_penalty=0.5, seed=7)
    got, chunks = ours(world, req)
    check_against_reference(world, prompt, items, got, entries(chunks), 3)


def test_no_logprobs_unless_asked_and_zero_alternatives(world):
    req, _, _ = make_request(world, ["image"], max_tokens=4)
    assert all(c.logprobs is None for c in ours(world, req)[1])
    req, items, prompt = make_request(world, ["image"], max_tokens=4, logprobs=0)
    got, chunks = ours(world, req)
    lps = entries(chunks)
    assert all(top_ids == [] and top_vals == [] for _, top_ids, top_vals in lps)
    ref = torch.log_softmax(reference_logits(world, prompt, items, got).double(), dim=-1)
    assert max(abs(lp - ref[i, t].item()) for i, (t, (lp, _, _)) in enumerate(zip(got, lps))) <= TOL


def test_the_engine_refuses_more_alternatives_than_its_buffers_hold(world):
    from app.errors import ClientError
    from app.llm.sampling import MAX_LOGPROBS

    req, _, _ = make_request(world, [], logprobs=MAX_LOGPROBS + 1)
    with pytest.raises(ClientError) as e:
        world["engine"].submit(req)
    assert e.value.status == 400 and e.value.param == "top_logprobs"
    req.params.logprobs = MAX_LOGPROBS  # the most it holds: served, every entry full
    assert all(len(top) == MAX_LOGPROBS for _, top, _ in entries(ours(world, req)[1]))


@pytest.mark.parametrize("mode", ["sync", "overlap"])
def test_batched_requests_get_their_own_logprobs(world, overlapped, mode):
    """Requests decoding in the same steps, some asking for logprobs (different k) and some not: each
    gets its own, equal to the reference's, with synchronous and overlapped steps."""
    engine = world["engine"] if mode == "sync" else overlapped
    reqs = mixed_requests(world)
    check_mixed(world, reqs, run_concurrently(engine, reqs))


def mixed_requests(world, device: str = "cpu") -> list:
    reqs = [make_request(world, kinds, data_seed=i, max_tokens=6, **({} if k is None else {"logprobs": k}))
            for i, (kinds, k) in enumerate(MIXED)]
    for r, _, _ in reqs:
        for v in r.vision:
            v.main, v.deepstack = v.main.to(device), [d.to(device) for d in v.deepstack]
    return reqs


@pytest.mark.gpu
def test_logprobs_from_graphed_overlapped_steps_on_gpu(world, tiny_checkpoint):
    """On CUDA in fp32: decode steps replayed from CUDA graphs, overlapped (CUDA's default), the
    log-probabilities copied back through pinned buffers. Against transformers' fp32 logits on the CPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    eng = Engine(str(tiny_checkpoint), device="cuda", dtype="float32", max_model_len=512, max_num_seqs=8,
                 max_num_batched_tokens=64, num_kv_blocks=512)
    assert eng.overlap and eng.runner.graphs
    reqs = mixed_requests(world, "cuda")
    check_mixed(world, reqs, run_concurrently(eng, reqs), tol=1e-3)
    assert eng.graph_steps > 0 and eng.step_graph_steps > 0  # decodes, and prompts through step graphs
    eng.shutdown()


@pytest.mark.gpu
def test_greedy_logprobs_in_bf16_name_the_chosen_token_first_on_gpu(world, tiny_checkpoint):
    """bf16 on CUDA (graphs, overlap): a greedy token is the argmax of the logits its log-probability
    comes from, so it heads the top list (or ties with its head), with the same value."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    eng = Engine(str(tiny_checkpoint), device="cuda", dtype="bfloat16", max_model_len=512, max_num_seqs=8,
                 max_num_batched_tokens=64, num_kv_blocks=512)
    reqs = mixed_requests(world, "cuda")
    for (_, k), chunks in zip(MIXED, run_concurrently(eng, reqs)):
        if k:
            for tok, (lp, top_ids, top_vals) in zip([t for c in chunks for t in c.token_ids], entries(chunks)):
                assert top_vals[0] == lp <= 0
                assert top_ids[0] == tok or top_vals[1] == lp  # or a tie in bf16, broken the other way
    assert eng.graph_steps > 0
    eng.shutdown()


def test_stop_strings_keep_logprobs_beside_their_tokens(world):
    """With stop strings the stream goes token by token and holds text back: each chunk still carries
    exactly one entry per token id it carries."""
    req, _, _ = make_request(world, [], max_tokens=12, logprobs=1)
    full = "".join(c.text for c in ours(world, req)[1])
    req.params.stop = [full[3:6]]
    chunks = ours(world, req)[1]
    assert chunks[-1].finish_reason == "stop"
    entries(chunks)


def test_output_stream_pairs_entries_with_tokens_across_held_back_text(world):
    """Text held back (an unfinished stop-string prefix) delays its tokens and their entries together."""
    from app.llm.sampling import SamplingParams

    tok = world["tok"]
    ids = tok.encode("abcabd")
    stream = OutputStream(tok, SamplingParams(stop=["abx"], logprobs=0), 3, 0)
    chunks = []
    for i, t in enumerate(ids):
        c = stream.push([TokenDelta([t], "length" if i == len(ids) - 1 else None, logprobs=[(-float(i), [], [])])])
        if c is not None:
            chunks.append(c)
    got = [t for c in chunks for t in c.token_ids]
    assert got == ids and [e[0] for c in chunks for e in c.logprobs] == [-float(i) for i in range(len(ids))]


def test_a_chunk_streams_as_asdict_would_give_it_and_later_tokens_leave_it_alone(world):
    """Chunk.as_dict (what backends yield) equals dataclasses.asdict's deep copy, field for field, with
    logprobs and timing; what the stream does after a chunk is made (more tokens, more log-probabilities)
    changes no dict already yielded."""
    import copy
    from dataclasses import asdict

    from app.llm.sampling import SamplingParams

    tok = world["tok"]
    ids = tok.encode("hello there")
    stream = OutputStream(tok, SamplingParams(logprobs=1), 3, 2)
    first = stream.push([TokenDelta(ids[:2], logprobs=[(-0.5, [ids[0]], [-0.5]), (-1.5, [ids[1]], [-1.5])],
                                    cached_tokens=1, timing={"queue_s": 0.01, "prefill_s": 0.02})])
    out = first.as_dict()
    assert out == asdict(first) and list(out) == list(asdict(first))
    kept = copy.deepcopy(out)
    last = stream.push([TokenDelta(ids[2:], "length", logprobs=[(-2.0, [t], [-2.0]) for t in ids[2:]])])
    assert out == kept and last.as_dict() == asdict(last) and last.as_dict()["finish_reason"] == "length"
    assert [t for c in (out, last.as_dict()) for t in c["token_ids"]] == ids


# ---------------------------------------------------------------- OpenAI's form
def test_byte_level_alphabet_equals_transformers_bytes_to_unicode():
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from app.api.logprobs import _byte_level_alphabet

    assert _byte_level_alphabet() == {c: b for b, c in bytes_to_unicode().items()}


def test_token_bytes_concatenate_to_the_exact_text(world):
    """Multi-byte characters split across tokens: each token's `bytes` are exact, so their
    concatenation is the text's UTF-8; a token holding part of a character shows U+FFFD."""
    from app.api.logprobs import TokenText

    tok, text = world["tok"], "héllo 世界 — naïve 🙂\ttabs\nnewlines <b>"
    ids = tok.encode(text)
    tt = TokenText(tok)
    assert b"".join(bytes(tt(i)[1]) for i in ids) == text.encode()
    partial = [tt(i)[0] for i in ids if bytes(tt(i)[1]).decode("utf-8", errors="replace") != tok.decode([i])]
    assert partial == []  # where one token is a whole character, its text is the tokenizer's decode
    assert any("\ufffd" in tt(i)[0] for i in ids)  # this tokenizer splits some of these characters
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tt(end) == ("<|im_end|>", list(b"<|im_end|>"))


def run_chat(tiny_checkpoint, body: dict):
    """The in-process ChatService (each request alone on our engine): (the JSON answer, or the
    stream's parsed events; the generation request it built)."""
    import asyncio
    import json

    from app.config import AppConfig
    from helpers import local_chat

    chat = local_chat(AppConfig(model=str(tiny_checkpoint)), tiny_checkpoint)

    async def run():
        req, gen, payload = await chat.prepare(body)
        if not req.stream:
            return await chat.complete(req, gen, payload), gen
        writes = [w async for w in await chat.open_stream(req, gen, payload)]
        return [json.loads(b[len("data: "):]) for w in writes for b in w.split("\n\n") if b.startswith("data: {")], gen

    return asyncio.run(asyncio.wait_for(run(), timeout=120))


def test_the_answer_and_the_stream_carry_the_engines_logprobs(world, tiny_checkpoint):
    """The JSON answer's `logprobs.content` is the engine's entries (tested against transformers above)
    with each id's text and bytes; the stream's chunks carry the same entries, in order."""
    from app.api.logprobs import TokenText
    from app.llm.sequence import GenerationRequest

    body = {"messages": [{"role": "user", "content": "Tell me about it"}], "max_tokens": 8, "temperature": 0,
            "logprobs": True, "top_logprobs": 3}
    answer, gen = run_chat(tiny_checkpoint, body)
    content = answer["choices"][0]["logprobs"]["content"]
    text = answer["choices"][0]["message"]["content"]
    got, chunks = ours(world, GenerationRequest.from_router(gen, []))
    tt = TokenText(world["tok"])
    assert len(content) == len(got)
    # the text skips special tokens (random weights generate some); the bytes of the others are the
    # text's, where it is valid UTF-8 (else the text shows U+FFFD)
    tok = world["tok"]
    special = {i for i, t in tok.added_tokens_decoder.items() if t.special}
    assert b"".join(bytes(e["bytes"]) for e, t in zip(content, got) if t not in special).decode(errors="replace") == text
    for e, tid, (lp, top_ids, top_vals) in zip(content, got, entries(chunks)):
        assert (e["token"], e["bytes"], e["logprob"]) == (*tt(tid), lp)
        assert e["top_logprobs"] == [{"token": tt(i)[0], "logprob": v, "bytes": tt(i)[1]}
                                     for i, v in zip(top_ids, top_vals)]

    events, _ = run_chat(tiny_checkpoint, body | {"stream": True})
    streamed = [e for ev in events if ev["choices"] and ev["choices"][0]["logprobs"]
                for e in ev["choices"][0]["logprobs"]["content"]]
    assert streamed == content
    assert "".join(ev["choices"][0]["delta"].get("content", "") for ev in events if ev["choices"]) == text


def test_without_logprobs_the_answer_says_null(tiny_checkpoint):
    answer, _ = run_chat(tiny_checkpoint, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert answer["choices"][0]["logprobs"] is None


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [151936, 4097, 430])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_triton_logprobs_equal_torchs_on_gpu(vocab, dtype):
    """The two-stage kernel against log_softmax + topk in float64: values within float32 rounding, the
    top ids distinct and each scoring its value (bf16 logits tie often: either tied id is right)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from app.llm.logprobs import token_logprobs

    g = torch.Generator(device="cuda").manual_seed(vocab)
    for rows in (1, 3, 64):
        logits = (torch.randn(rows, vocab, device="cuda", generator=g) * 4).to(dtype)
        tokens = torch.randint(0, vocab, (rows,), device="cuda", generator=g)
        ref = torch.log_softmax(logits.double(), dim=-1)
        for k in (0, 1, 5, 20):
            out = token_logprobs(logits, tokens, k).double()
            assert out.shape == (rows, 1 + 2 * k)
            assert (out[:, 0] - ref.gather(1, tokens[:, None])[:, 0]).abs().max() <= 1e-5
            if not k:
                continue
            vals, ids = out[:, 1:1 + k], out[:, 1 + k:].long()
            assert (vals - ref.topk(k, dim=-1).values).abs().max() <= 1e-5
            assert (ref.gather(1, ids) - vals).abs().max() <= 1e-5
            assert all(len(set(r)) == k for r in ids.tolist())
