"""benchmarks/goodput.py and benchmarks/workloads.py: seeded arrivals (rate and burstiness), the realistic
mix (proportions, ranges, bodies the app's own parser accepts), the steady-window arithmetic, the goodput
search, the cold-start and scale-up summaries on synthetic results, then whole sweeps against a fake streaming server
(a known capacity) and against the real application with the tiny model on the CPU."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from aiohttp import web

from benchmarks.goodput import (
    Sent,
    analyse,
    cold_summary,
    gpu_totals,
    host_text,
    main,
    per_second,
    replica_balance,
    scale_up_options,
    scale_up_summary,
    search_goodput,
    startup_durations,
    status_of,
    verdict,
    window_for,
    workload_ramp_s,
)
from benchmarks.serve import Result, file_config
from benchmarks.workloads import MixWorkload, arrival_times, describe
from netfakes import serve_aiohttp

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------- arrivals
def _gaps(t: np.ndarray) -> np.ndarray:
    return np.diff(np.concatenate([[0.0], t]))


def test_poisson_arrivals_have_the_rate_and_a_cv_of_one():
    t = arrival_times(50.0, 2000.0, "poisson", seed=3)
    assert len(t) / 2000.0 == pytest.approx(50.0, rel=0.015)
    g = _gaps(t)
    assert g.std() / g.mean() == pytest.approx(1.0, abs=0.02)
    assert t.min() >= 0 and t.max() < 2000.0 and np.all(np.diff(t) >= 0)
    counts = np.histogram(t, bins=400, range=(0, 2000))[0]  # 5 s windows: variance / mean = 1 for Poisson
    assert counts.var() / counts.mean() == pytest.approx(1.0, abs=0.2)


def test_gamma_arrivals_are_bursty_at_the_same_rate():
    t = arrival_times(50.0, 2000.0, "gamma", cv=2.0, seed=3)
    assert len(t) / 2000.0 == pytest.approx(50.0, rel=0.03)
    g = _gaps(t)
    assert g.std() / g.mean() == pytest.approx(2.0, rel=0.05)
    counts = np.histogram(t, bins=400, range=(0, 2000))[0]  # a renewal process: about cv^2
    assert counts.var() / counts.mean() == pytest.approx(4.0, rel=0.25)


def test_arrivals_are_seeded():
    a, b = arrival_times(20.0, 10.0, seed=1), arrival_times(20.0, 10.0, seed=1)
    assert np.array_equal(a, b) and not np.array_equal(a, arrival_times(20.0, 10.0, seed=2))
    assert np.array_equal(arrival_times(20.0, 10.0, "gamma", cv=1.0, seed=1), a)  # cv 1 is Poisson
    assert len(arrival_times(0.0, 10.0)) == 0
    with pytest.raises(ValueError):
        arrival_times(1.0, 1.0, "uniform")


# ---------------------------------------------------------------------------- the mix
def test_the_mix_has_its_declared_proportions_and_ranges():
    d = describe(MixWorkload(), 20000)
    assert d["kinds"]["video"] == pytest.approx(0.2, abs=0.01)
    assert d["kinds"]["images"] == pytest.approx(0.1, abs=0.01)
    assert d["kinds"]["image"] == pytest.approx(0.7, abs=0.015)
    lo, median, hi = d["image_long_side"]
    assert 256 <= lo < 280 and 1580 < hi <= 1600 and 850 < median < 1000
    assert 0.3 < d["portrait_share"] < 0.45  # half of the non-square ones (a quarter are square)
    assert d["video_frames"] == [4, 32] and d["video_long_side"] == [224, 448]
    assert d["prompt_words"][0] == 16 and d["prompt_words"][2] == 512 and 70 < d["prompt_words"][1] < 110
    lo, median, p99, hi = d["max_tokens"]
    assert lo >= 4 and hi == 512 and 60 <= median <= 68 and p99 > 300


def test_mix_bodies_are_valid_requests_with_the_drawn_media():
    """Bodies parse with the app's own request parser, and their media decode to the drawn shapes."""
    import av
    from PIL import Image

    from app.api.schemas import parse_chat_request

    mix = MixWorkload()
    kinds = {}
    for i in range(60):
        kinds.setdefault(mix.draw(i)["kind"], i)
    assert set(kinds) == {"image", "images", "video"}
    seen = set()
    for i in sorted(kinds.values()):
        shape, body = mix.draw(i), mix.body(i)
        json.dumps(body)
        req = parse_chat_request(body, default_max_tokens=256, max_items=16)
        assert req.stream and req.include_usage and req.params.ignore_eos
        assert req.params.max_tokens == shape["max_tokens"]
        parts = body["messages"][0]["content"]
        assert len(parts[-1]["text"].split()) == shape["prompt_words"]
        assert len(req.media) == len(shape["images"]) + (shape["video"] is not None)
        for part, (w, h) in zip(parts, shape["images"]):
            data = base64.b64decode(part["image_url"]["url"].split(",", 1)[1])
            img = Image.open(io.BytesIO(data))
            assert img.format == "JPEG" and img.size == (w, h)
            seen.add(img.tobytes()[:4096])
        if shape["video"] is not None:
            frames, w, h = shape["video"]
            data = base64.b64decode(parts[0]["video_url"]["url"].split(",", 1)[1])
            with av.open(io.BytesIO(data)) as c:
                decoded = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
            assert len(decoded) == frames and decoded[0].shape == (h, w, 3)
    assert len(seen) == sum(len(mix.draw(i)["images"]) for i in kinds.values())  # no two images alike
    assert mix.body(kinds["video"]) == mix.body(kinds["video"])  # regenerated alone, the same


# ---------------------------------------------------------------------------- arithmetic
def _sent(i, at, ttft, e2e, ok=True, status="ok", tokens=9, error=""):
    return Sent(i, at, at, at + e2e, ok, status, ttft if ok else None, tokens if ok else 0, error)


def test_the_steady_window_leaves_out_ramp_and_drain():
    """140 arrivals every 0.1 s over [0, 14); the window is [2, 12). Each takes 0.5 s; request i's TTFT is
    (i mod 100 + 1) ms, 9 tokens. A 503 in the ramp, a request still running at the end."""
    sent = [_sent(i, round(0.1 * i, 6), ((i % 100) + 1) / 1e3, 0.5) for i in range(140)]
    sent[5] = _sent(5, 0.5, 0, 0.01, ok=False, status="HTTP 503", error="HTTP 503: b'overloaded'")
    sent[7] = _sent(7, 0.7, 0, 0.01, ok=False, status="HTTP 503", error="HTTP 503: b'the second'")
    sent[139] = Sent(139, 13.9, 13.9, math.inf, False, "unfinished")
    p = analyse(sent, 2.0, 12.0)
    assert p["window_arrivals"] == 100 and p["offered_rps"] == pytest.approx(10.0)
    assert p["window_completions"] == 100 and p["served_rps"] == pytest.approx(10.0)  # sent in [1.5, 11.5)
    assert p["served_ratio"] == pytest.approx(1.0) and p["ratio_shift_s"] == pytest.approx(0.5)
    # arrivals 20..119 have TTFTs 21..100 and 1..20 ms: nearest rank (rank ceil(q n)) p50 = the 50th, p99 the 99th
    assert p["ttft_ms"]["n"] == 100 and p["ttft_ms"]["p50"] == pytest.approx(50.0) and p["ttft_ms"]["p99"] == pytest.approx(99.0)
    # TPOT: (0.5 s - TTFT) / 8
    assert p["tpot_ms"]["p50"] == pytest.approx((500 - 51) / 8) and p["tpot_ms"]["p99"] == pytest.approx((500 - 2) / 8)
    assert p["errors"] == {"HTTP 503": 2, "unfinished": 1} and p["errors_in_window"] == {}
    assert p["error_examples"] == {"HTTP 503": "HTTP 503: b'overloaded'", "unfinished": ""}  # the first of each
    assert p["drain_s"] == pytest.approx(13.8 + 0.5 - 13.9)
    ok, why = verdict(p, ttft_p99_ms=200.0)
    assert not ok and why == ["errors HTTP 503 x2, unfinished x1"]


