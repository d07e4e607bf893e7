"""Where a request's time goes between the stages, from Ray Serve's own logs.

Every replica logs one line per call with Ray's request id (shared by the whole chain: proxy, Router,
MediaPreprocessor, VisionEncoder, LLM), the time the call ended and its duration. This script joins
those lines per request and prints the median and p90 of each stage and of each gap between stages.
No instrumentation in the serving path, so it measures the application as users run it.

    python benchmarks/serve_trace.py [LOG_DIR]     (default: /tmp/ray/session_latest/logs/serve)

Stages (ms): proxy = the proxy's whole request; router = the Router's handler; media, encode, llm =
those replicas' calls (under the `fused` placement `llm` includes the encoding and there is no
`encode`: the gap is media->llm). Gaps: proxy->router (HTTP proxy to the Router replica), router->media (parse,
validation, the handle call), media->encode (result back, prompt, dispatch), encode->llm (embeddings
handed over, the LLM call starting), and the Router's own `ttft_ms` (its clock, first chunk).
`llm` spans the whole generation, so it is not a TTFT.
"""

from __future__ import annotations

import re
import statistics
import sys
from collections import defaultdict
from datetime import datetime
from pathlib import Path

LINE = re.compile(r"^INFO (\S+ \S+) (\S+) \S+ (\S+) -- (.*?) (?:OK|200) ([0-9.]+)ms$")
TTFT = re.compile(r"^INFO (\S+ \S+) \S+ \S+ (\S+) -- request \S+ status=200 .*ttft_ms=([0-9.]+)")
STAGES = {"CALL prepare": "media", "CALL encode": "encode", "CALL generate": "llm",
          "CALL generate_from_media": "llm",  # the `fused` placement: encode and generate in one call
          "POST /v1/chat/completions": "http"}


def parse(log_dir: Path) -> dict[str, dict]:
    """request id -> {stage: (start_s, end_s)}, plus the Router's ttft_ms."""
    reqs: dict[str, dict] = defaultdict(dict)
    for f in sorted(log_dir.glob("*.log")):
        who = "proxy" if f.name.startswith("proxy") else "replica"
        for line in f.read_text(errors="replace").splitlines():
            if m := TTFT.match(line):
                reqs[m.group(2)]["ttft_ms"] = float(m.group(3))
                continue
            m = LINE.match(line)
            if not m or m.group(4) not in STAGES:
                continue
            end = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            stage = STAGES[m.group(4)]
            if stage == "http":
                stage = "proxy" if who == "proxy" else "router"
            reqs[m.group(3)][stage] = (end - float(m.group(5)) / 1e3, end)
    return reqs


def group_of(request_id: str) -> str:
    """benchmarks/serve.py names its requests <workload>-c<concurrency>-<offset>-<i>; others: "other"."""
    head, _, tail = request_id.rpartition("-")
    return head if head and tail.isdigit() and "-c" in head else "other"


def breakdown(reqs: dict[str, dict]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = defaultdict(list)
    for r in reqs:
        if not all(k in r for k in ("router", "llm")):  # no proxy line: direct ingress
            continue
        for k in ("proxy", "router", "media", "encode", "llm"):
            if k in r:
                out[k].append(1e3 * (r[k][1] - r[k][0]))
        if "ttft_ms" in r:
            out["router ttft"].append(r["ttft_ms"])
        if "proxy" in r:
            out["proxy->router"].append(1e3 * (r["router"][0] - r["proxy"][0]))
        if "media" in r:
            out["router->media"].append(1e3 * (r["media"][0] - r["router"][0]))
        # the step before the next call: the media call's end, else the Router's start
        before, name = (r["media"][1], "media") if "media" in r else (r["router"][0], "router")
        if "encode" in r:
            out[f"{name}->encode"].append(1e3 * (r["encode"][0] - before))
            before, name = r["encode"][1], "encode"
        out[f"{name}->llm"].append(1e3 * (r["llm"][0] - before))
    return out


def main() -> None:
    log_dir = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/ray/session_latest/logs/serve")
    groups: dict[str, list[dict]] = defaultdict(list)
    for rid, r in parse(log_dir).items():
        groups[group_of(rid)].append(r)
    print(f"{log_dir}; log timestamps have 1 ms resolution")
    for name, reqs in sorted(groups.items()):
        rows = breakdown(reqs)
        n = max((len(v) for v in rows.values()), default=0)
        if not n:
            continue
        print(f"\n{name}: {n} requests with every stage logged")
        print("| stage or gap | median ms | p90 ms |\n|---|---|---|")
        for k, v in rows.items():
            v = sorted(v)
            print(f"| {k} | {statistics.median(v):.1f} | {v[int(0.9 * (len(v) - 1))]:.1f} |")


if __name__ == "__main__":
    main()
