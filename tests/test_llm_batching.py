"""Continuous batching: requests of different lengths decoded together equal transformers' generate."""

import threading
import time

import pytest
import torch

from app.errors import ClientError
from app.llm.engine import Engine
from helpers import attention_calls, make_request, reference_generate, skip_unless_cudnn_is_the_default

KINDS = [[], ["image"], ["video"], ["image", "video"], ["image", "image"], [], ["video", "image", "video"], ["image"]]


def collect(seq):
    chunks = []
    while True:
        c = seq.next_chunk(timeout=60)
        chunks.append(c)
        if c.finish_reason:
            return [t for ch in chunks for t in ch.token_ids], chunks


def test_eight_requests_of_different_lengths_batched_equal_generate(world):
    engine: Engine = world["engine"]
    reqs = [make_request(world, kinds, data_seed=i, words=i, max_tokens=6 + 2 * i) for i, kinds in enumerate(KINDS)]
    assert len({len(r[0].input_ids) for r in reqs}) == len(reqs)  # all prompt lengths differ
    peak0, steps0, pre0 = engine.peak_running, engine.steps, engine.prefill_batches
    engine.peak_running = 0
    seqs = [engine.submit(r[0]) for r in reqs]
    outs = [collect(s) for s in seqs]
    assert engine.peak_running >= 4  # they really ran together
    assert engine.prefill_batches - pre0 < len(reqs)  # and prompts were prefilled together
    total = sum(len(o[0]) for o in outs)
    assert engine.steps - steps0 < total  # shared decode steps
    eos = engine.eos_ids
    for (req, items, prompt), (got, chunks) in zip(reqs, outs):
        want = reference_generate(world, prompt, items, max_new=req.params.max_tokens)
        assert got == [t for t in want if t not in eos]
        assert chunks[-1].finish_reason == ("stop" if want[-1] in eos else "length")
    engine.peak_running = max(engine.peak_running, peak0)


def test_a_bad_request_in_a_batched_prefill_fails_alone(world):
    from app.llm.engine import VisionInput

    engine = world["engine"]
    good = [make_request(world, k, data_seed=20 + i, words=i, max_tokens=4)[0] for i, k in enumerate(KINDS[:4])]
    bad = make_request(world, ["image"], data_seed=30, max_tokens=4)[0]
    v = bad.vision[0]
    bad.vision[0] = VisionInput(v.grid, v.main[:-1], [d[:-1] for d in v.deepstack])
    seqs = [engine.submit(r) for r in good[:2] + [bad] + good[2:]]
    with pytest.raises(ValueError, match="placeholders"):
        collect(seqs[2])
    for s in seqs[:2] + seqs[3:]:
        assert collect(s)[1][-1].finish_reason


def test_seeded_sampling_is_the_same_alone_and_batched(world):
    engine = world["engine"]
    req = make_request(world, ["image"], temperature=0.9, top_p=0.95, top_k=50, seed=42, max_tokens=10)[0]
    alone = collect(engine.submit(req))[0]
    others = [engine.submit(make_request(world, k, data_seed=9 + i, temperature=1.0, max_tokens=12)[0])
              for i, k in enumerate(KINDS[:5])]
    batched = collect(engine.submit(req))[0]
    for s in others:
        collect(s)
    assert alone == batched


def test_top_k_one_is_greedy_and_penalties_change_the_output(world):
    engine = world["engine"]
    greedy = collect(engine.submit(make_request(world, [], max_tokens=16)[0]))[0]
    top1 = collect(engine.submit(make_request(world, [], max_tokens=16, temperature=1.0, top_k=1, seed=3)[0]))[0]
    assert top1 == greedy
    penal = collect(engine.submit(make_request(world, [], max_tokens=16, presence_penalty=2.0,
                                               frequency_penalty=2.0)[0]))[0]
    assert len(set(penal)) == len(penal)  # a strong penalty forbids repeats here


def test_sampler_penalties_and_top_k_follow_openai_semantics():
    from app.llm.sampling import Sampler, SamplingParams

    logits = torch.tensor([0.0, 1.0, 2.0, 3.0, 2.9])
    assert Sampler(SamplingParams(temperature=0), torch.device("cpu"))(logits, [3]) == 3
    # presence: a flat 0.2 off token 3 -> 2.8 < 2.9
    assert Sampler(SamplingParams(temperature=0, presence_penalty=0.2), torch.device("cpu"))(logits, [3]) == 4
    # frequency: 0.05 per occurrence; once -> 2.95 still wins, three times -> 2.85 loses
    freq = Sampler(SamplingParams(temperature=0, frequency_penalty=0.05), torch.device("cpu"))
    assert freq(logits, [3]) == 3 and freq(logits, [3, 3, 3]) == 4
    # top_k=2 with any temperature only ever picks tokens 3 and 4
    top2 = Sampler(SamplingParams(temperature=5.0, top_k=2, seed=0), torch.device("cpu"))
    assert {top2(logits) for _ in range(200)} == {3, 4}