def test_served_counts_completions_inside_the_window_whatever_they_arrived():
    """A server that completes one request per 0.2 s whatever arrives (10 req/s offered): 5 req/s served."""
    sent = [Sent(i, 0.1 * i, 0.1 * i, 0.2 * (i + 1), True, "ok", 0.01, 2) for i in range(200)]
    p = analyse(sent, 4.0, 14.0)
    assert p["offered_rps"] == pytest.approx(10.0) and p["served_rps"] == pytest.approx(5.0)
    assert p["ratio_shift_s"] == 4.0 and p["served_ratio"] == pytest.approx(0.5)  # the shift stops at the ramp
    ok, why = verdict(p, ttft_p99_ms=200.0)
    assert not ok and why[0].startswith("served 5.00 of 10.00 req/s offered (50.0% < 98%)")
    assert why[1].startswith("(only 100 arrivals in the window: one request is 1.0%")
    slow = analyse([_sent(i, 0.1 * i, 0.3, 0.5) for i in range(140)], 2.0, 12.0)
    assert verdict(slow, 200.0) == (False, ["TTFT p99 300 ms > 200 ms"]) and verdict(slow, 300.0) == (True, [])


def test_statuses_name_the_failure():
    assert status_of(Result(True)) == "ok"
    assert status_of(Result(False, error="HTTP 503: b'busy'")) == "HTTP 503"
    assert status_of(Result(False, error="ServerDisconnectedError: gone")) == "ServerDisconnectedError"
    assert status_of(Result(False, error="the engine failed")) == "stream error"


def _passes_up_to(capacity: float):
    seen = []

    def measure(rate):
        seen.append(rate)
        return {"rate": rate}
    return measure, (lambda p: p["rate"] <= capacity), seen


def test_the_search_steps_then_bisects():
    measure, ok, seen = _passes_up_to(173.0)
    r = search_goodput(measure, ok, [100, 50, 150, 200], max_points=8, resolution=0.05)
    assert seen == [50, 100, 150, 200, 175, 162.5, 168.75]
    assert (r["goodput"], r["fails_at"], r["complete"]) == (168.75, 175, True)
    assert [p["passes"] for p in r["points"]] == [True, True, True, False, False, True, True]


def test_the_search_grows_when_every_coarse_rate_passes():
    measure, ok, seen = _passes_up_to(27.0)
    r = search_goodput(measure, ok, [10, 20], max_points=8, resolution=0.05)
    assert seen == [10, 20, 25.0, 31.25, 28.12, 26.56, 27.34]
    assert (r["goodput"], r["fails_at"], r["complete"]) == (26.56, 27.34, True)


def test_the_search_is_bounded_and_stops_when_told():
    measure, ok, seen = _passes_up_to(30.0)
    r = search_goodput(measure, ok, [100], max_points=4)
    assert seen == [100, 50.0, 25.0, 37.5]
    assert (r["goodput"], r["fails_at"], r["complete"]) == (25.0, 37.5, False)
    measure, ok, seen = _passes_up_to(0.0)
    r = search_goodput(lambda rate: None if len(seen) == 2 else measure(rate), ok, [10, 20, 30])
    assert seen == [10, 5.0]  # the first fails: bisection below it, until measure says stop
    assert r["goodput"] == 0.0 and not r["complete"]


def test_cold_start_seconds_are_compared_with_the_warm_app():
    sent = []
    for k in range(20):  # 10 requests a second; TTFT 500 ms in second 0, 150 in 1-9, 90 after; two 503s in 0
        for j in range(10):
            ttft = 0.5 if k == 0 else 0.15 if k < 10 else 0.09
            ok = not (k == 0 and j < 2)
            sent.append(_sent(10 * k + j, k + 0.1 * j, ttft, ttft + 0.05, ok, "ok" if ok else "HTTP 503"))
    rows = per_second(sent, 20)
    assert rows[0]["requests"] == 10 and rows[0]["errors"] == {"HTTP 503": 2} and rows[0]["ttft_p99_ms"] == 500
    assert rows[5]["completions"] == 10
    s = cold_summary(rows, warm_p99_ms=100.0)
    assert s["errors"] == 2 and s["p99_ratio_max"] == pytest.approx(5.0)
    assert s["p99_ratio_max_after_10s"] == pytest.approx(0.9) and s["errors_after_10s"] == 0
    assert not s["within_1_5x_from_first_second"] and s["within_2x_after_10s"]
    assert s["within_1_5x_from_second"] == 1
    # no warm reference (its point ran out of time): no second is within anything, rather than every one
    s = cold_summary(per_second(sent, 20), warm_p99_ms=float("nan"))
    assert s["within_1_5x_from_second"] is None and not s["within_1_5x_from_first_second"]


def test_fixed_rates_take_the_highest_pass_below_the_lowest_fail():
    from benchmarks.goodput import fixed_rates_result

    pts = [{"rate": r, "passes": ok} for r, ok in ((50, True), (100, False), (150, True))]
    r = fixed_rates_result(pts, 3)
    assert (r["goodput"], r["fails_at"], r["passes_above_fail"], r["complete"]) == (50, 100, [150], True)
    assert fixed_rates_result(pts[:1], 3)["goodput"] == 50 and fixed_rates_result(pts[1:2], 1)["goodput"] == 0.0


def test_the_scale_up_options_reach_the_llm_deployment_of_the_config_file():
    conf = yaml.safe_load((ROOT / "configs" / "qwen3-vl-2b-gpu.yaml").read_text())
    out = file_config(conf, {"warmup": True}, 8123, scale_up_options(1, 2.0, 3.0))
    deps = {d["name"]: d for d in out["applications"][0]["deployments"]}
    llm = deps["LLM"]
    assert llm["max_ongoing_requests"] == 512  # the file's own options stay
    auto = llm["autoscaling_config"]
    assert (auto["min_replicas"], auto["initial_replicas"], auto["max_replicas"]) == (1, 1, 2)
    assert auto["target_ongoing_requests"] == 2.0 and auto["upscale_delay_s"] == 3.0
    assert auto["metrics_interval_s"] == 1.0  # load pushed every second, as the builder's own autoscalers
    assert auto["policy"]["policy_function"] == "app.serving.autoscaling:LLMAutoscalingPolicy"
    assert deps["Router"] == {d["name"]: d for d in conf["applications"][0]["deployments"]}["Router"]
    assert out["http_options"]["port"] == 8123 and out["applications"][0]["args"]["warmup"] is True
    assert "warmup" not in (conf["applications"][0]["args"])  # the file's dict is left as it was
    pytest.importorskip("ray.serve.schema").ServeDeploySchema.model_validate(out)  # what start_app hands Serve


