"""The engine's batching against transformers' `generate`: continuous batching, paged KV, chunked
prefill, prefix caching, preemption, cancellation, sampling, and the GPU paths.

Every test runs twice: with synchronous steps, and with overlapped steps (`overlap_steps`: step N+1
launched before step N's tokens are read, placeholders fed back on the device), which the CPU
would not use by default."""

import threading
import time

import numpy as np
import pytest
import torch

from app.errors import ClientError
from app.llm import engine as engine_module
from app.llm.engine import Engine
from helpers import attention_calls, collect, make_request, reference_generate

_ENGINES: dict = {}


@pytest.fixture(autouse=True, params=[False, True], ids=["sync", "overlap"])
def overlap(request, monkeypatch, world):
    """Engines built in a test take this step mode unless it names one; `engine` is the shared one."""
    def build(*args, **kw):
        kw.setdefault("overlap_steps", request.param)
        return engine_module.Engine(*args, **kw)

    def from_model(model, tokenizer, device="cpu", **kw):
        kw.setdefault("overlap_steps", request.param)
        return engine_module.Engine.from_model(model, tokenizer, device, **kw)

    build.from_model = from_model
    monkeypatch.setitem(globals(), "Engine", build)
    return request.param


@pytest.fixture
def engine(world, overlap, tiny_checkpoint):
    if not overlap:
        return world["engine"]
    if "overlap" not in _ENGINES:
        _ENGINES["overlap"] = engine_module.Engine(str(tiny_checkpoint), overlap_steps=True)
    return _ENGINES["overlap"]

KINDS = [[], ["image"], ["video"], ["image", "video"], ["image", "image"], [], ["video", "image", "video"], ["image"]]


def run_all(engine, reqs):
    seqs = [engine.submit(r[0]) for r in reqs]
    return [collect(s) for s in seqs]


def assert_equal_generate(world, reqs, outs, eos):
    for (req, items, prompt), (got, chunks) in zip(reqs, outs):
        want = reference_generate(world, prompt, items, max_new=req.params.max_tokens)
        assert got == [t for t in want if t not in eos]
        assert chunks[-1].finish_reason == ("stop" if want[-1] in eos else "length")


def eight_requests(world, seed=0, max_tokens=6):
    return [make_request(world, kinds, data_seed=seed + i, words=i, max_tokens=max_tokens + 2 * i)
            for i, kinds in enumerate(KINDS)]


def test_eight_requests_of_different_lengths_batched_equal_generate(world, engine):
    reqs = eight_requests(world)
    assert len({len(r[0].input_ids) for r in reqs}) == len(reqs)  # all prompt lengths differ
    steps0, log0 = engine.steps, len(engine.step_log)
    outs = run_all(engine, reqs)
    steps = list(engine.step_log)[log0 - len(engine.step_log):] if log0 < len(engine.step_log) else []
    assert max(s[0] for s in steps) >= 4  # they really ran together
    assert engine.steps - steps0 < sum(len(o[0]) for o in outs)  # shared steps
    assert_equal_generate(world, reqs, outs, engine.eos_ids)


def test_paged_equals_contiguous(world, tiny_checkpoint):
    """Blocks of 4 tokens, handed out interleaved between concurrent requests, against one block of
    max_model_len per request (a contiguous cache): the same tokens, and both equal generate."""
    reqs = eight_requests(world, seed=40)
    paged = Engine(str(tiny_checkpoint), block_size=4, max_model_len=512, max_num_seqs=8)
    contiguous = Engine(str(tiny_checkpoint), block_size=512, max_model_len=512, max_num_seqs=8)
    a, b = run_all(paged, reqs), run_all(contiguous, reqs)
    assert [x[0] for x in a] == [x[0] for x in b]
    tables = paged.blocks.queried_tokens
    assert tables > 0 and contiguous.blocks.num_blocks == 8 + 1
    assert_equal_generate(world, reqs, a, paged.eos_ids)


def test_chunked_prefill_equals_unchunked(world, tiny_checkpoint):
    """A 16-token step budget cuts every prompt (60-150 tokens) into chunks that share steps with
    other requests' decodes: the same tokens as generate."""
    reqs = eight_requests(world, seed=60)
    eng = Engine(str(tiny_checkpoint), max_num_batched_tokens=16, block_size=8)
    outs = run_all(eng, reqs)
    steps = list(eng.step_log)
    assert all(tokens <= 16 for _, tokens, *_ in steps)
    assert any(seqs > 1 and tokens == 16 for seqs, tokens, *_ in steps)  # chunks beside other work
    assert_equal_generate(world, reqs, outs, eng.eos_ids)


