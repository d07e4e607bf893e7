"""What the slowest requests waited for: their time to first token split into its parts, against every request's.

A p99 is set by a few requests. The histograms of the replicas' parts say how often each part is long, not
whether the long parts belong to the slow requests. Here each request brings its own parts: a client that
sends `X-TTFT-Parts` gets them first in its streamed answer, as an SSE comment (app/api/chat.py,
`parts_comment_text`; benchmarks/serve.py's `one_request(parts=True)` reads it, and goodput.py asks for every
request), and every Router logs them on its line per request (`parts_ms=`; the CLI below reads those lines,
found by their ids: an `X-Request-Id` names the answer `chatcmpl-<id>`, as in vLLM). The mean of each part
is taken over the slowest share of requests (by the client's time to first token) and over all of them.
Means add up, so the parts of each column sum to its time to first token.

    python benchmarks/ttft_tail.py LOG_DIR ID_PREFIX [--share 0.01]     (a Ray session's logs/serve)

Ray Serve's throughput-optimised mode (deployments/ray_env.py) buffers the replicas' log lines, 1,000 at a
time, so the newest requests' lines may not be on disk yet.

Parts, ms (each a mean): `body` the request's body read (the Router's start to its parsing), `parse`, `media`
(decode and patchify, here or in a MediaPreprocessor replica), `prompt`; `to replica` the Ray call's way to the
LLM replica's handler (routing, the call, the replica's event loop) and `from replica` the first chunk's way
back to the Router's loop, split by the two processes' wall clocks (without them, `to replica` is the whole
way: what the Router's time to first token has beyond its own parts and the replica's); in the replica
(`fused`): `payload` the media rows from the object
store, `encode wait/run/wake` the tower's queue, batch and the loop's lag after it (`encode rest`: the
batcher's own), `queue` waiting for the engine, `prefill` its first step to the first token, `replica rest`
the first chunk's way out of the replica; `client` the client's time beyond the Router's (the answer's first
bytes through HTTP, the client's own loop; without the client's times, as from the logs, it is 0).
"""

from __future__ import annotations

import argparse
import re
import statistics
from pathlib import Path

LINE = re.compile(r"-- request (\S+) status=200 .*?ttft_ms=([0-9.]+) .*?parts_ms=(\S+)")
REPLICA_OWN = ("payload", "encode", "queue", "prefill")  # the replica's reported parts (`encode` holds its own)


def _inside(p: dict) -> float:
    """The replica's share of the TTFT: its own time to the first chunk (`fused`: `replica`), else the
    parts it reported (a replica without the tower reports queue and prefill only)."""
    return p["replica"] if "replica" in p else sum(p.get(k, 0.0) for k in REPLICA_OWN)


def _way(p: dict) -> float:
    """The Router's TTFT beyond its own parts and the replica's: the way there and back."""
    return p["router_ttft"] - p["before"] - _inside(p)


# (label, how it is made from a request's parts in ms: its own key, or a difference)
PARTS = [
    ("body", lambda p: p["before"] - p.get("parse", 0) - p.get("media", 0) - p.get("prompt", 0)),
    ("parse", lambda p: p.get("parse", 0.0)),
    ("media", lambda p: p.get("media", 0.0)),
    ("prompt", lambda p: p.get("prompt", 0.0)),
    # the way to the LLM replica and back: split by the wall clocks where the parts have them
    ("to replica", lambda p: p["to_replica"] if "to_replica" in p else _way(p)),
    ("from replica", lambda p: _way(p) - p["to_replica"] if "to_replica" in p else 0.0),
    ("payload", lambda p: p.get("payload", 0.0)),
    ("encode wait", lambda p: p.get("encode_wait", 0.0)),
    ("encode run", lambda p: p.get("encode_run", 0.0)),
    ("encode wake", lambda p: p.get("encode_wake", 0.0)),
    ("encode rest", lambda p: p.get("encode", 0.0) - p.get("encode_wait", 0.0) - p.get("encode_run", 0.0)
     - p.get("encode_wake", 0.0)),
    ("queue", lambda p: p.get("queue", 0.0)),
    ("prefill", lambda p: p.get("prefill", 0.0)),
    ("replica rest", lambda p: p["replica"] - sum(p.get(k, 0.0) for k in REPLICA_OWN) if "replica" in p else 0.0),
    ("client", lambda p: p["client_ttft"] - p["router_ttft"]),
]