def test_scale_up_seconds_are_compared_with_the_warm_app_around_the_join():
    sent = []
    for k in range(30):  # 10 a second; the new replica is ready at 12.4 s, TTFT doubles in seconds 11-13
        for j in range(10):
            ttft = 0.2 if 11 <= k <= 13 else 0.08
            sent.append(_sent(10 * k + j, k + 0.1 * j, ttft, ttft + 0.05))
    rows = per_second(sent, 30)
    one = {"a": {"ready_s": -40.0, "first_request_s": 0.01}}
    samples = [{"t": 0.5 * i, "replicas": dict(one)} for i in range(25)]
    startup = [{"name": "tower", "start_s": 2.0, "end_s": 5.5}, {"name": "engine: graphs", "start_s": 8.0, "end_s": 11.2},
               {"name": "warm-up requests", "start_s": 11.2, "end_s": 12.3}]
    samples += [{"t": 0.5 * i, "replicas": {**one, "b": {"ready_s": 12.4, "first_request_s": None if i == 25 else 12.6,
                                                          "startup": startup}}}
                for i in range(25, 60)]
    s = scale_up_summary(rows, samples, warm_p99_ms=100.0)
    assert s["replicas_at_start"] == 1 and s["errors"] == 0
    assert s["added"] == {"replica": "b", "seen_s": 12.5, "ready_s": 12.4, "first_request_s": 12.6}
    assert s["p99_ratio_max"] == pytest.approx(2.0) and s["p99_ratio_max_around_join"] == pytest.approx(2.0)
    assert s["p99_ratio_max_settled"] == pytest.approx(0.8)  # seconds 23-29: 10 s after the first request, warm
    # each phase with the worst second that overlaps it: the tower's were warm (0.8x), the graphs' reach
    # second 11 (2x), the warm-up's seconds 11-12
    worst = {p["name"]: p["p99_ratio_max"] for p in s["startup_phases"]}
    assert worst == pytest.approx({"tower": 0.8, "engine: graphs": 2.0, "warm-up requests": 2.0})
    assert s["within_2x_no_errors"]
    s = scale_up_summary(rows, samples[:25], warm_p99_ms=80.0)  # nothing added; 2.5x: fails
    assert s["added"] is None and "p99_ratio_max_around_join" not in s and not s["within_2x_no_errors"]
    # the host at the worst second (11, the first of the three at 2x): the timeline row whose interval ends
    # first after 11.5 s, the one that covers most of it ([11.2, 12.2])
    host = [{"t": t + 0.2, "host_busy": 0.1 * (t % 10), "gpu_busy": [50.0], "new": {"LLM": 1} if t == 12 else {},
             "cores": {"LLM": 1.0 + t / 10, "Router": 0.5, "MediaPreprocessor": 0.2, "raylet": 0.1}}
            for t in range(30)]
    s = scale_up_summary(rows, samples, warm_p99_ms=100.0, host=host)
    assert s["worst_second"] == 11
    assert s["host_at_worst"] == {"t": 12.2, "host_busy": 0.2, "gpu_busy": [50.0], "new": {"LLM": 1},
                                  "cores": {"LLM": 2.2, "Router": 0.5, "MediaPreprocessor": 0.2}}
    assert host_text(s["host_at_worst"]) == ("host 20% busy, GPU 50% busy; cores: LLM 2.20, Router 0.50, "
                                             "MediaPreprocessor 0.20; new processes: 1 LLM")
    # the baseline is compared over the seconds before the added replica began (its first phase, 2.0 s)
    from benchmarks.goodput import _worst, baseline_text, before_start_s

    assert before_start_s(s) == 2.0 and before_start_s({"added": {"ready_s": 5.0}}) == 5.0
    assert before_start_s({"added": None}) is None
    assert _worst(rows, 11.0)["p99_ratio"] == pytest.approx(0.8) and _worst(rows)["second"] == 11
    text = baseline_text({"errors": 0, "p99_ratio_max": 1.5, "worst_second": 40, "compared_until_s": 12.8,
                          "p99_ratio_max_before": 1.2, "scale_up_p99_ratio_max_before": 3.0, "host_at_worst": None}, 90)
    assert text == ("scale-up baseline at 90 req/s (the same app and load, no replica to add): errors 0, TTFT p99 "
                    "max 1.50x the same warm reference at second 40; before the added replica's start (12.8 s) "
                    "1.20x against the scale-up's 3.00x: no host sample")
    fixed = scale_up_options(1, 2.0, 3.0, room=0)["LLM"]["autoscaling_config"]
    assert fixed["min_replicas"] == fixed["max_replicas"] == 1


def test_replica_balance_gives_each_replica_its_share_of_the_engines_gpu_time():
    def rep(rid, gpu, running, waiting, ms):
        return {"replica": rid, "cuda_visible_devices": gpu, "running": running, "waiting": waiting,
                "engine_gpu_ms_total": ms}

    samples = [{"replicas": [rep("b", "1", 10, 2, 100.0), rep("a", "0", 4, 0, 50.0)]},
               {"replicas": [rep("b", "1", 12, 4, 400.0), rep("a", "0", 6, 0, 150.0)]},
               {"replicas": [rep("b", "1", 14, 0, 700.0)]}]  # a missed one sample
    bal = replica_balance(samples)
    assert [b["replica"] for b in bal] == ["a", "b"] and [b["gpu"] for b in bal] == ["0", "1"]
    a, b = bal
    assert (a["samples"], a["running_mean"], a["waiting_mean"], a["engine_gpu_ms"]) == (2, 5.0, 0.0, 100.0)
    assert (b["samples"], b["running_mean"], b["waiting_mean"], b["engine_gpu_ms"]) == (3, 12.0, 2.0, 600.0)
    assert a["gpu_time_share"] == pytest.approx(1 / 7) and b["gpu_time_share"] == pytest.approx(6 / 7)
    assert replica_balance([]) == []


def test_the_ttft_parts_come_from_two_scrapes_of_the_servers_histograms():
    """/metrics before and after a window: the requests whose first token came in between, per part
    (the whole TTFT, encode, queue, prefill), their mean and the bucket holding their p99."""
    from types import SimpleNamespace

    from app.serving.prometheus import RequestMetrics, scrape_text
    from benchmarks.goodput import histograms_of, ttft_parts

    m = RequestMetrics(max_model_len=100)
    idle = {"running": 0, "waiting": 0, "kv_usage": 0.0, "kv_blocks": 1, "kv_blocks_free": 1,
            "prefix_cache_queried_tokens": 0, "prefix_cache_hit_tokens": 0, "preemptions": 0}

    def scrape() -> dict:
        return histograms_of(scrape_text(([{**m.snapshot(), "load": idle}], 0), None, "tiny")[0].decode())

    def first_chunk(queue_s, prefill_s):
        return SimpleNamespace(index=0, token_ids=[1], finish_reason="stop", completion_tokens=1,
                               timing={"queue_s": queue_s, "prefill_s": prefill_s})

    async def requests(timings):
        for q, pf in timings:
            async for _ in m.observe(_chunks([first_chunk(q, pf)]), 3):
                pass

    asyncio.run(requests([(0.5, 0.5)]))  # before the window: not counted
    before = scrape()
    asyncio.run(requests([(0.002, 0.030)] * 99 + [(0.090, 0.030)]))
    parts = ttft_parts(before, scrape())
    assert parts["queue"]["n"] == parts["prefill"]["n"] == parts["ttft"]["n"] == 100
    assert parts["queue"]["mean_ms"] == pytest.approx((99 * 2 + 90) / 100)
    assert parts["prefill"]["mean_ms"] == pytest.approx(30)
    assert parts["queue"]["p99_bucket_ms"] == 5 and parts["prefill"]["p99_bucket_ms"] == 40  # TTFT_BOUNDS' edges
    assert parts["encode"] == {"n": 0}  # no tower in these requests
    assert ttft_parts({}, before) == {}


