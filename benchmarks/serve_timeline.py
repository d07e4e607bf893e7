"""Where a deploy's time goes before the replicas' own code runs, read back from Ray Serve's logs.

Why: on one H200 a first deploy of the 2B preset was ready in 61.7 s, of which 19.5 s passed between
the deploy call and the LLM replica's worker loading our code (benchmarks/results/2026-12-01-encode-parts-
ready-h200.md). The replicas' own timelines (app/serving/startup.py) cannot see that part. Ray Serve's
controller logs its steps with wall-clock times: when it took the app, when the builder (its own Ray task,
importing `deployments.app`) had built it, when it added each deployment's replicas, and when each
replica's constructor returned. The builder's log says when its task began.
"""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path

_STAMP = re.compile(r"^\w+ (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
# (pattern, event): the controller's messages (Ray 2.60), then the builder's
CONTROLLER_EVENTS = (
    (re.compile(r"Deploying new app '(?P<app>[^']+)'"), "controller: deploying the app"),
    (re.compile(r"Imported and built app '(?P<app>[^']+)'"), "controller: the app built"),
    (re.compile(r"Adding (?P<n>\d+) replicas? to Deployment\(name='(?P<dep>[^']+)'"), "controller: {n} {dep} replica(s) added"),
    (re.compile(r"Replica\(id='(?P<id>[^']+)', deployment='(?P<dep>[^']+)'.*started successfully.*after (?P<s>[\d.]+)s"),
     "controller: {dep} replica {id} started ({s} s after it was added)"),
)
BUILD_EVENTS = ((re.compile(r"Importing application '(?P<app>[^']+)'"), "builder: its task began importing the app"),)


def _stamp(line: str) -> float | None:
    """The wall-clock time of a Ray log line (its local time, as Ray's formatter writes it)."""
    m = _STAMP.match(line)
    if not m:
        return None
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _events(path: Path, patterns) -> list[tuple[float, str]]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        for pattern, what in patterns:
            m = pattern.search(line)
            t = _stamp(line) if m else None
            if t is not None:
                out.append((t, what.format(**m.groupdict())))
                break
    return out


def deploy_timeline(serve_log_dir: str | Path, since: float) -> list[dict]:
    """The controller's and the builder's steps found in `serve_log_dir` (a Ray session's logs/serve), in
    time order, as {"at_s": seconds after `since` (the deploy call's wall time), "event"}; steps more than
    a second before `since` (an earlier deploy in the same session) are left out."""
    d = Path(serve_log_dir)
    found: list[tuple[float, str]] = []
    for path in sorted(d.glob("controller_*.log")):
        found += _events(path, BUILD_EVENTS if path.name.startswith("controller_build") else CONTROLLER_EVENTS)
    return [{"at_s": round(t - since, 2), "event": e} for t, e in sorted(found) if t >= since - 1.0]
