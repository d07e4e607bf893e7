"""benchmarks/llm_load.py runs end to end on the CPU with the tiny model (its GPU figures are in
RESULTS.md): every request completes, and the step accounting adds up."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_llm_load_smoke(tmp_path):
    out = tmp_path / "llm_load.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "llm_load.py"), "--preset", "tiny", "--device", "cpu",
                    "--concurrency", "1", "4", "--requests", "8", "--new", "4", "--side", "8",
                    "--switch-interval-ms", "5", "0.5", "--out", str(out)], check=True, cwd=ROOT, timeout=600)
    res = json.loads(out.read_text())
    assert [(r["switch_interval_ms"], r["concurrency"]) for r in res["runs"]] == [(5, 1), (5, 4), (0.5, 1), (0.5, 4)]
    for r in res["runs"]:
        assert r["requests"] == (8 if r["concurrency"] == 1 else 16) and r["req_s"] > 0  # >= 4 per client
        # 8 requests x 4 tokens: a prefill step gives each its first token, decode steps the other 3
        assert r["steps"] == r["graph_steps"] + r["mixed_steps"] >= r["requests"] * 3 / r["concurrency"]
        assert r["latency_ms"]["p50"] >= r["engine_ms"]["p50"] > 0 and r["delivery_ms"]["p50"] >= 0