def test_a_prefix_cache_hit_equals_a_cold_run(world, tiny_checkpoint):
    eng = Engine(str(tiny_checkpoint), block_size=4)
    req, items, prompt = make_request(world, ["image", "video"], data_seed=7, words=6, max_tokens=8)
    cold = collect(eng.submit(req))[0]
    hits0 = eng.blocks.hit_tokens
    warm = collect(eng.submit(req))[0]
    hit = eng.blocks.hit_tokens - hits0
    assert warm == cold
    assert hit >= len(req.input_ids) - 4 - 3  # all full blocks but the one holding the last token
    assert eng.load()["prefix_cache_hit_tokens"] == eng.blocks.hit_tokens
    # the same text with another image: the placeholders are equal ids, but the content key differs,
    # so only the blocks before the image are shared
    other, _, other_prompt = make_request(world, ["image", "video"], data_seed=8, words=6, max_tokens=8)
    first_vision = other_prompt.mm_token_type_ids.index(1)
    hits0 = eng.blocks.hit_tokens
    got = collect(eng.submit(other))[0]
    assert eng.blocks.hit_tokens - hits0 == first_vision // 4 * 4
    want = reference_generate(world, other_prompt, _, max_new=8)
    assert got == [t for t in want if t not in eng.eos_ids]


def test_waiting_for_blocks_and_preemption_lose_no_token(world, tiny_checkpoint):
    """A pool of 40 blocks of 4 tokens for eight requests of 60-150 prompt tokens: requests wait for
    blocks, decodes preempt later arrivals, and every output still equals generate."""
    eng = Engine(str(tiny_checkpoint), num_kv_blocks=41, block_size=4, max_num_batched_tokens=64)
    reqs = eight_requests(world, seed=80, max_tokens=10)
    outs = run_all(eng, reqs)
    assert eng.scheduler.preemptions > 0
    assert_equal_generate(world, reqs, outs, eng.eos_ids)
    assert eng.blocks.num_free == eng.blocks.usable_blocks  # everything came back


def test_a_bad_request_fails_alone(world, engine):
    from app.llm.engine import VisionInput

    good = [make_request(world, k, data_seed=20 + i, words=i, max_tokens=4)[0] for i, k in enumerate(KINDS[:4])]
    bad = make_request(world, ["image"], data_seed=30, max_tokens=4)[0]
    v = bad.vision[0]
    bad.vision[0] = VisionInput(v.grid, v.main[:-1], [d[:-1] for d in v.deepstack])
    seqs = [engine.submit(r) for r in good[:2]]
    with pytest.raises(ValueError, match="placeholders"):
        engine.submit(bad)
    seqs += [engine.submit(r) for r in good[2:]]
    for s in seqs:
        assert collect(s)[1][-1].finish_reason


def test_an_empty_prompt_is_refused_at_submit(world, engine):
    """An empty prompt is a client error at submit (the chat API never builds one, but the engine's API
    allows it); before, it reached the scheduler, which reads a sequence's last token, and the error
    handler's own IndexError ended the engine thread."""
    from app.llm.engine import GenerationRequest
    from app.llm.sampling import SamplingParams

    with pytest.raises(ClientError, match="no tokens"):
        engine.submit(GenerationRequest([], [], [], SamplingParams(max_tokens=3)))
    assert collect(engine.submit(make_request(world, [], max_tokens=3)[0]))[1][-1].finish_reason == "length"


