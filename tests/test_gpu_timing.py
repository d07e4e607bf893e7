"""GPU time per request (issue 45): app/gpu/timing.py's event timer with fake events and a fake clock
(exact totals, unfinished events never read, the bound on pending pairs, the event pool, interleaved
brackets, the host-clock fallback); the engine's and the tower's counters on the CPU with the tiny
model; the replicas' merge and the Prometheus series; goodput.py's per-request arithmetic from two
stats snapshots; and, on a GPU, the timer against a synchronised measurement."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from aiohttp import web

from app.gpu.timing import CUDA_EVENTS, HOST_CLOCK, GpuTimer
from netfakes import serve_aiohttp


# ---------------------------------------------------------------------------- fakes
class FakeStream:
    def __init__(self, ident: int = 0, device_index: int = 0):
        self.cuda_stream, self.device_index = ident, device_index


class FakeGpu:
    """Hands out events; the test decides when each has passed and at what device time (ms)."""

    def __init__(self):
        self.created: list[FakeEvent] = []
        self.recorded: list[FakeEvent] = []  # every record, in order (an event may come back)
        self.reads = 0

    def event(self) -> FakeEvent:
        ev = FakeEvent(self)
        self.created.append(ev)
        return ev

    def finish(self, *times_ms: float) -> None:
        """The oldest records not passed yet pass, at these device times."""
        waiting = [e for e in self.recorded if not e.done]
        seen: list[FakeEvent] = []
        for ev in waiting:  # an event recorded twice counts once, as its latest record
            if ev not in seen:
                seen.append(ev)
        for ev, t in zip(seen, times_ms, strict=False):
            ev.done, ev.t = True, t


class FakeEvent:
    def __init__(self, gpu: FakeGpu):
        self.gpu, self.done, self.t, self.stream = gpu, False, None, None

    def record(self, stream) -> None:
        self.done, self.t, self.stream = False, None, stream
        if self in self.gpu.recorded:
            self.gpu.recorded.remove(self)
        self.gpu.recorded.append(self)

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.done and end.done, "an unfinished event was read"
        assert self.stream is end.stream
        self.gpu.reads += 1
        return end.t - self.t


def fake_timer(gpu: FakeGpu, stream=None, **kw) -> GpuTimer:
    stream = stream or FakeStream()
    return GpuTimer(new_event=gpu.event, current_stream=lambda: stream, **kw)


def bracket(timer: GpuTimer) -> None:
    timer.stop(timer.start())


# ---------------------------------------------------------------------------- the timer
def test_the_total_is_the_sum_of_the_elapsed_times():
    gpu = FakeGpu()
    timer = fake_timer(gpu)
    for _ in range(3):
        bracket(timer)
    assert gpu.reads == 0  # nothing has passed: nothing read, nothing waited for
    gpu.finish(0.0, 1.5, 2.0, 4.25, 5.0, 5.125)  # (start, end) of each bracket, in order
    snap = timer.snapshot("engine", "steps")
    assert snap == {"engine_gpu_ms_total": 1.5 + 2.25 + 0.125, "engine_timed_steps": 3, "engine_gpu_interleaved": 0,
                    "engine_gpu_dropped": 0, "engine_gpu_pending": 0, "engine_gpu_clock": CUDA_EVENTS}
    assert snap["engine_gpu_ms_total"] == 3.875 and gpu.reads == 3


def test_unfinished_events_are_not_read_and_pairs_resolve_in_order():
    gpu = FakeGpu()
    timer = fake_timer(gpu)
    bracket(timer)
    bracket(timer)
    first_start, first_end, second_start, second_end = gpu.recorded
    second_start.done, second_start.t = True, 10.0  # the second's start passed, its end not
    second_end.done, second_end.t = False, None
    first_start.done, first_start.t = True, 0.0  # the first has started only
    s = timer.snapshot("x")
    assert (s["x_timed_steps"], s["x_gpu_pending"], gpu.reads) == (0, 2, 0)
    first_end.done, first_end.t = True, 2.0
    s = timer.snapshot("x")
    assert (s["x_timed_steps"], s["x_gpu_ms_total"], s["x_gpu_pending"], gpu.reads) == (1, 2.0, 1, 1)
    second_end.done, second_end.t = True, 13.5
    bracket(timer)  # a stop resolves what has passed, too
    assert (timer.count, timer.ms_total, gpu.reads) == (2, 5.5, 2)


def test_pending_pairs_are_bounded_dropped_and_counted():
    gpu = FakeGpu()
    timer = fake_timer(gpu, max_pending=4)
    for _ in range(6):
        bracket(timer)
    s = timer.snapshot("e")
    assert (s["e_gpu_pending"], s["e_gpu_dropped"], s["e_timed_steps"]) == (4, 2, 0)
    assert len(gpu.created) == 9  # 4 pairs, and one start event that the dropped brackets shared
    gpu.finish(*range(8))
    s = timer.snapshot("e")
    assert (s["e_gpu_pending"], s["e_gpu_dropped"], s["e_timed_steps"], s["e_gpu_ms_total"]) == (0, 2, 4, 4.0)


def test_events_are_reused_once_read():
    gpu = FakeGpu()
    timer = fake_timer(gpu)
    for k in range(100):
        bracket(timer)
        gpu.finish(2.0 * k, 2.0 * k + 0.5)
    assert timer.snapshot("e")["e_timed_steps"] == 100 and timer.ms_total == 50.0
    assert len(gpu.created) <= 4


def test_a_failed_bracket_is_not_counted_and_a_capturing_stream_is_not_timed():
    gpu = FakeGpu()
    timer = fake_timer(gpu)
    with pytest.raises(RuntimeError), timer.timed():
        raise RuntimeError("the step failed")
    timer.cancel(timer.start())
    with timer.timed():
        pass
    gpu.finish(1.0, 4.0, 10.0, 11.0, 20.0, 23.0)
    assert timer.snapshot("e")["e_timed_steps"] == 1
    capturing = fake_timer(gpu, capturing=lambda: True)
    before = len(gpu.recorded)
    assert capturing.start() is None
    capturing.stop(None)
    capturing.cancel(None)
    assert len(gpu.recorded) == before and capturing.snapshot("c")["c_timed_steps"] == 0


def test_brackets_that_overlap_on_one_stream_are_counted_on_both_timers():
    """The fused tower on the engine's stream: each bracket may hold part of the other's work."""
    gpu, shared = FakeGpu(), FakeStream(0)
    engine, tower = fake_timer(gpu, shared), fake_timer(gpu, shared)
    e = engine.start()
    t = tower.start()
    tower.stop(t)
    engine.stop(e)  # the tower's batch was queued inside the engine's step
    bracket(engine)  # one after the other: not overlapping
    bracket(tower)
    other = fake_timer(gpu, FakeStream(7))  # a stream of its own
    o = other.start()
    bracket(engine)
    other.stop(o)
    gpu.finish(*range(len(gpu.recorded)))
    assert engine.snapshot("engine")["engine_gpu_interleaved"] == 1
    assert tower.snapshot("encoder", "batches")["encoder_gpu_interleaved"] == 1
    assert other.snapshot("o")["o_gpu_interleaved"] == 0
    assert engine.count == 3 and tower.count == 2


def test_without_cuda_the_host_clock_times_the_call():
    ticks = iter([1.0, 1.25, 3.0, 3.5])
    timer = GpuTimer("cpu", clock=lambda: next(ticks))
    with timer.timed():
        pass
    bracket(timer)
    s = timer.snapshot("encoder", "batches")
    assert s == {"encoder_gpu_ms_total": 750.0, "encoder_timed_batches": 2, "encoder_gpu_interleaved": 0,
                 "encoder_gpu_dropped": 0, "encoder_gpu_pending": 0, "encoder_gpu_clock": HOST_CLOCK}
    assert GpuTimer().source == HOST_CLOCK  # no device: the CPU


# ---------------------------------------------------------------------------- the engine and the tower
def _settled(engine, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if engine._inflight is None and not engine.running and not engine.scheduler.waiting:
            time.sleep(0.05)
            return
        time.sleep(0.01)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_engine_times_every_step_it_runs(tiny_checkpoint, device):
    from app.llm.engine import Engine
    from app.llm.sampling import SamplingParams
    from app.llm.sequence import GenerationRequest

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    eng = Engine(str(tiny_checkpoint), device, num_kv_blocks=256)
    try:
        assert eng.gpu_time()["engine_timed_steps"] == 0
        prompts = [eng.tokenizer.encode(" ".join(["word"] * n)) for n in (5, 17, 40)]
        seqs = [eng.submit(GenerationRequest(p, [0] * len(p), [], SamplingParams(max_tokens=6, temperature=0,
                                                                                 ignore_eos=True)))
                for p in prompts]
        for s in seqs:
            while not s.next_chunk().finish_reason:
                pass
        _settled(eng)
        if device == "cuda":
            torch.cuda.synchronize()
        stats = eng.stats()
        assert stats["steps"] >= 6
        assert stats["engine_timed_steps"] == stats["steps"] and stats["engine_gpu_dropped"] == 0
        assert stats["engine_gpu_ms_total"] > 0 and stats["engine_gpu_pending"] == 0
        assert stats["engine_gpu_clock"] == (CUDA_EVENTS if device == "cuda" else HOST_CLOCK)
        assert set(eng.gpu_time()) <= set(stats)
    finally:
        eng.shutdown()


def test_the_tower_times_every_batch_on_the_cpu(tiny_checkpoint):
    from app.config import AppConfig
    from app.vision.service import EncoderService

    cfg = AppConfig(model=str(tiny_checkpoint), encoder={"token_budgets": [64, 128, 256], "max_items_per_batch": 4,
                                                         "batch_wait_ms": 20})
    service = EncoderService(cfg, str(tiny_checkpoint))
    g = torch.Generator().manual_seed(0)
    items = [(torch.randint(0, 256, (t * h * w, 1536), generator=g, dtype=torch.uint8).numpy(), (t, h, w), f"k{i}")
             for i, (t, h, w) in enumerate([(1, 4, 4), (1, 8, 4), (2, 4, 4)])]

    async def run():
        return await asyncio.gather(*(service.encode_async([it]) for it in items))

    asyncio.run(run())
    service.encode([(px, grid) for px, grid, _ in items[:1]])  # the synchronous path counts as a batch too
    s = service.stats()
    assert s["batches"] >= 1 and s["encoder_timed_batches"] == s["batches"] + 1
    assert s["encoder_gpu_ms_total"] > 0 and s["encoder_gpu_clock"] == HOST_CLOCK


# ---------------------------------------------------------------------------- merged and exported
def test_replicas_gpu_counters_are_summed_and_exported():
    from app.serving.prometheus import scrape_text
    from app.serving.replica_stats import merge_encoder_stats, merge_llm_loads

    loads = merge_llm_loads([
        {"replica": "b", "running": 1, "kv_usage": 0.1, "engine_gpu_ms_total": 250.0, "engine_timed_steps": 40,
         "engine_gpu_clock": CUDA_EVENTS, "engine_gpu_interleaved": 3},
        {"replica": "a", "running": 0, "kv_usage": 0.1, "engine_gpu_ms_total": 1250.5, "engine_timed_steps": 60,
         "engine_gpu_clock": CUDA_EVENTS, "engine_gpu_dropped": 1}])
    assert (loads["engine_gpu_ms_total"], loads["engine_timed_steps"]) == (1500.5, 100)
    assert (loads["engine_gpu_interleaved"], loads["engine_gpu_dropped"]) == (3, 1)
    assert loads["engine_gpu_clock"] == CUDA_EVENTS and [r["replica"] for r in loads["replicas"]] == ["a", "b"]
    assert merge_llm_loads([{"running": 0}])["engine_gpu_clock"] is None
    enc = merge_encoder_stats([{"batches": 2, "encoder_gpu_ms_total": 3.5, "encoder_timed_batches": 2,
                                "encoder_gpu_clock": HOST_CLOCK},
                               {"batches": 1, "encoder_gpu_ms_total": 1.0, "encoder_timed_batches": 1,
                                "encoder_gpu_clock": CUDA_EVENTS}])
    assert (enc["encoder_gpu_ms_total"], enc["encoder_timed_batches"]) == (4.5, 3)
    assert enc["encoder_gpu_clock"] == "cuda_events,host_clock"

    snap = {"load": {"running": 1, "engine_gpu_ms_total": 1500.0}, "encoder": {"batches": 2,
                                                                                 "encoder_gpu_ms_total": 250.0}}
    body = scrape_text(([snap, {"load": {"engine_gpu_ms_total": 500.0}}], 0), None, "tiny")[0].decode()
    values = {line.split(" ")[0].split("{")[0]: float(line.rsplit(" ", 1)[1])
              for line in body.splitlines() if line and not line.startswith("#")}
    assert values["vlm:engine_gpu_seconds_total"] == 2.0
    assert values["vlm:encoder_gpu_seconds_total"] == 0.25


# ---------------------------------------------------------------------------- goodput's arithmetic
def test_goodput_gpu_time_per_request_from_two_snapshots():
    from benchmarks.goodput import cpu_cell, gpu_cell, gpu_per_request, gpu_totals

    def llm(a: float, b: float, steps: tuple[int, int]) -> dict:
        return {"running": 3, "engine_gpu_ms_total": a + b, "replicas": [
            {"replica": "x", "engine_gpu_ms_total": a, "engine_timed_steps": steps[0], "engine_gpu_clock": CUDA_EVENTS},
            {"replica": "y", "engine_gpu_ms_total": b, "engine_timed_steps": steps[1], "engine_gpu_clock": CUDA_EVENTS,
             "engine_gpu_interleaved": 2}]}

    enc0 = {"batches": 10, "encoder_gpu_ms_total": 100.0, "encoder_timed_batches": 10, "encoder_gpu_clock": CUDA_EVENTS}
    enc1 = {"batches": 30, "encoder_gpu_ms_total": 160.0, "encoder_timed_batches": 30, "encoder_gpu_clock": CUDA_EVENTS}
    start = {**gpu_totals(enc0), **gpu_totals(llm(1000.0, 500.0, (100, 50)))}
    end = {**gpu_totals(enc1), **gpu_totals(llm(1600.0, 1100.0, (160, 140)))}
    assert start["engine_gpu_ms_total"] == 1500.0 and start["engine_timed_steps"] == 150
    assert end["engine_gpu_clock"] == CUDA_EVENTS and end["engine_gpu_interleaved"] == 2
    g = gpu_per_request(start, end, completions=40)
    assert g["engine"] == {"gpu_ms": 1200.0, "steps": 150, "ms_per_request": 30.0, "ms_per_step": 8.0,
                           "steps_per_request": 3.75, "interleaved": 0, "dropped": 0, "clock": CUDA_EVENTS}
    assert g["encoder"] == {"gpu_ms": 60.0, "batches": 20, "ms_per_request": 1.5, "ms_per_batch": 3.0,
                            "batches_per_request": 0.5, "interleaved": 0, "dropped": 0, "clock": CUDA_EVENTS}
    assert gpu_per_request(start, end, 0)["engine"]["ms_per_request"] is None
    assert gpu_per_request({}, end, 40) == {}  # the start was not read: nothing measured
    assert gpu_per_request(gpu_totals({"running": 0, "replicas": []}), gpu_totals(None), 5) == {}
    assert gpu_cell({"gpu_time": g}) == "30.00, 1.50"
    assert gpu_cell({"gpu_time": {"engine": {**g["engine"], "interleaved": 4, "clock": HOST_CLOCK}}}) == \
        "30.00*, - (host clock)"
    assert gpu_cell({}) == "-, -"
    assert cpu_cell({"Router": {"processes": 2, "cores": 0.4}, "LLM": {"processes": 1, "cores": 1.05}}) == \
        "LLM 1.05 (1), Router 0.40 (2)"
    assert cpu_cell(None) == "-"


def test_goodput_reads_the_counters_at_the_windows_edges(tmp_path):
    """watch_window against a fake server whose counters move only between the window's two reads of
    /v1/encoder/stats (the LLM's are read right after each): the deltas are exact, the GPU time's and the
    garbage collector's."""
    from benchmarks.goodput import gpu_per_request, summary_lines, watch_window

    calls = {"enc": 0}

    async def enc(request):
        calls["enc"] += 1
        return web.json_response({"batches": 4 * calls["enc"], "encoder_gpu_ms_total": 7.5 * calls["enc"],
                                  "encoder_timed_batches": 4 * calls["enc"], "encoder_gpu_clock": CUDA_EVENTS})

    async def load(request):
        k = calls["enc"]
        return web.json_response({"running": 0, "waiting": 0, "kv_usage": 0.0, "num_replicas": 1, "replicas": [
            {"replica": "r", "engine_gpu_ms_total": 100.0 * k, "engine_timed_steps": 20 * k,
             "engine_gpu_clock": CUDA_EVENTS,
             "gc": {"collections": [9 * k, 3 * k, k], "pause_ms_total": [1.0 * k, 2.0 * k, 50.0 * k],
                    "pause_ms_max": [0.5, 1.0, 60.0], "frozen_objects": 1000}}]})

    app = web.Application()
    app.router.add_get("/v1/encoder/stats", enc)
    app.router.add_get("/v1/llm/load", load)
    for url in serve_aiohttp(app):
        t0 = time.perf_counter()
        out = asyncio.run(watch_window(url, t0, 0.05, 0.3, monitor=False))
    assert out["gpu_ms"] == {"encoder_gpu_ms_total": 7.5, "engine_gpu_ms_total": 100.0}
    assert out["gc"] == {"full_collections": 1, "full_pause_ms": 50.0, "longest_full_pause_ms_so_far": 60.0,
                         "frozen_objects": 1000, "replicas": 1}
    g = gpu_per_request(out["gpu_totals"]["start"], out["gpu_totals"]["end"], completions=5)
    assert g["engine"]["ms_per_request"] == 20.0 and g["engine"]["steps_per_request"] == 4.0
    assert g["encoder"]["ms_per_request"] == 1.5 and g["encoder"]["ms_per_batch"] == 1.875
    point = {"rate": 5, "offered_rps": 5.0, "served_rps": 5.0, "served_ratio": 1.0, "errors": {}, "passes": True,
             "ttft_ms": {"p50": 10, "p99": 20}, "tpot_ms": {"p50": 1.0, "p99": 2.0}, "server": out, "gpu_time": g}
    lines = summary_lines({"workloads": {"image": {"ttft_p99_bound_ms": 200, "search": {"goodput": 5,
                                                                                          "points": [point]}}}})
    assert "| 20.00, 1.50 |" in lines[2] and "| 1, 50 | yes |" in lines[2]
    assert lines[0].count("|") == lines[1].count("|") == lines[2].count("|") == lines[3].count("|")


# ---------------------------------------------------------------------------- on a GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_timer_waits_for_nothing_and_matches_a_synchronised_measurement():
    dev = torch.device("cuda")
    timer = GpuTimer(dev)
    assert timer.source == CUDA_EVENTS
    a = torch.randn(2048, 2048, device=dev)

    def work():
        for _ in range(20):
            a.matmul(a)

    work()
    torch.cuda.synchronize()
    # the reference: the same work bracketed by events and waited for (the tower auto-tune's timer)
    from app.gpu.kernel_timing import cuda_times_ms

    ref_ms = sorted(cuda_times_ms(work, runs=5, warmup=0))[2]
    # a long kernel first: the snapshot must come back before it ends, the bracket pending
    torch.cuda._sleep(200_000_000)
    with timer.timed():
        work()
    t = time.perf_counter()
    s = timer.snapshot("t")
    assert time.perf_counter() - t < 0.05 and s["t_timed_steps"] == 0 and s["t_gpu_pending"] == 1
    torch.cuda.synchronize()
    for _ in range(4):
        with timer.timed():
            work()
    torch.cuda.synchronize()
    s = timer.snapshot("t")
    assert s["t_timed_steps"] == 5 and s["t_gpu_pending"] == 0 and s["t_gpu_dropped"] == 0
    per = s["t_gpu_ms_total"] / 5
    assert 0.7 * ref_ms <= per <= 1.5 * ref_ms, (per, ref_ms)
