"""`file://` media, read only from inside one configured directory (off by default).

The path must be absolute, contain no `..` segment, and resolve (symlinks followed) inside the root.
The check is repeated on the file actually opened (its /proc/self/fd link), so a symlink swapped in
between the check and the open cannot point outside the root. Only regular files are read (a FIFO or a
device inside the root would block or never end), and never more than the byte cap.
"""

from __future__ import annotations

import os
import stat
from urllib.parse import unquote, urlsplit

from ..errors import ClientError


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _forbidden(message: str, param: str) -> ClientError:
    return ClientError(message, param=param, code="media_url_forbidden")


def read_local(url: str, *, root: str | None, max_bytes: int, param: str) -> bytes:
    if root is None:
        raise _forbidden("file:// media URLs are disabled on this server (media.allowed_local_media_path)", param)
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
        raise _forbidden("file:// media URLs take the form file:///absolute/path", param)
    path = unquote(parts.path)
    if not path.startswith("/") or "\x00" in path or ".." in path.split("/"):
        raise _forbidden("file:// media paths must be absolute, without '..'", param)
    real_root = os.path.realpath(root)
    if not _inside(os.path.realpath(path), real_root):
        raise _forbidden("file:// media path is outside the server's allowed media directory", param)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise ClientError(f"could not read the file:// media: {e.strerror}", param=param,
                          code="media_fetch_failed") from None
    try:
        try:
            opened = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # no /proc: the realpath check above stands alone
            opened = os.path.realpath(path)
        if not _inside(opened, real_root):
            raise _forbidden("file:// media path is outside the server's allowed media directory", param)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _forbidden("file:// media must be a regular file", param)
        if st.st_size > max_bytes:
            raise ClientError(f"media payload of {st.st_size} bytes exceeds the limit of {max_bytes}", param=param,
                              code="media_too_large", status=413)
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise ClientError(f"media payload exceeds the limit of {max_bytes} bytes", param=param,
                          code="media_too_large", status=413)
    return data