@pytest.mark.parametrize("budget", [2048, 32])
def test_one_prompt_sent_together_is_computed_once(world, tiny_checkpoint, budget):
    """Four separate requests with the same image prompt, queued before the engine's next step (as
    rollouts sent one request per sample arrive): the first computes the prompt, the other three wait
    for its blocks and take them from the prefix cache, whether one step's budget would have admitted
    all four prompts (2048) or the first takes several steps (32). All four give the lone answer."""
    eng = Engine(str(tiny_checkpoint), max_num_batched_tokens=budget)
    reqs = [make_request(world, ["image"], data_seed=6, words=20, max_tokens=6, ignore_eos=True) for _ in range(4)]
    length, bs = len(reqs[0][0].input_ids), eng.blocks.block_size
    assert 3 * 32 < length and 4 * length < 2048
    with eng._cv:  # the engine thread takes its inbox only once all four are in it
        seqs = [eng.submit(r[0]) for r in reqs]
    outs = [collect(s) for s in seqs]
    alone = collect(world["engine"].submit(make_request(world, ["image"], data_seed=6, words=20, max_tokens=6,
                                                        ignore_eos=True)[0]))[0]
    assert [o[0] for o in outs] == [alone] * 4
    assert eng.blocks.hit_tokens == 3 * ((length - 1) // bs) * bs
    prefilled = sum(tokens for _, tokens, _, _, _ in eng.step_log) - 4 * (6 - 1)  # less the decodes
    assert prefilled == length + 3 * (length - (length - 1) // bs * bs)
    assert eng.blocks.computing == {}  # nothing is left noted as being computed
    eng.shutdown()


def test_a_request_waiting_for_a_shared_prefix_lets_the_queue_behind_it_go(world, tiny_checkpoint):
    """A, then B (A's prompt), then C (another prompt), queued together: the first step runs A and C,
    B waits one step and takes A's blocks. Nobody's answer changes."""
    eng = Engine(str(tiny_checkpoint))
    a, b, c = (make_request(world, kinds, data_seed=seed, words=30, max_tokens=4)
               for kinds, seed in ((["image"], 11), (["image"], 11), (["video"], 12)))
    log0 = len(eng.step_log)
    with eng._cv:
        seqs = [eng.submit(r[0]) for r in (a, b, c)]
    outs = [collect(s)[0] for s in seqs]
    first = list(eng.step_log)[log0]
    assert first[:2] == (2, len(a[0].input_ids) + len(c[0].input_ids))  # A and C; not B
    assert seqs[2].scheduled_time < seqs[1].scheduled_time
    bs = eng.blocks.block_size
    assert seqs[1].num_cached == (len(b[0].input_ids) - 1) // bs * bs
    for (_, items, prompt), got in zip((a, b, c), outs):
        want = reference_generate(world, prompt, items, max_new=4)
        assert got == [t for t in want if t not in eng.eos_ids]
    eng.shutdown()


def test_shared_prompts_waiting_and_preempted_in_a_small_pool_lose_no_token(world, tiny_checkpoint):
    """Four prompts, each sent twice and queued together, in a pool of 40 blocks of 4 tokens: twins
    wait for each other's blocks, decodes preempt later arrivals (whose prompts come back from the
    cache while other prompts are being computed), and every answer still equals generate."""
    eng = Engine(str(tiny_checkpoint), num_kv_blocks=41, block_size=4, max_num_batched_tokens=64)
    reqs = [make_request(world, kinds, data_seed=90 + i, words=16, max_tokens=24)
            for i, kinds in enumerate(KINDS[:4]) for _ in range(2)]
    with eng._cv:
        seqs = [eng.submit(r[0]) for r in reqs]
    outs = [collect(s) for s in seqs]
    assert eng.scheduler.preemptions > 0 and eng.blocks.hit_tokens > 0
    assert_equal_generate(world, reqs, outs, eng.eos_ids)
    assert eng.blocks.computing == {} and eng.blocks.num_free == eng.blocks.usable_blocks


def test_a_cancelled_request_no_longer_holds_back_one_waiting_for_its_prefix(world, tiny_checkpoint):
    """The scheduler driven by hand (engine thread stopped): B waits while A is about to compute their
    shared prompt; A is cancelled before its step, and B is admitted and computes the prompt itself."""
    eng = Engine(str(tiny_checkpoint))
    eng.shutdown()
    a, b = (eng.submit(make_request(world, ["image"], data_seed=13, words=30, max_tokens=3)[0]) for _ in range(2))
    eng._inbox.clear()
    sched = eng.scheduler
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    assert plan.seqs == [a] and list(sched.waiting) == [b] and eng.blocks.computed_by(b) is a
    sched.remove(a)
    assert eng.blocks.computing == {} and eng.blocks.computed_by(b) is None
    plan = sched.schedule()
    assert plan.seqs == [b] and plan.num_tokens == [len(b)] and b.num_cached == 0


def test_a_request_that_breaks_admission_fails_alone_and_the_queue_moves_on(world, tiny_checkpoint, monkeypatch):
    """An unexpected error while the scheduler admits a request (nothing running yet) would recur at every
    step: that request fails with the error, once, and the requests behind it are served."""
    eng = Engine(str(tiny_checkpoint))
    bad_req = make_request(world, [], data_seed=1, words=3, max_tokens=3)[0]
    bad = list(bad_req.input_ids)
    real = eng.scheduler.schedule

    def schedule():
        if any(s.token_ids[:s.prompt_len] == bad for s in eng.scheduler.waiting):
            raise RuntimeError("admission bug")
        return real()

    monkeypatch.setattr(eng.scheduler, "schedule", schedule)
    try:
        with pytest.raises(RuntimeError, match="admission bug"):
            collect(eng.submit(bad_req))
        assert collect(eng.submit(make_request(world, [], data_seed=2, max_tokens=3)[0]))[1][-1].finish_reason == "length"
    finally:
        eng.shutdown()


def test_a_step_with_a_non_sampling_row_never_replays_a_decode_graph(world, engine):
    """A decode graph samples every row, and the engine maps a step's tokens to its sampling rows only, so
    a 1-token middle chunk of a prompt (a step's last budget token) must send the step down the eager path."""
    from app.llm.scheduler import StepPlan

    seqs = [engine.submit(make_request(world, [], data_seed=i, words=3, max_tokens=8)[0]) for i in range(2)]
    for s in seqs:
        collect(s)
    a, b = seqs  # finished: only their token lists and positions matter to graph_ready
    a.num_computed = len(a.token_ids) - 1  # its last token: a decode row that samples
    b.num_computed = 0  # the first of its many prompt tokens: a 1-token chunk that does not
    plan = StepPlan()
    plan.add(a, 1)
    assert engine.runner.graph_ready(plan)
    plan.add(b, 1)
    assert plan.decode_only and plan.sample == [True, False]
    assert not engine.runner.graph_ready(plan)


def test_seeded_sampling_is_the_same_alone_and_batched(world, engine):
    req = make_request(world, ["image"], temperature=0.9, top_p=0.95, top_k=50, seed=42, max_tokens=10)[0]
    alone = collect(engine.submit(req))[0]
    others = [engine.submit(make_request(world, k, data_seed=9 + i, temperature=1.0, max_tokens=12)[0])
              for i, k in enumerate(KINDS[:5])]
    batched = collect(engine.submit(req))[0]
    for s in others:
        collect(s)
    assert alone == batched
    runs = {tuple(collect(engine.submit(make_request(world, ["image"], temperature=1.5, seed=s)[0]))[0])
            for s in range(4)}
    assert len(runs) > 1


def test_top_k_one_is_greedy_and_penalties_change_the_output(world, engine):
    greedy = collect(engine.submit(make_request(world, [], max_tokens=16)[0]))[0]
    top1 = collect(engine.submit(make_request(world, [], max_tokens=16, temperature=1.0, top_k=1, seed=3)[0]))[0]
    assert top1 == greedy
    penal = collect(engine.submit(make_request(world, [], max_tokens=16, presence_penalty=2.0,
                                               frequency_penalty=2.0)[0]))[0]
    assert len(set(penal)) == len(penal)  # a strong penalty forbids repeats here


def _batch(rows, **kw):
    from app.llm.sampler import SamplingBatch

    def col(name, default, dtype):
        return torch.tensor([r.get(name, default) for r in rows], dtype=dtype)

    return SamplingBatch(col("t", 0.0, torch.float32), col("k", 0, torch.int32), col("p", 1.0, torch.float32),
                         col("seed", 0, torch.int64), col("step", 0, torch.int64), col("f", 0.0, torch.float32),
                         col("pr", 0.0, torch.float32), torch.arange(len(rows)), **kw)


def test_sampler_follows_openai_semantics():
    from app.llm.sampler import Sampler

    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 2.9]])
    s = Sampler(5, 4, torch.device("cpu"))
    assert s(logits, _batch([{}])).item() == 3
    s.reset_counts(0, [3])
    # presence: a flat 0.2 off token 3 -> 2.8 < 2.9
    assert s(logits, _batch([{"pr": 0.2}], any_penalty=True)).item() == 4
    # frequency: 0.05 per occurrence; once -> 2.95 still wins, three times -> 2.85 loses
    assert s(logits, _batch([{"f": 0.05}], any_penalty=True)).item() == 3
    s.reset_counts(0, [3, 3, 3])
    assert s(logits, _batch([{"f": 0.05}], any_penalty=True)).item() == 4
    # top_k=2 at any temperature only ever picks tokens 3 and 4; p(3) = 0.41, so top_p=0.4 keeps token 3 alone
    many = logits.expand(400, 5)
    rows = [{"t": 5.0, "k": 2, "seed": i} for i in range(400)]
    assert set(s(many, _batch(rows, all_greedy=False, max_top_k=2)).tolist()) == {3, 4}
    rows = [{"t": 1.0, "p": 0.4, "seed": i} for i in range(400)]
    assert set(s(many, _batch(rows, all_greedy=False, any_top_p=True)).tolist()) == {3}