async def _chunks(items):
    for c in items:
        yield c


def test_guidellms_report_is_read_as_per_request_records():
    """The fields of GuideLLM 0.8's JSON report that the cross-check reads: its requests' targeted start
    (due), start, end and TTFT, from the benchmark's start; an errored request keeps its exception name."""
    from benchmarks.goodput import guidellm_sent

    def rec(due, start, end, ttft, error=None):
        return {"info": {"timings": {"targeted_start": 100 + due}, "error": error}, "request_start_time": 100 + start,
                "request_end_time": 100 + end, "time_to_first_token_ms": ttft, "output_tokens": 16}

    stats = {"mean": 2.0, "percentiles": {"p50": 40.0, "p99": 90.0}}
    report = {"benchmarks": [{"start_time": 100.0, "duration": 10.0, "requests": {
        "successful": [rec(0.5, 0.51, 0.8, 40.0), rec(1.0, 1.0, 1.3, 90.0)],
        "errored": [rec(1.5, 1.5, 1.6, None, "HTTPStatusError(\"Client error '400 Bad Request'\")")],
        "incomplete": [], "total": None},
        "metrics": {"requests_per_second": {"successful": stats}, "time_to_first_token_ms": {"successful": stats}}}]}
    sent, own = guidellm_sent(report)
    assert [(s.sched_s, s.ok, s.status) for s in sent] == [(0.5, True, "ok"), (1.0, True, "ok"),
                                                           (1.5, False, "HTTPStatusError")]
    assert sent[0].ttft_s == pytest.approx(0.04) and sent[0].done_s == pytest.approx(0.8)
    assert own == {"duration_s": 10.0, "successful": 2, "requests_per_second_mean": 2.0, "ttft_ms_p50": 40.0,
                   "ttft_ms_p99": 90.0}
    p = analyse(sent, 0.0, 2.0)
    assert p["window_arrivals"] == 3 and p["window_completions"] == 2 and p["errors"] == {"HTTPStatusError": 1}


def test_aiperfs_records_are_read_as_per_request_records():
    """The fields of AIPerf 0.13's `profile_export.jsonl` that the cross-check reads (as a real run against
    the CPU server wrote them): the profiling phase's records only, due at their credit's issue, sent at the
    worker's start, times from the first issue; a failed one keeps its HTTP code, a cancelled one says so."""
    from benchmarks.goodput import aiperf_command, aiperf_sent

    def rec(issued, start, end, ttft=None, phase="profiling", error=None, cancelled=False):
        ns = 10**9
        md = {"credit_issued_ns": 50 * ns + int(issued * ns), "request_start_ns": 50 * ns + int(start * ns),
              "request_end_ns": 50 * ns + int(end * ns), "benchmark_phase": phase, "was_cancelled": cancelled}
        metrics = {} if ttft is None else {"time_to_first_token": {"value": ttft, "unit": "ms"},
                                           "output_sequence_length": {"value": 16, "unit": "tokens"}}
        return json.dumps({"metadata": md, "metrics": metrics, **({"error": error} if error else {})})

    lines = [rec(0.0, 0.0, 0.1, 30.0, phase="warmup"),
             rec(1.5, 1.502, 2.0, 40.0), rec(1.0, 1.001, 1.3, 90.0),
             rec(2.0, 2.0, 2.1, error={"code": 503, "type": "HTTPError", "message": "overloaded"}),
             rec(2.5, 2.5, 9.0, cancelled=True), ""]
    unfinished = json.loads(rec(3.0, 3.0, 0.0, 20.0))
    unfinished["metadata"]["request_end_ns"] = None  # no error, no end: still open when the tool stopped
    lines += [json.dumps(unfinished), '{"metadata": {"credit_iss']  # and a line cut short
    sent = aiperf_sent(lines)
    assert [(s.sched_s, s.ok, s.status) for s in sent] == [
        (0.0, True, "ok"), (0.5, True, "ok"), (1.0, False, "HTTP 503"), (1.5, False, "cancelled"),
        (2.0, False, "unfinished")]
    assert sent[0].ttft_s == pytest.approx(0.09) and sent[0].done_s == pytest.approx(0.3)
    assert sent[1].start_s == pytest.approx(0.502) and sent[1].completion_tokens == 16
    assert sent[2].done_s == math.inf and sent[2].error == "overloaded"
    p = analyse(sent, 0.0, 2.0)
    assert p["window_arrivals"] == 4 and p["window_completions"] == 2
    assert p["errors"] == {"HTTP 503": 1, "cancelled": 1, "unfinished": 1}  # errors of all, as for our own
    seconds = json.loads(rec(0.0, 0.0, 0.1))
    seconds["metrics"] = {"time_to_first_token": {"value": 0.25, "unit": "s"}}  # a unit other than 0.13's ms
    assert aiperf_sent([json.dumps(seconds)])[0].ttft_s == pytest.approx(0.25)
    cmd = aiperf_command(["aiperf"], "http://h:8000", "m", "/ckpt", 140.0, 21.0, 448, 16, ROOT / "a")
    assert cmd[:2] == ["aiperf", "profile"] and "--streaming" in cmd
    assert cmd[cmd.index("--request-rate") + 1] == "140" and cmd[cmd.index("--arrival-pattern") + 1] == "poisson"
    assert cmd[cmd.index("--benchmark-duration") + 1] == "21" and cmd[cmd.index("--image-width-mean") + 1] == "448"
    assert "ignore_eos:true" in cmd and "min_tokens:16" in cmd
    # greedy by default, as our own requests; with the checkpoint's sampling neither sends a temperature
    assert cmd[cmd.index("temperature:0") - 1] == "--extra-inputs"
    sampled = aiperf_command(["aiperf"], "http://h:8000", "m", "/ckpt", 140.0, 21.0, 448, 16, ROOT / "a",
                             sampling="defaults")
    assert not any(x.startswith("temperature") for x in sampled) and len(sampled) == len(cmd) - 2


def test_workloads_send_greedy_or_the_checkpoint_s_sampling_and_say_which():
    import io

    from PIL import Image, JpegImagePlugin

    from benchmarks.serve import Workload
    from benchmarks.workloads import MixWorkload

    greedy, sampled = Workload("image", 64), Workload("image", 64, sampling="defaults")
    assert greedy.body(0)["temperature"] == 0 and "temperature" not in sampled.body(0)
    assert greedy.label == "image 64^2" and sampled.label == "image 64^2, defaults sampling"
    assert MixWorkload(sampling="defaults").label == "mix, defaults sampling"
    assert "temperature" not in MixWorkload(sampling="defaults").body(1) and MixWorkload().body(1)["temperature"] == 0
    with pytest.raises(ValueError):
        Workload("image", 64, sampling="hot").body(0)

    def jpeg(wl):
        import base64

        url = wl.body(3)["messages"][0]["content"][0]["image_url"]["url"]
        return base64.b64decode(url.partition(",")[2])

    ours, theirs = jpeg(Workload("image", 448)), jpeg(Workload("image", 448, jpeg=(85, 0)))  # AIPerf's encoding
    assert JpegImagePlugin.get_sampling(Image.open(io.BytesIO(theirs))) == 0  # 4:4:4
    assert JpegImagePlugin.get_sampling(Image.open(io.BytesIO(ours))) == 2  # 4:2:0
    assert len(theirs) > 1.5 * len(ours)


