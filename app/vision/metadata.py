"""Per-batch metadata for the vision tower, computed outside any CUDA graph.

Everything the reference tower derives from `grid_thw` with data-dependent host code
(interpolation taps, rotary position ids, `cu_seqlens`) is computed here from the grids, so the
tower body itself has static shapes and can be captured. Per-grid pieces are cached: they depend
only on (h, w), not on pixels.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

Grid = tuple[int, int, int]


@dataclass(frozen=True)
class TowerGeometry:
    """The few config numbers the metadata needs."""

    merge: int  # spatial merge size
    side: int  # learned position grid is side x side

    @classmethod
    def from_config(cls, vision_config) -> TowerGeometry:
        return cls(merge=vision_config.spatial_merge_size, side=int(vision_config.num_position_embeddings**0.5))


def _block_order_rows_cols(h: int, w: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of each patch, in the m x m merge-block order the processor emits."""
    rows = torch.arange(h).view(h, 1).expand(h, w)
    cols = torch.arange(w).view(1, w).expand(h, w)
    shape = (h // m, m, w // m, m)
    return (rows.reshape(shape).transpose(1, 2).flatten(), cols.reshape(shape).transpose(1, 2).flatten())


def _bilinear_axis(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two taps and weights resampling a `side`-long axis to `size` (align_corners=True)."""
    index = index.to(torch.float32)
    src = index * (side - 1) / max(size - 1, 1)
    floor = torch.floor(src)
    offsets = torch.arange(0, 2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


@lru_cache(maxsize=512)
def frame_metadata(h: int, w: int, geo: TowerGeometry) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For one h x w frame: interpolation taps [hw, 4], their weights [hw, 4], rotary (row, col) [hw, 2]."""
    rows, cols = _block_order_rows_cols(h, w, geo.merge)
    h_taps, h_w = _bilinear_axis(rows, h, geo.side)
    w_taps, w_w = _bilinear_axis(cols, w, geo.side)
    taps = (h_taps[:, :, None] * geo.side + w_taps[:, None, :]).reshape(-1, 4)
    weights = (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4)
    return taps, weights, torch.stack([rows, cols], dim=-1)


@dataclass
class BatchLayout:
    """Where each item sits in a packed batch, and the attention sequences."""

    grids: list[Grid]
    token_offsets: list[int]  # start of each item in patch tokens
    seq_lens: list[int]  # one entry per attention sequence (image, or temporal group of a video)
    out_rows: list[int]  # embedding rows each item yields (its tokens / merge unit for Qwen towers)

    @property
    def num_tokens(self) -> int:
        return sum(self.seq_lens)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_items(self) -> int:
        return len(self.grids)

    @property
    def uniform(self) -> tuple[int, int] | None:
        """(sequences, length) when every attention sequence is equally long: dense attention applies."""
        return (self.num_seqs, self.seq_lens[0]) if len(set(self.seq_lens)) == 1 else None

    @property
    def num_out(self) -> int:
        """Embedding rows of the whole batch."""
        return sum(self.out_rows)

    def item_slices(self) -> list[slice]:
        """Rows of each item in the output tensors (items' rows follow each other in item order)."""
        out, start = [], 0
        for n in self.out_rows:
            out.append(slice(start, start + n))
            start += n
        return out


def layout(grids: list[Grid], merge: int) -> BatchLayout:
    """Qwen towers: each temporal group of each item is one attention sequence; every merge x merge
    block of patches becomes one embedding row."""
    offsets, seqs, off = [], [], 0
    for t, h, w in grids:
        if h % merge or w % merge:
            raise ValueError(f"grid {(t, h, w)} is not divisible by the merge size {merge}")
        offsets.append(off)
        seqs.extend([h * w] * t)
        off += t * h * w
    return BatchLayout(list(map(tuple, grids)), offsets, seqs, [t * h * w // (merge * merge) for t, h, w in grids])


def cu_seqlens(seq_lens: list[int], pad_to_tokens: int | None = None, pad_to_seqs: int | None = None) -> torch.Tensor:
    """Cumulative sequence starts (int32), optionally padded for a static-shape graph.

    Padding tokens form one extra sequence of their own (so their attention rows are finite and
    never mix with real rows); unused sequence slots repeat the last boundary (zero length), which
    keeps the tensor monotonic.
    """
    bounds = [0]
    for n in seq_lens:
        bounds.append(bounds[-1] + n)
    if pad_to_tokens is not None and pad_to_tokens > bounds[-1]:
        bounds.append(pad_to_tokens)
    if pad_to_seqs is not None:
        if len(bounds) - 1 > pad_to_seqs:
            raise ValueError(f"{len(bounds) - 1} sequences exceed the {pad_to_seqs} slots")
        bounds.extend([bounds[-1]] * (pad_to_seqs + 1 - len(bounds)))
    return torch.tensor(bounds, dtype=torch.int32)


def position_metadata(grids: list[Grid], geo: TowerGeometry) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Interpolation taps, weights and rotary ids for a whole batch, concatenated in item order."""
    parts = [frame_metadata(h, w, geo) for _, h, w in grids]
    reps = [t for t, _, _ in grids]
    taps = torch.cat([p[0].repeat(t, 1) for p, t in zip(parts, reps)])
    weights = torch.cat([p[1].repeat(t, 1) for p, t in zip(parts, reps)])
    rot = torch.cat([p[2].repeat(t, 1) for p, t in zip(parts, reps)])
    return taps, weights, rot