def parse_parts(text: str) -> dict[str, float]:
    """`before:10.0,parse:0.2,...` (app/api/chat.py, `parts_text`) as {name: ms}; ValueError if one is not."""
    return {k: float(v) for k, _, v in (item.partition(":") for item in text.split(",") if item)}


def parse_line(line: str) -> tuple[str, float, dict[str, float]] | None:
    """(request id, the Router's time to first token in ms, its parts in ms) of a Router's request line."""
    m = LINE.search(line)
    if not m:
        return None
    try:
        return m.group(1), float(m.group(2)), parse_parts(m.group(3))
    except ValueError:
        return None


def read_parts(log_dir: Path, tag: str) -> dict[str, tuple[float, dict[str, float]]]:
    """Request id (without `chatcmpl-`) -> (the Router's TTFT ms, parts ms), for the ids that start with `tag`,
    from every replica log in `log_dir` (only the Routers write these lines)."""
    out = {}
    needle = f"request chatcmpl-{tag.rstrip('-')}-"  # `goodput-1-5`'s own ids, not `goodput-1-50`'s
    for f in sorted(Path(log_dir).glob("*.log")):
        with open(f, errors="replace") as fh:
            for line in fh:
                if needle in line and (got := parse_line(line)) is not None:
                    rid, ttft, parts = got
                    out[rid.removeprefix("chatcmpl-")] = (ttft, parts)
    return out


def attribution(requests: list[tuple[float, float, dict[str, float]]], share: float = 0.01) -> dict:
    """`requests`: (client TTFT ms, Router TTFT ms, parts ms) each. The mean of every part over all of them
    and over the slowest `share` by the client's TTFT (at least one request); the parts sum to the TTFT."""
    if not requests:
        return {"requests": 0}
    rows = sorted(requests, key=lambda r: r[0])
    slow = rows[-max(1, round(share * len(rows))):]

    def means(sel) -> dict[str, float]:
        out = {"ttft": statistics.fmean(r[0] for r in sel)}
        for label, make in PARTS:
            out[label] = statistics.fmean(make({**r[2], "client_ttft": r[0], "router_ttft": r[1]}) for r in sel)
        return out

    return {"requests": len(rows), "share": share, "slowest": len(slow), "slowest_from_ms": slow[0][0],
            "all": means(rows), "slow": means(slow)}


def table(att: dict) -> list[str]:
    """Markdown: one row per part, all requests against the slowest share."""
    if not att.get("requests"):
        return ["(no request lines with parts were found)"]
    a, s = att["all"], att["slow"]
    head = (f"| part, mean ms | all {att['requests']} requests | slowest {att['slowest']} "
            f"({100 * att['share']:g}%, from {att['slowest_from_ms']:.0f} ms) |")
    lines = [head, "|---|---|---|", f"| **TTFT** | **{a['ttft']:.1f}** | **{s['ttft']:.1f}** |"]
    lines += [f"| {label} | {a[label]:.1f} | {s[label]:.1f} |" for label, _ in PARTS]
    return lines


def tables_by_rate(points: list[tuple[str, dict]]) -> list[str]:
    """Markdown: one row per part, a column per (label, attribution) of each point: all / slowest."""
    points = [(label, att) for label, att in points if att.get("requests")]
    if not points:
        return []
    head = "| part, mean ms: all / slowest | " + " | ".join(
        f"{label} ({att['slowest']} of {att['requests']}, from {att['slowest_from_ms']:.0f} ms)"
        for label, att in points) + " |"
    lines = [head, "|---|" + "---|" * len(points)]
    for label in ["ttft", *(name for name, _ in PARTS)]:
        cells = [f"{att['all'][label]:.1f} / {att['slow'][label]:.1f}" for _, att in points]
        name = "**TTFT**" if label == "ttft" else label
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("log_dir", type=Path)
    ap.add_argument("tag", help="the requests' id prefix, after chatcmpl- (goodput.py: goodput-<schedule>-<rate>)")
    ap.add_argument("--share", type=float, default=0.01)
    a = ap.parse_args(argv)
    found = read_parts(a.log_dir, a.tag)  # without the client's times, the Router's stand in for them
    print("\n".join(table(attribution([(t, t, p) for t, p in found.values()], a.share))))


if __name__ == "__main__":
    main()
