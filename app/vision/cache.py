"""LRU cache of per-item encoder outputs, bounded in bytes.

Keys come from the router: a hash of the decoded pixels plus every preprocessing parameter
(see app.media.pipeline.cache_key), so a repeated image or video skips the encoder entirely.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

Entry = tuple[torch.Tensor, list[torch.Tensor]]


def entry_bytes(e: Entry) -> int:
    main, deepstack = e
    return main.numel() * main.element_size() + sum(d.numel() * d.element_size() for d in deepstack)


class EmbeddingCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._data: OrderedDict[str, Entry] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str | None) -> Entry | None:
        if key is None or self.max_bytes <= 0:
            return None
        with self._lock:
            e = self._data.get(key)
            if e is None:
                self.misses += 1
                return None
            self._data.move_to_end(key)
            self.hits += 1
            return e

    def put(self, key: str | None, e: Entry) -> None:
        size = entry_bytes(e)
        if key is None or size > self.max_bytes:
            return
        with self._lock:
            if key in self._data:
                self._data.move_to_end(key)
                return
            self._data[key] = e
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, old = self._data.popitem(last=False)
                self.bytes -= entry_bytes(old)

    def __len__(self) -> int:
        return len(self._data)

    def stats(self) -> dict:
        return {"cache_hits": self.hits, "cache_misses": self.misses, "cache_entries": len(self._data),
                "cache_bytes": self.bytes}