def test_a_cross_check_tool_run_counts_its_own_cpu_and_the_hosts(tmp_path):
    """run_tool: the CPU time of the tool and of the processes it started and waited for (here a child that
    spins 0.4 s of CPU in a grandchild), over the wall time; the host's busy cores beside it."""
    from benchmarks.goodput import cpu_text, run_tool

    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass"
    child = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {spin!r}], check=True); print('done')"
    proc, cpu = run_tool([sys.executable, "-c", child], timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "done"
    assert 0.4 <= cpu["tool_cpu_s"] <= cpu["wall_s"] * os.cpu_count() and cpu["tool_cores"] > 0
    assert 0 < cpu["host_busy_cores"] <= cpu["host_cores"] == os.cpu_count()
    assert cpu_text(cpu).startswith("; its processes ") and cpu_text({}) == ""


def test_a_tools_artifact_folder_travels_as_one_file(tmp_path):
    """pack_folder: the device returns a few files a call, so AIPerf's dozen (in sub-folders) travel as one
    archive, without the payloads it was told to skip."""
    import tarfile

    from benchmarks.goodput import pack_folder

    folder = tmp_path / "aiperf"
    (folder / "logs").mkdir(parents=True)
    (folder / "profile_export.jsonl").write_text('{"metadata": {}}\n')
    (folder / "logs" / "aiperf.log").write_text("log")
    (folder / "inputs.json").write_text("x" * 1000)
    packed = pack_folder(folder, skip={"inputs.json"})
    assert packed == tmp_path / "aiperf.tar.xz" and not folder.exists()
    with tarfile.open(packed) as tar:
        assert sorted(tar.getnames()) == ["aiperf/logs/aiperf.log", "aiperf/profile_export.jsonl"]
        assert tar.extractfile("aiperf/profile_export.jsonl").read() == b'{"metadata": {}}\n'


def test_gpu_time_counters_are_summed_over_replicas():
    assert gpu_totals({"replicas": [{"encoder_gpu_ms_total": 5.0, "batches": 3}, {"encoder_gpu_ms_total": 2.5}]}) == \
        {"encoder_gpu_ms_total": 7.5}
    assert gpu_totals({"running": 1, "engine_gpu_ms_total": 4}) == {"engine_gpu_ms_total": 4}
    assert gpu_totals(None) == {} and gpu_totals({"batches": 2}) == {}


# ---------------------------------------------------------------------------- a fake streaming server
class FakeServer:
    """`slots` requests at a time, each streaming a first token after `ttft_s` and its last after
    `e2e_s` (a capacity of slots / e2e_s req/s); the others queue, beyond `max_queue` a 503. It answers
    /v1/llm/load as the app does, and /health and /v1/models once `ready_at` has passed."""

    def __init__(self, slots=2, ttft_s=0.01, e2e_s=0.1, max_queue=50):
        self.slots, self.ttft_s, self.e2e_s, self.max_queue = slots, ttft_s, e2e_s, max_queue
        self.running = self.waiting = 0
        self.ids: list[str] = []
        self.arrived: list[float] = []
        self.ready_at = 0.0
        self.replicas: list[dict] = []  # /v1/llm/load's per-replica reports (ready_at: wall clock)
        self.sem: asyncio.Semaphore | None = None

    async def chat(self, request):
        self.sem = self.sem or asyncio.Semaphore(self.slots)
        await request.read()
        self.ids.append(request.headers.get("x-request-id", ""))
        self.arrived.append(time.monotonic())
        if self.waiting >= self.max_queue:
            return web.json_response({"error": {"message": "busy"}}, status=503)
        self.waiting += 1
        async with self.sem:
            self.waiting -= 1
            self.running += 1
            try:
                resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
                await resp.prepare(request)
                await asyncio.sleep(self.ttft_s)
                await resp.write(b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n')
                await asyncio.sleep(self.e2e_s - self.ttft_s)
                usage = {"prompt_tokens": 3, "completion_tokens": 5}
                await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
                await resp.write(b"data: [DONE]\n\n")
                await resp.write_eof()
                return resp
            finally:
                self.running -= 1

    async def load(self, request):
        return web.json_response({"running": self.running, "waiting": self.waiting, "kv_usage": 0.0,
                                  "num_replicas": max(1, len(self.replicas)), "replicas": self.replicas})

    async def encoder_stats(self, request):
        return web.json_response({"batches": 0})

    async def health(self, request):
        return web.json_response({"status": "ok"}, status=200 if time.monotonic() >= self.ready_at else 503)

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{"id": "fake", "object": "model"}]},
                                 status=200 if time.monotonic() >= self.ready_at else 503)


@pytest.fixture
def fake():
    server = FakeServer()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", server.chat)
    app.router.add_get("/v1/llm/load", server.load)
    app.router.add_get("/v1/encoder/stats", server.encoder_stats)
    app.router.add_get("/health", server.health)
    app.router.add_get("/v1/models", server.models)
    for url in serve_aiohttp(app):
        yield server, url


def test_a_sweep_against_a_fake_server_finds_its_capacity(fake, tmp_path):
    """Capacity 20 req/s (2 slots of 0.1 s): 4 and 8 req/s pass, 30 fails (served falls behind, the queue
    grows), and the bisection settles below 20. Sent from two load processes. The served bound is 90%, not
    the default 98%: a window of 24 arrivals moves by 4% per request completing just past its edge (CI saw
    95.7% at 8 req/s), while 30 req/s serves about 67%."""
    server, url = fake
    r = main(["--url", url, "--workload", "image@32", "--rates", "4", "8", "30", "--max-points", "4",
              "--ramp-s", "1", "--window-s", "3", "--warmup-s", "1", "--drain-s", "10", "--ttft-p99-ms", "300",
              "--min-window-arrivals", "24", "--min-served", "0.9", "--load-processes", "2", "--no-monitor",
              "--out-dir", str(tmp_path)])
    w = r["workloads"]["image 32^2"]
    pts = w["search"]["points"]
    assert [p["rate"] for p in pts] == [4, 8, 30, 19]
    # each point's window holds 24 arrivals at least (4 req/s: 6 s), and its ramp is 1.25 x the longest
    # E2E p99 seen before it where that beats --ramp-s: after the overloaded point, the queue's answers
    assert [p["window_s"] for p in pts] == pytest.approx([6.0, 3.0, 3.0, 3.0])
    seen = [w["warmup"]["e2e_ms"]["p99"]] + [p["e2e_ms"]["p99"] for p in pts]
    for i, p in enumerate(pts):
        assert p["ramp_s"] == pytest.approx(max(1.0, min(12.0, 1.25 * max(seen[:i + 1]) / 1e3)))
    assert pts[3]["ramp_s"] > 1.0  # the 30 req/s point's queue made the last point's ramp longer
    assert [p["passes"] for p in pts][:3] == [True, True, False]
    assert 8 <= w["search"]["goodput"] < 20 and w["search"]["fails_at"] in (19, 30)
    over = pts[2]
    assert over["served_ratio"] < 0.9 and over["served_rps"] == pytest.approx(20.0, rel=0.3)  # (sleeps overshoot)
    ok = pts[0]
    # timings with room for a busy machine: TTFT 10 ms, TPOT (e2e - TTFT) / (5 tokens - 1) = 22.5 ms
    assert 9.0 < ok["ttft_ms"]["p50"] < 100 and ok["errors"] == {}
    assert 22.0 < ok["tpot_ms"]["p50"] < 45
    assert ok["send_lag_ms"]["p99"] < 200 and ok["gpu_ms_per_request"] is None and "gpu_time_note" in ok
    assert ok["server"]["llm_load"]["samples"] >= 2
    # every scheduled request was sent once, tagged with its schedule and index
    tags = [t for t in server.ids if t.startswith("goodput-")]
    assert len(tags) == len(set(tags)) == sum(p["requests"] for p in pts) + w["warmup"]["requests"]
    for name in ("goodput.json", "goodput.png", "goodput.md"):
        assert (tmp_path / name).stat().st_size > 0
    assert json.loads((tmp_path / "goodput.json").read_text())["workloads"]["image 32^2"]["search"]["goodput"] == \
        w["search"]["goodput"]