def test_sampling_noise_is_strictly_inside_zero_one_so_removed_tokens_stay_removed():
    """The extreme bit patterns give noise strictly inside (0, 1) and a finite Gumbel, so a token at
    -inf (cut by top-k, top-p or a structured-output mask) stays at -inf. With the top 24 bits as
    before, all ones gave exactly 1.0: +inf Gumbel, NaN with -inf, and argmax picked the removed token."""
    from app.llm.sampler import unit_interval

    u = unit_interval(torch.tensor([-1, 0, 1 << 62, -(1 << 63)], dtype=torch.int64))
    assert bool(((u > 0) & (u < 1)).all()) and bool(torch.isfinite(-torch.log(-torch.log(u))).all())
    old = (((torch.tensor([-1]) >> 40) & ((1 << 24) - 1)).float() + 0.5) * (1.0 / (1 << 24))
    assert old.item() == 1.0 and torch.isnan(torch.tensor(float("-inf")) - torch.log(-torch.log(old))).item()


def test_top_p_of_one_keeps_every_token_beside_a_row_that_uses_top_p():
    """In a step where another row uses top_p, a row with top_p 1 keeps all 151,936 tokens (the float32
    cumsum ends above 1, which removed thousands of tail tokens), and a row with top_p 0.5 keeps the
    nucleus it should: the fewest most likely tokens whose probability reaches 0.5."""
    from app.llm.sampler import top_p_filter

    torch.manual_seed(0)
    x = torch.randn(1, 151936).expand(2, 151936) * 3
    out = top_p_filter(x, torch.tensor([1.0, 0.5]))
    assert bool(torch.isfinite(out[0]).all())
    p = torch.softmax(x[1].double(), -1).sort(descending=True).values
    need = int((p.cumsum(0) < 0.5).sum()) + 1
    assert int(torch.isfinite(out[1]).sum()) == need


