"""benchmarks/fused_load.py on the CPU with the tiny model, so the GPU ceiling benchmark cannot rot
between GPU runs: every stage runs, and every request it times really generated its tokens."""

from __future__ import annotations

import json

from benchmarks.fused_load import main


def test_every_stage_runs_and_every_request_generates_its_tokens(tmp_path, model_cache):
    out = tmp_path / "fused_load.json"
    res = main(["serve_config.yaml", "--image-size", "64", "--concurrency", "1", "3", "--requests", "6",
                "--distinct", "3", "--app-args", json.dumps({"cache_dir": model_cache}), "--out", str(out)])
    assert json.loads(out.read_text()) == res
    runs = [(r["stage"], r["concurrency"]) for r in res["runs"]]
    assert runs == [(s, c) for c in (1, 3) for s in ("tower", "llm", "fused")]
    for r in res["runs"]:
        assert r["requests"] == (6 if r["concurrency"] == 1 else 9) and r["req_s"] > 0
        if r["stage"] == "tower":
            assert r["completion_tokens"] == 0 and not r["ttft_ms"]
        else:  # 16 output tokens each (ignore_eos), and a first token before the last
            assert r["completion_tokens"] == 16 * r["requests"]
            assert 0 < r["ttft_ms"]["p50"] <= r["latency_ms"]["p50"]