def test_the_closed_loop_reads_the_replicas_load_beside_it(fake):
    from benchmarks.goodput import closed_loop, parse_args
    from benchmarks.serve import Workload

    server, url = fake
    server.replicas = [{"replica": "r0", "cuda_visible_devices": "0", "running": 2, "waiting": 1,
                        "engine_gpu_ms_total": 0.0}]
    r = closed_loop(url, Workload("image", 32), parse_args(["--url", url, "--no-monitor"]), 4, 60, 0)
    assert r["failed"] == 0 and r["request_throughput"] > 0
    (bal,) = r["replica_balance"]  # 60 requests at 20 req/s: about 3 s, a sample a second
    assert bal["replica"] == "r0" and bal["gpu"] == "0" and bal["samples"] >= 1 and bal["running_mean"] == 2


FAKE_AIPERF = """
import json, sys, time
from pathlib import Path
args = sys.argv[1:]
arg = lambda name: args[args.index(name) + 1]
out = Path(arg("--artifact-dir")); out.mkdir(parents=True)
rate, seconds = float(arg("--request-rate")), float(arg("--benchmark-duration"))
workers = int(arg("--workers-max")) if "--workers-max" in args else 0
ttft_ms = 20.0 + 10.0 * workers  # a made-up client whose TTFT grows with its workers
t0 = time.time_ns()
with open(out / "profile_export.jsonl", "w") as f:
    for i in range(int(rate * seconds)):
        at = t0 + int(i / rate * 1e9)
        md = {"credit_issued_ns": at, "request_start_ns": at, "request_end_ns": at + 100_000_000,
              "benchmark_phase": "profiling", "was_cancelled": False}
        f.write(json.dumps({"metadata": md, "metrics": {
            "time_to_first_token": {"value": ttft_ms, "unit": "ms"},
            "output_sequence_length": {"value": 5, "unit": "tokens"}}}) + "\\n")
(out / "profile_export_aiperf.json").write_text(json.dumps({"request_count": {"avg": int(rate * seconds)}}))
(out / "inputs.json").write_text("payloads")
print("workers", workers, "args", " ".join(args[:2]))
"""


def test_a_cross_check_runs_aiperf_once_per_worker_count_against_one_app(fake, tmp_path):
    """run_crosscheck with --crosscheck-workers 0 3: our point once, then the tool once per value, each
    with its own command (`--workers-max` only where asked), records read through `analyse`, difference
    against ours, CPU record, and its artifacts packed without the payloads; the first run's fields stay
    at the top of the result."""
    import tarfile

    from benchmarks.goodput import Bench, parse_args, run_crosscheck

    server, url = fake
    tool = tmp_path / "fake_aiperf.py"
    tool.write_text(FAKE_AIPERF)
    a = parse_args(["--url", url, "--no-monitor", "--image-size", "32", "--ramp-s", "0.5", "--window-s", "2",
                    "--output-tokens", "5", "--crosscheck", "aiperf", "--crosscheck-rate", "10",
                    "--crosscheck-exe", f"{sys.executable} {tool}", "--crosscheck-tokenizer", "/ckpt",
                    "--crosscheck-workers", "0", "3"])
    out = run_crosscheck(Bench(url, a, None), a, {}, tmp_path, {})
    assert [r["workers"] for r in out["runs"]] == [None, 3] and out["workers"] is None
    assert "--workers-max" not in out["runs"][0]["command"]
    cmd = out["runs"][1]["command"]
    assert cmd[cmd.index("--workers-max") + 1] == "3" and cmd[cmd.index("--request-rate") + 1] == "10"
    assert out["ours"]["window_completions"] > 0 and out["difference"] == out["runs"][0]["difference"]
    # the made-up TTFTs (20 and 50 ms) read back exactly, and compared with our own client's
    assert [r["point"]["ttft_ms"]["p50"] for r in out["runs"]] == pytest.approx([20.0, 50.0])
    for r in out["runs"]:
        assert r["difference"]["ttft_p50"] == pytest.approx(r["point"]["ttft_ms"]["p50"] / out["ours"]["ttft_ms"]["p50"] - 1)
        assert r["cpu"]["tool_cpu_s"] > 0 and r["own_summary"]["request_count"] == {"avg": 25}
    for name in ("aiperf", "aiperf_w3"):
        assert (tmp_path / f"{name}.log").read_text().startswith("workers")
        with tarfile.open(tmp_path / f"{name}.tar.xz") as tar:
            assert sorted(tar.getnames()) == [f"{name}/profile_export.jsonl", f"{name}/profile_export_aiperf.json"]


def test_a_cold_start_waits_for_ready_then_starts_the_clock(fake, tmp_path):
    """The fake answers /health only 1.5 s after the 'deploy': the schedule starts then, not before."""
    from benchmarks.goodput import Bench, parse_args
    from benchmarks.serve import Workload

    server, url = fake
    a = parse_args(["--url", url, "--no-monitor", "--drain-s", "5"])
    bench = Bench(url, a, None)
    server.ready_at = math.inf

    def deploy():
        server.ready_at = time.monotonic() + 1.5

    c = bench.cold(Workload("image", 32), 10.0, deploy, 3, ready_timeout_s=10)
    assert 1.4 < c["ready_s"] < 6 and c["deploy_call_s"] < 1  # (generous: the CPU machine is shared)
    assert min(server.arrived) >= server.ready_at  # nothing was sent before ready
    assert sum(r["requests"] for r in c["per_second"]) == c["whole"]["requests"] == len(server.arrived)
    assert c["whole"]["errors"] == {} and c["whole"]["offered_rps"] == pytest.approx(10.0, rel=0.5)
    assert all(not r["ttft_p99_ms"] > 1000 for r in c["per_second"])  # 10 ms on an idle machine