def test_sampled_frequencies_follow_the_softmax():
    """4000 seeded draws from softmax([0, 1, 2, 3] / 0.7): counter-based noise, so the counts are fixed
    by the seeds; each frequency is within 2.5 points of its probability."""
    from app.llm.sampler import Sampler

    logits = torch.tensor([0.0, 1.0, 2.0, 3.0]).expand(4000, 4)
    rows = [{"t": 0.7, "seed": 1000 + i, "step": i % 7} for i in range(4000)]
    got = Sampler(4, 1, torch.device("cpu"))(logits, _batch(rows, all_greedy=False))
    freq = torch.bincount(got, minlength=4).float() / 4000
    assert (freq - torch.softmax(torch.tensor([0.0, 1.0, 2.0, 3.0]) / 0.7, 0)).abs().max() < 0.025


def test_a_cancelled_request_frees_its_blocks_within_a_step(world, tiny_checkpoint):
    engine = Engine(str(tiny_checkpoint))
    seq = engine.submit(make_request(world, ["image"], max_tokens=500, ignore_eos=True)[0])
    seq.next_chunk(timeout=60)
    assert engine.blocks.num_free < engine.blocks.usable_blocks
    seq.cancel()
    deadline = time.monotonic() + 30
    while seq in engine.running or engine.blocks.num_free != engine.blocks.usable_blocks:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    other = collect(engine.submit(make_request(world, [], max_tokens=3)[0]))
    assert other[1][-1].finish_reason
    from app.llm.stream import Cancelled

    with pytest.raises(Cancelled):
        while True:
            seq.next_chunk(timeout=5)


def test_full_queue_is_a_503_with_retry_after(tiny_checkpoint, world):
    small = Engine(str(tiny_checkpoint), max_num_seqs=1, max_waiting=1)
    # `first` cannot finish during the test (no EOS, thousands of tokens), so once admitted it holds the one slot
    first = small.submit(make_request(world, [], max_tokens=8000, ignore_eos=True)[0])
    deadline = time.monotonic() + 30
    while first not in small.running:
        assert time.monotonic() < deadline, "the scheduler never admitted the first request"
        time.sleep(0.001)
    small.submit(make_request(world, [], max_tokens=2)[0])  # the waiting queue takes one request
    with pytest.raises(ClientError) as e:
        small.submit(make_request(world, [], max_tokens=2)[0])
    assert e.value.status == 503 and e.value.headers["Retry-After"] == "1"
    first.cancel()


