"""Device-resident tower metadata per batch layout, cached.

Building a batch's metadata on the host (interpolation taps, rotary ids, `cu_seqlens`, the
attention block table) and copying it over costs about as much as a tenth of a 448^2 image's
replay, and the GPU idles meanwhile. Serving traffic repeats layouts (the same image size, the
same video chunking), so the finished device tensors are kept in a small LRU, keyed by what
defines them: the items' grids, the token budget they are padded to, and the uniform shape.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from .attention import block_m_for, block_table, table_rows
from .metadata import BatchLayout, TowerGeometry, cu_seqlens, position_metadata


def table_layout(budget: int, uniform: tuple[int, int] | None, seq_slots: int) -> tuple[int, int]:
    """(query rows per block, table rows) of the attention table for a padded budget or uniform graph."""
    bm = block_m_for(uniform[1] if uniform else None)
    return bm, table_rows(budget, seq_slots, bm)


@dataclass(frozen=True)
class DeviceMetadata:
    """Tower inputs besides the pixels. Padded (zero rows, monotonic cu_seqlens, empty table rows)
    when built for a budget; exact otherwise."""

    taps: torch.Tensor
    weights: torch.Tensor
    rot: torch.Tensor
    cu: torch.Tensor
    table: torch.Tensor | None
    block_m: int


class DeviceMetadataCache:
    def __init__(self, geo: TowerGeometry, device: torch.device, seq_slots: int, with_table: bool,
                 entries: int = 64):
        self.geo, self.device, self.seq_slots, self.with_table = geo, device, seq_slots, with_table
        self.entries = entries  # at most ~0.5 MB each (an 8192-token budget)
        self.hits = self.misses = 0
        self._data: OrderedDict[tuple, DeviceMetadata] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def key(lay: BatchLayout, budget: int | None, uniform: tuple[int, int] | None) -> tuple:
        return tuple(lay.grids), budget, uniform

    def get(self, lay: BatchLayout, budget: int | None, uniform: tuple[int, int] | None) -> DeviceMetadata:
        """Metadata for `lay`, padded to `budget` tokens (None: exact, for the eager path)."""
        key = self.key(lay, budget, uniform)
        with self._lock:
            meta = self._data.get(key)
            if meta is not None:
                self._data.move_to_end(key)
                self.hits += 1
                return meta
        meta = self._build(lay, budget, uniform)
        with self._lock:
            self.misses += 1
            self._data[key] = meta
            while len(self._data) > self.entries:
                self._data.popitem(last=False)
        return meta

    def _build(self, lay: BatchLayout, budget: int | None, uniform: tuple[int, int] | None) -> DeviceMetadata:
        taps, weights, rot = position_metadata(lay.grids, self.geo)
        n, seqs = lay.num_tokens, list(lay.seq_lens)
        if budget is None:
            cu = cu_seqlens(seqs)
            bm, rows = block_m_for(uniform[1] if uniform else None), None
        else:
            pad = budget - n
            if pad:  # zero rows: valid table indices, finite values
                taps, weights, rot = (torch.cat([t, t.new_zeros(pad, t.shape[1])]) for t in (taps, weights, rot))
                seqs.append(pad)  # the padding tokens are one more sequence, as in cu_seqlens
            cu = cu_seqlens(lay.seq_lens, pad_to_tokens=budget, pad_to_seqs=self.seq_slots)
            bm, rows = table_layout(budget, uniform, self.seq_slots)
        table = block_table(seqs, rows, bm) if self.with_table else None
        dev = self.device
        return DeviceMetadata(*(t.to(dev, non_blocking=True) for t in (taps, weights, rot, cu)),
                              table.to(dev, non_blocking=True) if table is not None else None, bm)