def test_a_scale_up_watches_the_replicas_from_ready(fake, tmp_path):
    """The 'deploy' makes the fake ready after 0.5 s with one replica and adds a second 1.5 s into the
    load: the run sees it, with its ready time from the load's start, and sends nothing before ready."""
    import threading

    from benchmarks.goodput import Bench, parse_args, scale_up_run
    from benchmarks.serve import Workload

    server, url = fake
    a = parse_args(["--url", url, "--no-monitor", "--drain-s", "5", "--scale-up-s", "4", "--ramp-s", "0.5",
                    "--cold-warm-window-s", "1"])
    bench = Bench(url, a, None)
    server.ready_at = math.inf

    def deploy():
        now = time.time()
        server.replicas = [{"replica": "a", "ready_at": now, "first_request_at": now + 0.5}]
        server.ready_at = time.monotonic() + 0.5

        def add():
            now = time.time()
            server.replicas = server.replicas + [{"replica": "b", "ready_at": now, "first_request_at": now + 0.1,
                                                  "startup": {"started_at": now - 1.0, "phases": [
                                                      {"name": "tower", "start": now - 1.0, "end": now - 0.4},
                                                      {"name": "warm-up requests", "start": now - 0.4,
                                                       "end": now}]}}]
        threading.Timer(2.0, add).start()

    up = scale_up_run(bench, a, Workload("image", 32), 10.0, deploy)
    assert 0.4 < up["ready_s"] < 5 and min(server.arrived) >= server.ready_at
    s = up["summary"]
    assert s["replicas_at_start"] == 1 and s["added"]["replica"] == "b" and s["errors"] == 0
    assert 0.8 < s["added"]["ready_s"] < 3.5  # 1.5 s after ready, as the load's clock reads it (shared CPU)
    assert s["added"]["first_request_s"] == pytest.approx(s["added"]["ready_s"] + 0.1, abs=0.01)
    tower, warm = s["startup_phases"]  # the replica's wall-clock phases on the load's clock
    assert (tower["name"], warm["name"]) == ("tower", "warm-up requests")
    assert tower["start_s"] == pytest.approx(s["added"]["ready_s"] - 1.0, abs=0.01)
    assert warm["end_s"] == pytest.approx(s["added"]["ready_s"], abs=0.01)
    assert len(up["per_second"]) == 4 and up["warm"]["ttft_ms"]["n"] > 0 and len(up["replica_samples"]) >= 4
    # the host beside the load, a row a second on the load's clock, this process (the load generator) in it
    assert len(up["host_timeline"]) >= 4 and up["host_timeline"][0]["t"] == pytest.approx(1.0, abs=0.5)
    assert any("load generator" in r["cores"] for r in up["host_timeline"])
    assert s["worst_second"] in range(4) and s["host_at_worst"]["t"] >= s["worst_second"] + 0.5

    # the baseline: the same load with nothing to add, against the scale-up's warm reference
    from benchmarks.goodput import scale_up_baseline

    server.replicas, server.ready_at = [], math.inf
    up["summary"]["warm_ttft_p99_ms"] = 5.0  # under the fake's 10 ms TTFTs: every second reads slow
    base = scale_up_baseline(bench, a, Workload("image", 32), 10.0,
                             lambda: setattr(server, "ready_at", time.monotonic() + 0.3), up)
    b = base["summary"]
    assert b["errors"] == 0 and b["warm_ttft_p99_ms"] == 5.0 and len(base["per_second"]) == 4
    assert b["p99_ratio_max"] > 1.0 and b["worst_second"] in range(4)
    assert b["host_at_worst"] is not None and len(base["host_timeline"]) >= 4
    # compared with the scale-up up to when its added replica began (its tower phase, 1 s before ready)
    assert b["compared_until_s"] == pytest.approx(s["added"]["ready_s"] - 1.0, abs=0.01)
    assert [r["second"] for r in b["side_by_side"]] == [0, 1, 2, 3]
    assert [r["baseline"] for r in b["side_by_side"]] == [r["p99_ratio"] for r in base["per_second"]]


def test_the_baseline_can_run_before_the_scale_up(fake):
    """`--scale-up-baseline-first`: the app deleted and deployed with no room, loaded; then deleted and
    deployed with room for a replica that the fake adds 1.5 s in; the baseline's seconds are then read
    against the scale-up's warm reference, up to when its added replica began."""
    import threading

    from benchmarks.goodput import Bench, parse_args, scale_up_stage
    from benchmarks.serve import Workload

    server, url = fake
    a = parse_args(["--url", url, "--no-monitor", "--drain-s", "5", "--scale-up-s", "3", "--ramp-s", "0.5",
                    "--cold-warm-window-s", "1", "--scale-up-baseline-first"])
    bench, calls = Bench(url, a, None), []
    server.ready_at = math.inf

    def deploy_with_room(room: int):
        def deploy():
            calls.append(f"deploy {room}")
            now = time.time()
            server.replicas = [{"replica": "a", "ready_at": now, "first_request_at": now + 0.5}]
            server.ready_at = time.monotonic() + 0.3
            if room:
                def add():
                    t = time.time()
                    server.replicas = server.replicas + [{"replica": "b", "ready_at": t, "first_request_at": t + 0.1,
                                                          "startup": {"started_at": t - 1.0, "phases": [
                                                              {"name": "tower", "start": t - 1.0, "end": t}]}}]
                threading.Timer(1.5, add).start()
        return deploy

    def stop():
        calls.append("stop")
        server.ready_at, server.replicas = math.inf, []

    out = scale_up_stage(bench, a, Workload("image", 32), 10.0, deploy_with_room, stop, None, needed_s=0)
    assert calls == ["stop", "deploy 0", "stop", "deploy 1"]  # the baseline first, then the scale-up
    assert out["summary"]["added"]["replica"] == "b"
    base = out["baseline"]
    assert base["ran"] == "first" and base["replicas_seen"] == 1 and len(base["per_second"]) == 3
    b = base["summary"]
    assert b["warm_ttft_p99_ms"] == out["summary"]["warm_ttft_p99_ms"] and b["errors"] == 0
    assert b["compared_until_s"] == pytest.approx(out["summary"]["added"]["ready_s"] - 1.0, abs=0.01)
    assert [r["baseline"] for r in b["side_by_side"]] == [r["p99_ratio"] for r in base["per_second"]]


