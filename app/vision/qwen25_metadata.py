"""Window-attention metadata for the Qwen2.5-VL tower, built on the host from the grids.

Qwen2.5-VL's tower attends within windows of `window_size` pixels (112 px = 8 x 8 patches = 4 x 4
merge units) in most layers and over whole frames in the `fullatt_block_indexes` layers. The
reference reorders the patches so that every window is contiguous (`window_index`, in merge units),
runs all blocks in that order, and restores the processor's order after the merger. Everything that
depends on the grids is computed here, outside any graph (`qwen25_metadata` lists it). Windows never
cross a frame, so frames stay contiguous in window order and one `cu` serves the full-attention
layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from .metadata import BatchLayout, Grid, _block_order_rows_cols, cu_seqlens


@dataclass(frozen=True)
class WindowGeometry:
    merge: int  # spatial merge size
    window: int  # window side in merge units (window_size // merge // patch)

    @property
    def unit(self) -> int:
        return self.merge * self.merge

    @property
    def window_tokens(self) -> int:
        """Patches in a full window."""
        return self.window * self.window * self.unit

    @classmethod
    def from_config(cls, cfg) -> WindowGeometry:
        return cls(merge=cfg.spatial_merge_size, window=cfg.window_size // cfg.spatial_merge_size // cfg.patch_size)


@lru_cache(maxsize=512)
def frame_windows(h: int, w: int, geo: WindowGeometry) -> tuple[torch.Tensor, tuple[int, ...]]:
    """For one h x w (patches) frame: its merge units in window order (windows row by row, units row by
    row inside each; the reference's `window_index` for one frame) and each window's size in patches."""
    gh, gw, s = h // geo.merge, w // geo.merge, geo.window
    units = torch.arange(gh * gw).view(gh, gw)
    order, sizes = [], []
    for r in range(0, gh, s):
        for c in range(0, gw, s):
            block = units[r:r + s, c:c + s].flatten()
            order.append(block)
            sizes.append(block.numel() * geo.unit)
    return torch.cat(order), tuple(sizes)


def window_sizes(grids: list[Grid], geo: WindowGeometry) -> list[int]:
    """Window lengths (patches) of a batch, in window order."""
    return [n for t, h, w in grids for n in frame_windows(h, w, geo)[1] * t]


def window_metadata(grids: list[Grid], geo: WindowGeometry) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(perm [N], rot [N, 2] in window order, unperm [N / unit]) for a batch, exact (no padding)."""
    unit_order, rots, base = [], [], 0
    for t, h, w in grids:
        order, _ = frame_windows(h, w, geo)
        per_frame = h * w // geo.unit
        rows, cols = _block_order_rows_cols(h, w, geo.merge)
        frame_rot = torch.stack([rows, cols], dim=-1)
        for _ in range(t):
            unit_order.append(order + base)
            rots.append(frame_rot)
            base += per_frame
    window_index = torch.cat(unit_order)  # the reference's window_index
    perm = (window_index[:, None] * geo.unit + torch.arange(geo.unit)).flatten()
    rot = torch.cat(rots)[perm]
    return perm, rot, torch.argsort(window_index)


def padding_windows(pad: int, geo: WindowGeometry) -> list[int]:
    """Padding tokens cut into windows of at most a window's size."""
    full, rest = divmod(pad, geo.window_tokens)
    return [geo.window_tokens] * full + ([rest] if rest else [])


def window_slots(budget: int, geo: WindowGeometry) -> int:
    """Most windows a budget can hold: every real window has at least one merge unit and padding
    windows are full but for one."""
    return budget // geo.unit + 1


def qwen25_metadata(lay: BatchLayout, geo: WindowGeometry, budget: int | None,
                    seq_slots: int) -> dict[str, torch.Tensor]:
    """perm, rot, unperm, cu (frames) and cu_win (windows); padded to `budget` when given.

    - `perm` [N]: patch rows in window order (a gather of the processor-ordered rows);
    - `rot` [N, 2]: rotary (row, col) of each patch, already in window order;
    - `unperm` [N / unit]: the merger's output rows back in the processor's order;
    - `cu` / `cu_win`: frame (full attention) and window boundaries, in window order.

    Padding (a padded budget) keeps the identity order at the end, forms one sequence of its own for
    the full layers and windows of its own (at most a window's size each, so that padding costs
    window-sized attention, not padding^2) for the window layers."""
    perm, rot, unperm = window_metadata(lay.grids, geo)
    windows = window_sizes(lay.grids, geo)
    n = lay.num_tokens
    if budget is None:
        return {"perm": perm, "rot": rot, "unperm": unperm, "cu": cu_seqlens(lay.seq_lens),
                "cu_win": cu_seqlens(windows)}
    if budget < n:
        raise ValueError(f"{n} tokens exceed the budget {budget}")
    pad = budget - n
    perm = torch.cat([perm, torch.arange(n, budget)])
    rot = torch.cat([rot, rot.new_zeros(pad, 2)])
    unperm = torch.cat([unperm, torch.arange(n // geo.unit, budget // geo.unit)])
    windows = windows + padding_windows(pad, geo)
    return {"perm": perm, "rot": rot, "unperm": unperm,
            "cu": cu_seqlens(lay.seq_lens, pad_to_tokens=budget, pad_to_seqs=seq_slots),
            "cu_win": cu_seqlens(windows, pad_to_seqs=window_slots(budget, geo))}