def test_a_cancelled_request_frees_its_slot_within_a_step(world):
    engine = world["engine"]
    seq = engine.submit(make_request(world, ["image"], max_tokens=500, ignore_eos=True)[0])
    seq.next_chunk(timeout=60)
    seq.cancel()
    steps = engine.steps
    done = threading.Event()

    def watch():
        while seq in engine.running:
            time.sleep(0.0005)
        done.set()

    threading.Thread(target=watch, daemon=True).start()
    other = collect(engine.submit(make_request(world, [], max_tokens=3)[0]))
    assert done.wait(30) and other[1][-1].finish_reason
    assert engine.steps - steps <= 4 and seq not in engine.running


def test_full_queue_is_a_503_with_retry_after(tiny_checkpoint, world):
    small = Engine(str(tiny_checkpoint), max_num_seqs=1, max_waiting=1)
    # `first` cannot finish during the test (no EOS, thousands of tokens), so once admitted it holds the one slot
    first = small.submit(make_request(world, [], max_tokens=8000, ignore_eos=True)[0])
    deadline = time.monotonic() + 30
    while first not in small.running:  # `waiting` holds (seq, request) pairs; `running` holds sequences
        assert time.monotonic() < deadline, "the scheduler never admitted the first request"
        time.sleep(0.001)
    # the waiting queue takes one request, and the next is refused
    small.submit(make_request(world, [], max_tokens=2)[0])
    with pytest.raises(ClientError) as e:
        small.submit(make_request(world, [], max_tokens=2)[0])
    assert e.value.status == 503 and e.value.headers["Retry-After"] == "1"
    first.cancel()


def test_kv_memory_is_bounded_by_configuration(tiny_checkpoint, world):
    eng = Engine(str(tiny_checkpoint), max_model_len=64, max_num_seqs=2)
    collect(eng.submit(make_request(world, [], max_tokens=4)[0]))
    per_layer = 2 * eng.max_num_seqs * eng.kv_heads * 64 * eng.head_dim * 4
    assert sum(k.numel() * 4 + v.numel() * 4 for k, v in zip(eng._k, eng._v)) == per_layer * len(eng.text.layers)
    with pytest.raises(ClientError) as e:
        eng.submit(make_request(world, ["image", "video"], words=80, max_tokens=4)[0])
    assert e.value.code == "context_length_exceeded"
    assert eng._k[0].shape == (2, eng.kv_heads, 64, eng.head_dim)


@pytest.mark.gpu
def test_graph_decode_equals_eager_decode_and_generate_on_gpu(tiny_checkpoint, world):
    """The tiny model in fp32 on CUDA: decode replayed from CUDA graphs gives the same tokens as eager
    decode and as transformers' generate, for 8 concurrent requests of different lengths."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    graphed = Engine(str(tiny_checkpoint), device="cuda", dtype="float32", max_model_len=512, max_num_seqs=8)
    eager = Engine(str(tiny_checkpoint), device="cuda", dtype="float32", max_model_len=512, max_num_seqs=8,
                   cuda_graphs=False)
    assert graphed.decode_graphs and not eager.decode_graphs
    reqs = [make_request(world, k, data_seed=i, words=i, max_tokens=6 + 2 * i) for i, k in enumerate(KINDS)]
    for r in reqs:  # the requests' vision embeddings were made on the CPU: move them
        for v in r[0].vision:
            v.main, v.deepstack = v.main.cuda(), [d.cuda() for d in v.deepstack]
    outs_g = [collect(s)[0] for s in [graphed.submit(r[0]) for r in reqs]]
    outs_e = [collect(s)[0] for s in [eager.submit(r[0]) for r in reqs]]
    assert graphed.graph_steps > 0
    assert outs_g == outs_e
    for (req, items, prompt), got in zip(reqs, outs_g):
        want = [t for t in reference_generate(world, prompt, items, max_new=req.params.max_tokens)
                if t not in graphed.eos_ids]
        assert got == want


@pytest.mark.gpu
def test_prefill_and_eager_decode_build_no_cudnn_attention_plans(tiny_checkpoint, world):
    """Prefill shapes (batch, padded width) change with every batch, and cuDNN's attention builds an
    execution plan per new shape: a first burst of 8 requests waited 2 s in the 2B LLM's prefill. The
    engine's uncaptured forwards must use other kernels."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    eng = Engine(str(tiny_checkpoint), device="cuda", dtype="bfloat16", max_model_len=256, max_num_seqs=4,
                 cuda_graphs=False)
    tc = eng.model.config.text_config
    skip_unless_cudnn_is_the_default(tc.num_attention_heads, eng.head_dim, masked=True)
    reqs = [make_request(world, k, data_seed=i, words=3 * i, max_tokens=4) for i, k in enumerate(KINDS[:4])]
    for r in reqs:
        for v in r[0].vision:
            v.main, v.deepstack = v.main.cuda(), [d.cuda() for d in v.deepstack]
    # The profiler sees only its own thread: run the scheduler's iterations here, not in its thread.
    eng._thread = threading.current_thread()  # alive, so submit starts no scheduler thread
    seqs = [eng.submit(r[0]) for r in reqs]

    def schedule():
        with torch.inference_mode():
            while eng.running or eng.waiting:
                eng._iterate()

    sdpa, cudnn = attention_calls(schedule)
    assert sdpa > 0 and cudnn == 0  # prefill and eager decode ran attention, none of it cuDNN's
    assert eng.prefill_batches >= 1 and eng.steps > 0 and all(s.finished for s in seqs)