# ---------------------------------------------------------------------------- the real application, CPU
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.integration  # starts Ray Serve (its own process): run beside the other Ray tests, not at once
def test_a_sweep_and_a_cold_start_against_the_real_app_on_the_cpu(model_cache, tmp_path):
    """benchmarks/goodput.py --start as the device call runs it (its own process, Ray started there), the
    tiny model, small images: warm-up, two low rates, then the app deployed again and loaded from ready."""
    pytest.importorskip("ray")
    sys.path.insert(0, str(ROOT / "tests"))
    from served import config_from_file

    port = _free_port()
    conf = config_from_file(port, {"cache_dir": model_cache, "llm": {"max_num_seqs": 8}})
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(yaml.safe_dump(conf))
    out = tmp_path / "out"
    env = {**os.environ, "RAY_ADDRESS": "local", "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    t = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "benchmarks/goodput.py", "--start", "--serve-config", str(cfg), "--port", str(port),
         "--workload", "image@64", "--rates", "1", "2", "--no-search", "--ramp-s", "1", "--window-s", "4",
         "--warmup-s", "2", "--drain-s", "20", "--ttft-p99-ms", "10000", "--cold-first", "1", "--cold-rate", "1",
         "--min-window-arrivals", "0", "--max-ramp-s", "1",  # the short windows of a smoke run, whatever the CPU's E2E
         "--cold-s", "4",
         "--cold-warm-window-s", "3", "--out-dir", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    took = time.perf_counter() - t
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads((out / "goodput.json").read_text())
    starts = r["meta"]["llm_startup"]  # where each LLM replica's start went, read at ready
    assert starts and all(st["to_ready_s"] > 0 and st["phases_s"] for st in starts.values()), starts
    # the first deploy's steps before the replicas' code, from Ray Serve's own logs (benchmarks/serve_timeline.py)
    steps = r["meta"]["deploy_timeline"]
    events = [s["event"] for s in steps]
    assert events[:2] == ["controller: deploying the app", "builder: its task began importing the app"], events
    assert "controller: the app built" in events and any(e.startswith("controller: LLM replica") for e in events)
    assert all(0 <= a["at_s"] <= b["at_s"] for a, b in zip(steps, steps[1:])) and steps[-1]["at_s"] < r["meta"]["ready_s"]
    w = r["workloads"]["image 64^2"]
    pts = w["search"]["points"]
    assert [p["rate"] for p in pts] == [1, 2]
    for p in pts:
        assert p["errors"] == {} and p["window_arrivals"] > 0 and p["ttft_ms"]["n"] == p["window_arrivals"]
        assert p["server"]["llm_load"]["replicas"] >= 1 and "encoder" in p["server"]
        assert "groups" in p["server"]["resources"]  # the monitor's CPU per process
        parts = p["server"]["ttft_parts"]  # from /metrics at the window's edges
        assert parts["queue"]["n"] > 0 and parts["prefill"]["n"] == parts["queue"]["n"]
        lag = p["server"]["loop_lag"]  # the LLM replicas' event loops, ticking through the window
        assert lag["replicas"] and all(d["ticks"] > 0 for d in lag["replicas"].values()), lag
        tail = p["ttft_tail"]  # every answer's own parts (benchmarks/ttft_tail.py), through the Router's port
        assert tail["requests"] == p["window_arrivals"] and tail["all"]["ttft"] >= tail["all"]["prefill"] > 0
    assert w["warmup"]["requests"] > 0
    assert len(r["cold_start"]) == 2  # the first deploy, then the app deleted and deployed again
    for c in r["cold_start"]:
        assert c["rate"] == 1 and c["ready_s"] > 1 and c["whole"]["requests"] > 0
        assert c["fraction"] == pytest.approx(1 / w["search"]["goodput"])  # 2 (1 on a crowded machine)
        assert len(c["per_second"]) == 4 and c["warm"]["ttft_ms"]["n"] > 0 and "p99_ratio_max" in c["summary"]
        assert c["whole"]["errors"] == {} and c["app_status_at_ready"]
    assert r["meta"]["ready_s"] == r["cold_start"][0]["ready_s"]
    assert (out / "goodput.png").exists() and (out / "cold_start.png").exists()
    print(f"real-app goodput sweep: {took:.0f} s")


def test_a_replicas_start_is_told_in_seconds_per_phase():
    """/v1/llm/load's wall-clock phases (app/serving/startup.py) as durations, and the time to ready."""
    from app.serving.startup import StartupTimeline

    st = StartupTimeline(started_at=1000.0, code_loaded_at=993.5)
    st.add("model", 1000.5, 1012.0)
    st.extend("engine", [("graphs", 1012.0, 1030.25)])
    mps = {"mode": "mps", "evidence": "nvml"}
    load = {"replicas": [{"replica": "a", "ready_at": 1041.0, "startup": st.as_dict(), "gpu_sharing": mps},
                         {"replica": "b", "ready_at": None, "startup": None}]}
    assert startup_durations(load) == {
        "a": {"to_ready_s": 41.0, "code_to_constructor_s": 6.5, "code_loaded_at": 993.5, "ready_at": 1041.0,
              "gpu_sharing": mps, "phases_s": {"model": 11.5, "engine: graphs": 18.25}},
        "b": {"to_ready_s": None, "code_to_constructor_s": None, "code_loaded_at": None, "ready_at": None,
              "gpu_sharing": None, "phases_s": {}}}


def test_a_timeline_knows_when_its_process_loaded_the_serving_code():
    import app.serving.startup as startup

    st = startup.StartupTimeline()
    assert st.code_loaded_at == startup.IMPORTED_AT <= st.started_at and st.as_dict()["code_loaded_at"] == st.code_loaded_at


def test_the_ramp_covers_the_long_answers_seen_and_the_window_enough_arrivals():
    """A point whose workload's answers took longer than the ramp gets a ramp of 1.25 x the longest E2E
    p99 measured so far (capped); a slow rate gets a window long enough for `min_arrivals` arrivals."""
    warmup, point = {"e2e_ms": {"p99": 2500.0}}, {"e2e_ms": {"p99": 4300.0}}  # the mix on one H200
    assert workload_ramp_s(2.0, [warmup], 12.0) == pytest.approx(3.125)  # 1.25 x the warm-up's
    assert workload_ramp_s(2.0, [warmup, point], 12.0) == pytest.approx(5.375)  # and then the longest so far
    assert workload_ramp_s(2.0, [{"e2e_ms": {"p99": 180.0}}], 12.0) == 2.0  # 448² images: unchanged
    assert workload_ramp_s(2.0, [{"e2e_ms": {"p99": 60000.0}}], 12.0) == 12.0
    assert workload_ramp_s(2.0, [None], 12.0) == 2.0 and workload_ramp_s(2.0, [{"e2e_ms": {"p99": math.nan}}], 12.0) == 2.0
    assert window_for(6.0, 25.0, 400, 30.0) == pytest.approx(16.0) and window_for(6.0, 135.0, 400, 30.0) == 6.0
    assert window_for(6.0, 1.0, 400, 30.0) == 30.0 and window_for(6.0, 1.0, 0, 30.0) == 6.0


def test_a_ramp_shorter_than_the_answers_starts_the_window_short_of_completions():
    """Why the ramp follows the answers: 10 req/s from t=0, one request in five taking 4 s, the others
    0.5 s, all served (a server that keeps up). With a 2 s ramp the window's first seconds lack the
    completions of long requests never sent before t=0, and served reads under 98%; with a 4 s ramp it
    reads what the server did."""
    sent = [_sent(i, round(0.1 * i, 6), 0.01, 4.0 if i % 5 == 0 else 0.5) for i in range(300)]
    short = analyse(sent, 2.0, 8.0)
    assert short["served_ratio"] < 0.98
    assert analyse(sent, 4.0, 10.0)["served_ratio"] == pytest.approx(1.0, abs=0.02)


def test_percentiles_are_nearest_rank():
    """benchmarks/stats.py's pct: rank ceil(q n), so one slow request in 60 is the p99 (it once took rank
    round(q (n - 1)) + 1: the second largest, and a point with one 2 s TTFT in 60 passed a 500 ms bound)."""
    from benchmarks.stats import p99, pct

    assert p99([300.0] * 59 + [2000.0]) == 2000.0
    assert p99([float(i) for i in range(1, 101)]) == 99.0 and p99([float(i) for i in range(1, 1001)]) == 990.0
    assert pct([float(i) for i in range(1, 101)], 0.5) == 50.0 and pct([3.0, 1.0, 2.0], 0.5) == 2.0
    assert pct([5.0], 0.99) == 5.0 and pct([1.0, 2.0], 0.0) == 1.0 and pct([1.0, 2.0], 1.0) == 2.0
    assert math.isnan(pct([], 0.5))
