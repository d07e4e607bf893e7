"""Start-up timings on disk, so that a replica starting where one already timed skips them (a restart, a
replica added by autoscaling, the second replica on a GPU): the vision graphs' auto-tune table, the
tower's GEMM choice beside it (`TuneCache.beside`) and the engine's matrix-vector choice (app/llm/gemv.py).

Why: a replica added under load ran these timings on the GPU that a serving replica was using (its worst
second's TTFT p99 2.40x warm on one H100, 2026-11-28; 2.73x on one H200 from the tower's GEMM choice,
2026-12-04). Each key covers what its timings depend on: the GPU's name, library versions, the
checkpoint's config, dtype, settings and the source of the code that runs the timed kernels; a table
older than MAX_AGE_S is measured again. Replicas that start together take a file lock: the first times
alone, the others wait up to WAIT_S for its table. All best effort: a folder that cannot be written or
locked costs a tuning, never a start.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

log = logging.getLogger(__name__)

WAIT_S = 300.0  # how long a replica waits for another's tuning before it tunes itself
MAX_AGE_S = 7 * 86400.0  # an older table is measured again (one measured under load stays no longer)
_POLL_S = 0.2
_APP = Path(__file__).resolve().parent.parent
TOWER_CODE = (_APP / "vision", _APP / "gpu")  # the towers, and the attention backends and timing they use
ENGINE_CODE = (_APP / "llm", _APP / "gpu")  # the engine's kernels (gemv.py), and the timing


def source_digest(folders: tuple[Path, ...]) -> str:
    """A digest of the source of every .py file under `folders`: a change tunes again."""
    h = hashlib.sha256()
    for folder in folders:
        for path in sorted(folder.rglob("*.py")):
            h.update(path.relative_to(folder.parent).as_posix().encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def library_versions(names: tuple[str, ...] = ("transformers", "triton", "flash-attn-4")) -> dict[str, str | None]:
    """The versions of what else runs inside the timed kernels and modules (by default the tower's)."""
    from importlib import metadata

    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def checkpoint_parts(checkpoint: str, device, dtype) -> dict:
    """The key's parts that every start-up timing depends on: the GPU model, torch, the dtype and the
    checkpoint's config (its digest; the path where it has none)."""
    import torch

    config = Path(checkpoint) / "config.json"
    return {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__, "dtype": str(dtype),
            "config": hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else checkpoint}


class TuneCache:
    """One table of timings' results (a list of rows) in `folder`, under a key of `parts`; `what` names it
    in the log."""

    def __init__(self, folder: str | Path, parts: dict, what: str = "vision auto-tune"):
        self.folder = Path(folder)
        self.parts = parts
        self.what = what
        self.key = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]
        self.path = self.folder / f"{self.key}.json"

    def beside(self, name: str) -> TuneCache:
        """Another table under the same key's parts and `name` (a file and a lock of its own): the tower's
        GEMM choice, which the same things decide, beside the graphs' auto-tune table."""
        return TuneCache(self.folder, {**self.parts, "table": name}, f"{self.what}: {name}")

    def applied_or_measured(self, apply: Callable[[list[dict]], bool], measure: Callable[[], list[dict] | None]) -> str:
        """Under the key's lock (`claim`: replicas starting together let the first measure and the others
        read its table): the kept table if `apply` takes it, else `measure()`, whose rows are kept for the
        next replica (None: nothing worth keeping). Returns where the result came from."""
        with self.claim():
            table = self.load()
            if table is not None and apply(table):
                return f"from {self.path}"
            rows = measure()
            if rows is not None:
                self.save(rows)
        return "measured"

    def load(self) -> list[dict] | None:
        """The table, or None (none yet, unreadable, another key's, or older than MAX_AGE_S: tune again)."""
        try:
            data = json.loads(self.path.read_text())
            if data.get("parts") != json.loads(json.dumps(self.parts, default=str)):
                return None
            if not time.time() - MAX_AGE_S < float(data["written_at"]) <= time.time() + 60:
                return None
            return data["table"] if isinstance(data["table"], list) else None
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def save(self, table: list[dict]) -> None:
        """Write the table atomically (a reader sees the old file or the new, never half of one). Best
        effort: a folder that cannot be written (read-only, full) costs the next replica a tuning, no more."""
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"parts": self.parts, "table": table, "written_at": time.time()}, default=str))
            os.replace(tmp, self.path)
        except OSError as e:
            log.warning("%s: the table could not be kept in %s (%s)", self.what, self.folder, e)
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)

    @contextlib.contextmanager
    def claim(self, wait_s: float = WAIT_S) -> Iterator[bool]:
        """Hold the key's lock while tuning or reading (True), or go on without it (False) after `wait_s`
        (a replica that waited past that tunes for itself rather than not start) or where no lock can be
        had (a read-only folder, a file system without flock)."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            f = open(self.folder / f"{self.key}.lock", "a+")  # noqa: SIM115 - closed below, after the body
        except OSError as e:
            log.warning("%s: no lock in %s (%s); tuning without it", self.what, self.folder, e)
            yield False
            return
        with f:
            deadline = time.monotonic() + wait_s
            while True:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    held = True
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        log.warning("%s: another replica has held %s for %.0f s; tuning without it",
                                    self.what, self.path.name, wait_s)
                        held = False
                        break
                    time.sleep(_POLL_S)
                except OSError as e:  # ENOLCK, EOPNOTSUPP: no locks on this file system
                    log.warning("%s: no lock on %s (%s); tuning without it", self.what, f.name, e)
                    held = False
                    break
            try:
                yield held
            finally:
                if held:
                    fcntl.flock(f, fcntl.LOCK_UN)
