"""The vision graphs' auto-tune table on disk, so that a replica starting where one already tuned skips
the timing runs (a restart, a replica added by autoscaling, the second replica on a GPU).

Why: on one H100 an LLM replica spent 21-28 of its 26-34 s start in the tower's phase, two replicas
tuning at once on one GPU (2026-11-28), and a replica added under load time-sliced that work against the
serving one (its worst second's TTFT p99 2.40x warm). The key covers what the timings depend on: the
GPU's name, torch's version, the checkpoint's config, the dtype, the graph settings and the source of
app/vision (a code change tunes again). Replicas that start together take a file lock: the first tunes
alone on the GPU, the others wait up to WAIT_S for its table, then read it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

WAIT_S = 300.0  # how long a replica waits for another's tuning before it tunes itself
_POLL_S = 0.2


def source_digest(folder: Path = Path(__file__).parent) -> str:
    """A digest of the tower code's source (every .py file under `folder`): a change tunes again."""
    h = hashlib.sha256()
    for path in sorted(folder.rglob("*.py")):
        h.update(path.relative_to(folder).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


class TuneCache:
    """One auto-tune table (GraphManager.autotune_table's rows) in `folder`, under a key of `parts`."""

    def __init__(self, folder: str | Path, parts: dict):
        self.folder = Path(folder)
        self.parts = parts
        self.key = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]
        self.path = self.folder / f"{self.key}.json"

    def load(self) -> list[dict] | None:
        """The table, or None (none yet, or unreadable: tune again)."""
        try:
            data = json.loads(self.path.read_text())
            return data["table"] if data.get("parts") == json.loads(json.dumps(self.parts, default=str)) else None
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def save(self, table: list[dict]) -> None:
        """Write the table atomically (a reader sees the old file or the new, never half of one)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"parts": self.parts, "table": table, "written_at": time.time()}, default=str))
        os.replace(tmp, self.path)

    @contextlib.contextmanager
    def claim(self, wait_s: float = WAIT_S) -> Iterator[bool]:
        """Hold the key's lock while tuning or reading (True), or go on without it after `wait_s` (False):
        a replica that waited past that tunes for itself rather than not start."""
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / f"{self.key}.lock", "a+") as f:
            deadline = time.monotonic() + wait_s
            while True:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    held = True
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        log.warning("vision auto-tune: another replica has held %s for %.0f s; tuning without it",
                                    self.path.name, wait_s)
                        held = False
                        break
                    time.sleep(_POLL_S)
            try:
                yield held
            finally:
                if held:
                    fcntl.flock(f, fcntl.LOCK_UN)
