"""Media for batch rows: what serving accepts (`data:` and `http(s)` URLs, through the same
`app.media.fetch.fetch`), plus files on local or shared storage, as a bare path or a `file://` URL.

Files are read only under the configured `file_root`: the path is resolved (symlinks and `..`
included) and must stay inside it, so an input file cannot make the job read e.g. /etc or a key. The
read itself is the server's `file://` reader (`app.media.local_files.read_local`): the opened file is
checked against the root again, only regular files are read (a FIFO would block), never past the byte
cap. Everything after the bytes (decode, resize, patchify, cache key) is the serving pipeline's
`prepare_bytes`, under the same worker slots and decode deadline as the server's items.
"""

from __future__ import annotations

import asyncio
from functools import partial
from pathlib import Path
from urllib.parse import quote, unquote, urlparse

from ..errors import ClientError
from ..media.local_files import read_local
from ..media.pipeline import MediaPipeline, PreparedItem, prepare_bytes
from ..media.ref import MediaRef
from ..media.workers import run_item


def resolve_file(url: str, root: str | None, param: str) -> Path:
    """The real path a file URL or path names, refused unless it lies under `root`."""
    if root is None:
        raise ClientError("file media are not enabled for this job (set file_root)", param=param,
                          code="invalid_media_url")
    if url.startswith("file://"):
        parsed = urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise ClientError("file:// URLs must name a local path", param=param, code="invalid_media_url")
        raw = unquote(parsed.path)
    else:
        raw = url
    base = Path(root).resolve()
    try:
        path = (base / raw).resolve()  # an absolute `raw` replaces base; then it must still be inside it
    except (RuntimeError, OSError, ValueError) as e:  # a symlink loop (RuntimeError on 3.11), a NUL byte, ...
        raise ClientError(f"{url} cannot be resolved: {type(e).__name__}", param=param,
                          code="invalid_media_url") from None
    if not path.is_relative_to(base):
        raise ClientError(f"{url} is outside the job's file root", param=param, code="invalid_media_url")
    return path


def _read(path: Path, root: str, max_bytes: int, param: str) -> bytes:
    data = read_local("file://" + quote(str(path)), root=root, max_bytes=max_bytes, param=param)
    if not data:
        raise ClientError("empty media payload", param=param, code="invalid_media")
    return data


class BatchMediaPipeline(MediaPipeline):
    """MediaPipeline whose fetch also reads files under `root`."""

    def __init__(self, *args, root: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.root = root

    async def prepare(self, ref: MediaRef, slots: asyncio.Semaphore | None = None) -> PreparedItem:
        if ref.url.startswith(("data:", "http://", "https://")):
            return await super().prepare(ref, slots)
        path = resolve_file(ref.url, self.root, ref.param)
        hold = self.budget.hold(ref.param)
        try:
            data = await hold.read_capped(self.cfg.max_media_bytes,
                                          partial(_read, path, self.root, self.cfg.max_media_bytes, ref.param))
        except BaseException:
            hold.release()
            raise
        return await run_item(self.executor, slots, self.cfg.decode_timeout_s, ref.param,
                              prepare_bytes, data, ref, self.cfg, self.spec, release=hold.release)
