"""The device copy of the running requests' block tables: one row per running request.

A request takes a row when it first runs and gives it back when it finishes or is preempted; its
row holds the KV blocks the block manager gave it. A step sends only the entries that changed
since the last (`updates`, applied on the device by `apply`), not whole tables. The last row is
all zeros, the row of a CUDA graph's padding: block 0, nobody's cache.
"""

from __future__ import annotations

import numpy as np
import torch

from .sequence import Sequence


class BlockTables:
    def __init__(self, max_num_seqs: int, max_blocks: int, device: torch.device):
        self.max_blocks = max_blocks
        self.padding_row = max_num_seqs
        self.tensor = torch.zeros(max_num_seqs + 1, max_blocks, dtype=torch.int32, device=device)
        self.written = [0] * max_num_seqs  # entries already on the device, per row
        self.free = list(range(max_num_seqs - 1, -1, -1))

    def assign(self, seq: Sequence) -> int:
        seq.row = self.free.pop()
        self.written[seq.row] = 0
        return seq.row

    def release(self, seq: Sequence) -> None:
        if seq.row >= 0:
            self.free.append(seq.row)
            seq.row = -1

    def updates(self, seqs: list[Sequence]) -> tuple[np.ndarray, np.ndarray]:
        """(flat indices, block ids) of the entries the device lacks; counted as written."""
        idx, val = [], []
        for s in seqs:
            done = self.written[s.row]
            if len(s.block_table) > done:
                base = s.row * self.max_blocks
                idx.extend(range(base + done, base + len(s.block_table)))
                val.extend(s.block_table[done:])
                self.written[s.row] = len(s.block_table)
        return np.array(idx, dtype=np.int32), np.array(val, dtype=np.int32)

    def apply(self, idx: torch.Tensor, val: torch.Tensor) -> None:
        """On the device, from the step's copy of `updates`."""
        if idx.numel():
            self.tensor.view(-1)[idx] = val