def test_short_of_room_means_waiting_for_a_slot_not_for_the_next_step(tiny_checkpoint, world):
    """Engine.short_of_room (the fused encoder's backlog signal): true while a request waits for the
    one sequence slot, false again once it is admitted; never true while requests only wait for the
    token budget of the next steps (plenty of slots and KV blocks)."""
    small = Engine(str(tiny_checkpoint), max_num_seqs=1)
    try:
        first = small.submit(make_request(world, [], max_tokens=8000, ignore_eos=True)[0])
        deadline = time.monotonic() + 30
        while first not in small.running:
            assert time.monotonic() < deadline, "the scheduler never admitted the first request"
            time.sleep(0.001)
        second = small.submit(make_request(world, [], max_tokens=2)[0])
        while not small.short_of_room():
            assert time.monotonic() < deadline, "a request waiting for the only slot was not reported"
            time.sleep(0.001)
        first.cancel()
        collect(second)  # admitted once the slot freed, then finished
        while small.short_of_room():
            assert time.monotonic() < deadline, "the backlog was still reported after it cleared"
            time.sleep(0.001)
    finally:
        small.shutdown()

    wide = Engine(str(tiny_checkpoint), max_num_seqs=8, max_num_batched_tokens=16)
    seen, done = set(), threading.Event()

    def watch():
        while not done.is_set():
            seen.add(wide.short_of_room())
            time.sleep(0.0002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        seqs = [wide.submit(make_request(world, [], words=40, max_tokens=2)[0]) for _ in range(4)]
        for seq in seqs:
            collect(seq)  # each prompt took several 16-token steps, the later ones waiting their turn
    finally:
        done.set()
        watcher.join()
        wide.shutdown()
    assert seen == {False}


def test_kv_memory_per_token_is_exactly_the_keys_and_values(tiny_checkpoint, world):
    eng = Engine(str(tiny_checkpoint), max_model_len=64, max_num_seqs=2, num_kv_blocks=9, block_size=8)
    s = eng.spec
    per_token = s.layers * 2 * s.kv_heads * s.head_dim * 4  # fp32 on the CPU
    kv = eng.runner.kv
    assert kv.numel() * kv.element_size() == 9 * 8 * per_token
    assert eng.stats()["kv_bytes_per_token"] == per_token
    with pytest.raises(ClientError) as e:
        eng.submit(make_request(world, ["image", "video"], words=80, max_tokens=4)[0])
    assert e.value.code == "context_length_exceeded"


# ---------------------------------------------------------------------------- GPU
def cuda_request(r):
    for v in r[0].vision:
        v.main, v.deepstack = v.main.cuda(), [d.cuda() for d in v.deepstack]
    return r


@pytest.mark.gpu
def test_graph_decode_equals_eager_decode_and_generate_on_gpu(tiny_checkpoint, world):
    """The tiny model in fp32 on CUDA (our Triton kernels, full-precision dots): decode replayed from
    CUDA graphs gives the same tokens as eager decode and as transformers' generate, for 8 concurrent
    requests of different lengths, chunked and with prefix hits."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    graphed = Engine(str(tiny_checkpoint), device="cuda", dtype="float32", max_model_len=512, max_num_seqs=8,
                     max_num_batched_tokens=64, num_kv_blocks=512)
    eager = Engine(str(tiny_checkpoint), device="cuda", dtype="float32", max_model_len=512, max_num_seqs=8,
                   cuda_graphs=False, num_kv_blocks=512)
    assert graphed.runner.graphs and graphed.runner.step_graphs and not eager.runner.graphs
    reqs = [cuda_request(r) for r in eight_requests(world)]
    outs_g = run_all(graphed, reqs)
    outs_e = run_all(eager, reqs)
    assert graphed.graph_steps > 0 and graphed.step_graph_steps > 0
    assert all(r[2] in ("decode", "step") for r in graphed.step_log)  # no step ran eagerly
    assert [o[0] for o in outs_g] == [o[0] for o in outs_e]
    assert_equal_generate(world, reqs, outs_g, graphed.eos_ids)
    again = run_all(graphed, reqs[:3])  # prefix-cache hits
    assert [o[0] for o in again] == [o[0] for o in outs_g[:3]] and graphed.blocks.hit_tokens > 0


@pytest.mark.gpu
def test_step_graphs_give_the_eager_steps_log_probabilities_on_gpu(tiny_checkpoint, world):
    """Prefill chunks beside decodes, with image and video rows (deepstack features), replayed from step
    graphs on padded layouts: the same tokens as eager steps, and every token's log-probabilities
    (chosen and top 5) equal within 1e-5 in fp32."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    kw = dict(device="cuda", dtype="float32", max_model_len=512, max_num_seqs=8, max_num_batched_tokens=48,
              num_kv_blocks=512)
    graphed, eager = Engine(str(tiny_checkpoint), **kw), Engine(str(tiny_checkpoint), cuda_graphs=False, **kw)
    assert graphed.runner.step_buckets == [16, 32, 48]
    reqs = [cuda_request(make_request(world, kinds, data_seed=i, words=i, max_tokens=5 + i, logprobs=5))
            for i, kinds in enumerate(KINDS)]
    outs_g, outs_e = run_all(graphed, reqs), run_all(eager, reqs)
    assert graphed.step_graph_steps > 0 and all(r[2] in ("decode", "step") for r in graphed.step_log)
    assert [o[0] for o in outs_g] == [o[0] for o in outs_e]
    worst = 0.0
    for (_, cg), (_, ce) in zip(outs_g, outs_e):
        for a, b in zip([e for c in cg for e in c.logprobs or []], [e for c in ce for e in c.logprobs or []]):
            assert a[1] == b[1]
            worst = max(worst, abs(a[0] - b[0]), *(abs(x - y) for x, y in zip(a[2], b[2])))
    assert worst <= 1e-5, worst
    graphed.shutdown()
    eager.shutdown()


