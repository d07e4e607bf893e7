"""Device-resident tower metadata per batch layout, cached.

Building a batch's metadata on the host (position ids, permutations, `cu_seqlens`, attention tables)
and copying it over costs about as much as a tenth of a 448^2 image's replay, and the GPU idles
meanwhile. Serving traffic repeats layouts (the same image size, the same video chunking), so the
finished device tensors are kept in a small LRU, keyed by what defines them: the items' grids, the
token budget they are padded to, and the uniform shape. What the tensors are is the tower's business
(`GraphTower.metadata`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

import torch

from .metadata import BatchLayout

Builder = Callable[[BatchLayout, int | None, tuple[int, int] | None], dict[str, torch.Tensor]]


class DeviceMetadataCache:
    def __init__(self, build: Builder, device: torch.device, entries: int = 64):
        """`build(layout, budget, uniform)` -> host tensors (padded when `budget` is given)."""
        self.build, self.device = build, device
        self.entries = entries  # at most ~0.5 MB each (an 8192-token budget)
        self.hits = self.misses = 0
        self._data: OrderedDict[tuple, dict[str, torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def key(lay: BatchLayout, budget: int | None, uniform: tuple[int, int] | None) -> tuple:
        return tuple(lay.grids), budget, uniform

    def get(self, lay: BatchLayout, budget: int | None, uniform: tuple[int, int] | None) -> dict[str, torch.Tensor]:
        """Metadata for `lay`, padded to `budget` tokens (None: exact, for the eager path)."""
        key = self.key(lay, budget, uniform)
        with self._lock:
            meta = self._data.get(key)
            if meta is not None:
                self._data.move_to_end(key)
                self.hits += 1
                return meta
        meta = {k: t.to(self.device, non_blocking=True) for k, t in self.build(lay, budget, uniform).items()}
        with self._lock:
            self.misses += 1
            self._data[key] = meta
            while len(self._data) > self.entries:
                self._data.popitem(last=False)
        return meta
