"""Input rows and output shards.

Input: JSONL (one chat-completion body per line, with an `id`) or Parquet with the same columns.
A line that is not a JSON object, or has no usable id, still becomes a row: it gets the id
`line-<n>` (its 1-based line number, stable across reruns) and an error object, so one bad line never
stops the job and every line is answered once.

Output: `part-NNNNN.jsonl` shards in the output folder, each written whole to a temporary file,
flushed to disk and renamed into place. A kill leaves complete shards and at most a stray temporary
file (removed on the next run), never half a line. On a rerun the ids in the existing shards are
skipped and new shards are numbered after the last one, so earlier shards are never touched.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import ClientError

SHARD = re.compile(r"^part-(\d{5,})\.jsonl$")


@dataclass
class Row:
    line: int  # 1-based line (JSONL) or row number (Parquet)
    id: str
    body: dict | None
    error: ClientError | None = None


FALLBACK_ID = re.compile(r"^line-\d+$")  # the ids of lines without a usable one: reserved


def _row(line: int, body, seen: set[str]) -> Row:
    fallback = f"line-{line}"
    if not isinstance(body, dict):
        return Row(line, fallback, None, ClientError("the line is not a JSON object", code="invalid_json"))
    rid = body.get("id")
    if isinstance(rid, bool) or not isinstance(rid, str | int) or rid == "":
        return Row(line, fallback, None, ClientError("each request needs an 'id' (a string or an integer)",
                                                     param="id", code="invalid_id"))
    rid = str(rid)
    if FALLBACK_ID.match(rid):  # it could be a bad line's record: two lines would share an id
        return Row(line, fallback, None, ClientError(f"ids of the form 'line-<n>' are reserved for lines without "
                                                     f"a usable id; got {rid!r}", param="id", code="invalid_id"))
    if rid in seen:
        return Row(line, fallback, None, ClientError(f"id {rid!r} appears on an earlier line", param="id",
                                                     code="duplicate_id"))
    seen.add(rid)
    body = {k: v for k, v in body.items() if k not in ("id", "stream_options")}  # an online body may carry them
    body["stream"] = False  # a batch answer is one object
    return Row(line, rid, body)


def _jsonl(path: Path) -> Iterator[tuple[int, object]]:
    with path.open("rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                yield n, json.loads(raw)
            except (ValueError, UnicodeDecodeError, RecursionError) as e:  # RecursionError: nested too deep
                yield n, ClientError(f"line {n} is not valid JSON: {type(e).__name__}: {e}", code="invalid_json")


def _parquet(path: Path) -> Iterator[tuple[int, object]]:
    """Columns as the JSONL keys. Nulls are dropped (Parquet fills absent fields with them); a column
    of strings where an object or list belongs (e.g. `messages` stored as JSON text) is parsed."""
    try:
        import pyarrow.parquet as pq
    except ImportError as e:  # optional extra: pip install 'vlm-serve[batch]'
        raise SystemExit("Parquet input needs pyarrow: pip install pyarrow") from e
    n = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        for rec in batch.to_pylist():
            n += 1
            body = {k: v for k, v in rec.items() if v is not None}
            try:
                if isinstance(body.get("messages"), str):
                    body["messages"] = json.loads(body["messages"])
            except (ValueError, RecursionError) as e:
                yield n, ClientError(f"row {n}: 'messages' is not valid JSON: {type(e).__name__}: {e}",
                                     param="messages", code="invalid_json")
                continue
            yield n, body


def read_rows(path: str | os.PathLike) -> Iterator[Row]:
    p = Path(path)
    source = _parquet(p) if p.suffix == ".parquet" else _jsonl(p)
    seen: set[str] = set()
    for line, body in source:
        if isinstance(body, ClientError):
            yield Row(line, f"line-{line}", None, body)
        else:
            yield _row(line, body, seen)


def count_rows(path: str | os.PathLike) -> int:
    """For the ETA: non-blank lines, or the Parquet row count from its footer."""
    p = Path(path)
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(p).metadata.num_rows
    with p.open("rb") as f:
        return sum(1 for raw in f if raw.strip())


class ShardWriter:
    """Existing shards are read once for their ids (resume), then left alone. The folder's lock is taken
    first: a second driver started on a folder another is writing must not delete that one's shard in
    progress (a `.part-*.tmp`) before it is refused."""

    def __init__(self, folder: str | os.PathLike, shard_rows: int):
        self.folder, self.shard_rows = Path(folder), shard_rows
        self.folder.mkdir(parents=True, exist_ok=True)
        self._lock_folder()
        for stray in self.folder.glob(".part-*.tmp"):  # a shard being written when the last run died
            stray.unlink()
        self.done: set[str] = set()
        last = -1
        for f in sorted(self.folder.iterdir()):
            m = SHARD.match(f.name)
            if m:
                last = max(last, int(m.group(1)))
                with f.open("rb") as fh:
                    self.done.update(json.loads(line)["id"] for line in fh if line.strip())
        self.next_index = last + 1
        self.buffer: list[bytes] = []
        self.shards_written = 0

    def _lock_folder(self) -> None:
        """Refuse a folder another driver is writing to now (a lock held while this process lives, or
        until `release`: two writers would both number their shards from the same index, and one rename
        would replace the other's rows)."""
        import fcntl

        self._lock = open(self.folder / ".lock", "a")  # noqa: SIM115 - held until the process ends
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock.close()
            self._lock = None
            raise RuntimeError(f"another batch job is writing to {self.folder}") from None

    def claim(self, input_path: str | os.PathLike) -> None:
        """Make the folder this job's (its lock is held since the constructor), or refuse an earlier job's
        output for another input (whose ids, often 0, 1, 2..., would be skipped as answered)."""
        if getattr(self, "_lock", None) is None:  # released: take it again
            self._lock_folder()
        source = str(Path(input_path).resolve())
        manifest = self.folder / "manifest.json"
        if manifest.is_file():
            other = json.loads(manifest.read_text()).get("input")
            if other != source:
                self.release()
                raise RuntimeError(f"{self.folder} holds the output of a job over {other}; this job reads {source}: "
                                   "use another output folder (or remove manifest.json to resume there anyway)")
        else:
            write_json_atomic(manifest, {"input": source})

    def release(self) -> None:
        """Let another driver have the folder (this job ended)."""
        lock = getattr(self, "_lock", None)
        if lock is not None:
            lock.close()
            self._lock = None

    def add(self, record: dict) -> None:
        self.buffer.append(json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode() + b"\n")
        if len(self.buffer) >= self.shard_rows:
            self.flush()

    def flush(self) -> None:
        if not self.buffer:
            return
        tmp = self.folder / f".part-{self.next_index:05d}.jsonl.tmp"
        with tmp.open("wb") as f:
            f.writelines(self.buffer)
            f.flush()
            os.fsync(f.fileno())
        # a hard link, not a rename: it fails rather than replace a shard of that name, which only another
        # writer can have made (on storage where the folder's lock does nothing); then the next index
        while True:
            final = self.folder / f"part-{self.next_index:05d}.jsonl"
            try:
                os.link(tmp, final)
                tmp.unlink()
                break
            except FileExistsError:
                self.next_index += 1
            except OSError:  # no hard links on this storage (some FUSE mounts): the rename, as before
                os.replace(tmp, final)
                break
        dir_fd = os.open(self.folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # the rename itself survives a power cut
        finally:
            os.close(dir_fd)
        self.next_index += 1
        self.shards_written += 1
        self.buffer = []


def write_json_atomic(path: str | os.PathLike, obj: dict) -> None:
    p = Path(path)
    tmp = p.with_name(f".{p.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    os.replace(tmp, p)