@pytest.mark.gpu
def test_engine_steps_run_no_sdpa_and_no_cudnn_attention(tiny_checkpoint, world):
    """Prefill shapes change with every step; cuDNN's attention would build a plan for each (up to 1 s
    on an H200). The engine's attention is its own Triton kernel: no SDPA call at all."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    eng = Engine(str(tiny_checkpoint), device="cuda", dtype="bfloat16", max_model_len=256, max_num_seqs=4,
                 cuda_graphs=False, num_kv_blocks=64)
    reqs = [cuda_request(make_request(world, k, data_seed=i, words=3 * i, max_tokens=4)) for i, k in
            enumerate(KINDS[:4])]
    eng.shutdown()  # the profiler sees only its own thread: run the steps here
    seqs = [eng.submit(r[0]) for r in reqs]
    for s in seqs:
        eng.scheduler.add(s)
    eng._inbox.clear()

    def steps():
        with torch.inference_mode():
            while eng.scheduler.has_work():
                eng._step()

    sdpa, cudnn = attention_calls(steps)
    assert sdpa == 0 and cudnn == 0 and eng.steps > 0 and all(len(s.output_ids) or s.finish_reason is None
                                                                for s in seqs)


def forward_logits(eng, ids):
    """Our forward's logits at every position of one sequence, on a throw-away cache (GPU)."""
    from app.llm.attention import AttentionMetadata, block_q_for, work_table

    dev, s, bs, n = eng.device, eng.spec, 16, len(ids)
    blocks = -(-n // bs)
    kv = torch.zeros(s.layers, 2, (blocks + 1) * bs, s.kv_heads, s.head_dim, dtype=eng.dtype, device=dev)
    table = torch.zeros(2, blocks, dtype=torch.int32, device=dev)
    table[0] = torch.arange(1, blocks + 1)

    def i32(a):
        return torch.tensor(a, dtype=torch.int32, device=dev)

    bq = block_q_for(s.heads // s.kv_heads, 64)
    ws, w0 = work_table(np.array([n], dtype=np.int32), bq)
    meta = AttentionMetadata(i32([0, n]), i32([n]), i32([0]), table, i32(ws), i32(w0), bq, bs)
    with torch.inference_mode():
        h = eng.model(i32(ids), torch.arange(n, dtype=torch.int32, device=dev), torch.arange(n, device=dev,
                      dtype=torch.int32) + bs, kv, meta)
        return eng.model.logits(h).float()


@pytest.mark.gpu
def test_2b_shape_greedy_equals_transformers_generate_in_bf16():
    """The Qwen3-VL-2B shape with random weights in bf16: our engine (Triton kernels, paged KV, CUDA
    graphs) against transformers' generate.

    Two bf16 forwards with different kernels cannot agree on near-ties: here transformers' bf16 logits
    are 0.10-0.15 from its own fp32 logits, and one bf16 step at 4.0 is 0.03 (measured on an H200:
    five prompts left transformers' output at tokens 2-12, each where its top two logits were 0-0.03
    apart, and its fp32 model preferred our token in three). So:
    - the tokens are equal until transformers' top two logits come within 0.05;
    - on transformers' output, teacher-forced, our logits are no further from the fp32 model's than
      transformers' bf16 logits are (within 20%)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import copy

    from transformers import AutoConfig, Qwen3VLForConditionalGeneration

    from app.checkpoints.model_builder import build_tokenizer, load_preset
    from app.llm.sampling import SamplingParams
    from app.llm.sequence import GenerationRequest

    cfg = AutoConfig.for_model(**load_preset("qwen3-vl-2b"))
    cfg.text_config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3VLForConditionalGeneration._from_config(cfg, dtype=torch.bfloat16).eval()
    model.model.visual = None
    truth = copy.deepcopy(model).float()
    eng = Engine.from_model(model, build_tokenizer(), "cuda", max_model_len=1024, max_num_seqs=8, num_kv_blocks=512)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 150000, n).tolist() for n in (7, 64, 333, 20, 100)]  # below the vision ids
    seqs = [eng.submit(GenerationRequest(p, [0] * len(p), [], SamplingParams(max_tokens=16, temperature=0,
                                                                             ignore_eos=True))) for p in prompts]
    matched = 0
    for p, s in zip(prompts, seqs):
        got = collect(s)[0]
        ids = torch.tensor([p], device="cuda")
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                             min_new_tokens=16, do_sample=False, output_logits=True, return_dict_in_generate=True)
        want = out.sequences[0, len(p):].tolist()
        for i, (a, b) in enumerate(zip(got, want)):
            top2 = out.logits[i][0].float().topk(2).values
            if top2[0] - top2[1] < 0.05:
                break
            assert a == b, (len(p), i)
            matched += 1
        full = p + want
        with torch.no_grad():
            ref = truth(input_ids=torch.tensor([full], device="cuda")).logits[0, len(p) - 1:-1].float()
            theirs = model(input_ids=torch.tensor([full], device="cuda")).logits[0, len(p) - 1:-1].float()
        ours = forward_logits(eng, full)[len(p) - 1:-1]
        assert (ours - ref).abs().max() <= 1.2 * (theirs - ref).abs().max(), len(p)
    assert matched >= 5  # well-conditioned steps were compared


def test_engine_thread_survives_a_failing_step(world, tiny_checkpoint, monkeypatch):
    """A step that raises fails the requests in it with that error, and the next requests are served."""
    eng = Engine(str(tiny_checkpoint))
    calls = {"n": 0}
    real = eng.runner.launch

    def flaky(plan, previous=None):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("device fault")
        return real(plan, previous)

    monkeypatch.setattr(eng.runner, "launch", flaky)
    with pytest.raises(RuntimeError, match="device fault"):
        collect(eng.submit(make_request(world, [], max_tokens=3)[0]))
    assert collect(eng.submit(make_request(world, [], max_tokens=3)[0]))[1][-1].finish_reason
    assert threading.active_count() > 0


def test_overlapped_steps_really_overlap_and_give_the_synchronous_tokens(world, tiny_checkpoint, overlap):
    """Seeded sampling with penalties, greedy decoding, a prefill chunked beside decodes: the tokens of
    overlapped steps equal the synchronous engine's, and in overlap mode a step is launched before
    the previous one's tokens are read (in sync mode never)."""
    reqs = [make_request(world, k, data_seed=70 + i, words=i, max_tokens=5 + i, temperature=0.8 * (i % 2),
                         seed=i, frequency_penalty=0.5 * (i % 3 == 0))
            for i, k in enumerate(KINDS)]
    sync = engine_module.Engine(str(tiny_checkpoint), max_num_batched_tokens=32, block_size=8, overlap_steps=False)
    eng = Engine(str(tiny_checkpoint), max_num_batched_tokens=32, block_size=8)
    uncollected, ahead = [], []
    launch, collect_step = eng.runner.launch, eng.runner.collect

    def spy_launch(plan, previous=None):
        ahead.append(len(uncollected))
        step = launch(plan, previous)
        uncollected.append(step)
        return step

    def spy_collect(step):
        uncollected.remove(step)
        return collect_step(step)

    eng.runner.launch, eng.runner.collect = spy_launch, spy_collect
    want = [o[0] for o in run_all(sync, reqs)]
    got = run_all(eng, reqs)
    assert [o[0] for o in got] == want
    assert [o[1][-1].finish_reason for o in got] == ["length"] * len(reqs)
    assert (max(ahead) == 1) if overlap else (max(ahead) == 0)
    assert eng.blocks.num_free == eng.blocks.usable_blocks and not uncollected


def test_a_stop_token_mid_flight_ends_the_request_there(world, tiny_checkpoint, overlap):
    """A request that samples an end-of-sequence token stops right before it, even though (overlapped)
    its next step was already queued: that step's token is never emitted, and its blocks come back."""
    reqs = eight_requests(world, seed=80, max_tokens=10)
    eng = Engine(str(tiny_checkpoint), block_size=4)
    free = [o[0] for o in run_all(eng, reqs)]
    stop = free[0][3]  # the first request's fourth token becomes a stop token
    eng.eos_ids = eng.eos_ids | {stop}
    outs = run_all(eng, reqs)
    for (got, chunks), full in zip(outs, free):
        cut = full.index(stop) if stop in full else len(full)
        assert got == full[:cut]
        assert chunks[-1].finish_reason == ("stop" if stop in full else "length")
    assert eng.blocks.num_free == eng.blocks.usable_blocks and not eng.running


@pytest.mark.gpu
def test_step_inputs_are_not_rewritten_before_their_copy_has_run():
    """The engine's pinned step-input buffers come in pairs; a third step's inputs reuse the first's buffer.
    With the stream held up (as by a long forward), that reuse must wait for the first copy: steps that
    sample nothing (a prompt's middle chunks) are never waited on otherwise. Each step's device view is
    cloned in stream order, as the step's kernels read it; every clone must hold its own step's data."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from app.llm.step_inputs import StepInputs

    inputs = StepInputs(torch.device("cuda"), 4096)
    torch.cuda._sleep(200_000_000)  # about 0.1 s of one busy kernel ahead of the copies
    steps = [np.arange(1000, dtype=np.int32) + 10_000 * i for i in range(4)]
    seen = [inputs.pack({"ids": a})["ids"].clone() for a in steps]
    torch.cuda.synchronize()
    for a, got in zip(steps, seen, strict=True):
        assert np.array_equal(got.cpu().numpy(), a)
