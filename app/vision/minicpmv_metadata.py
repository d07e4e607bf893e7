"""Host-side metadata for the MiniCPM-V vision path (SigLIP-NaViT + perceiver resampler), per batch.

Each item is one slice of an image (the router cuts images into a thumbnail and up to 9 slices),
with its patches in row-major order. What the published model computes per slice with Python loops
and `.tolist()` becomes tensors here (`minicpmv_metadata` lists them), built outside any graph.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from .metadata import BatchLayout, Grid, cu_seqlens


def layout(grids: list[Grid], queries: int) -> BatchLayout:
    """One attention sequence per slice; each slice yields the resampler's `queries` rows."""
    offsets, off = [], 0
    for t, h, w in grids:
        if t != 1:
            raise ValueError(f"MiniCPM-V slices are single images (t = 1), got grid {(t, h, w)}")
        offsets.append(off)
        off += h * w
    return BatchLayout(list(map(tuple, grids)), offsets, [h * w for _, h, w in grids], [queries] * len(grids))


@lru_cache(maxsize=512)
def bucketed_positions(h: int, w: int, side: int) -> torch.Tensor:
    """SigLIP-NaViT position ids of an h x w (patches) slice, row-major: the published bucketing. The
    steps are 1 / (an int32 tensor), float32 as in the published code (which reads the sizes from its
    `tgt_sizes` tensor): with Python's double 1 / h a coordinate can land on the other side of a
    boundary."""
    boundaries = torch.arange(1 / side, 1.0, 1 / side)
    size = torch.tensor([h, w], dtype=torch.int32)
    rows = torch.bucketize(torch.arange(0, 1 - 1e-6, 1 / size[0]), boundaries, right=True)
    cols = torch.bucketize(torch.arange(0, 1 - 1e-6, 1 / size[1]), boundaries, right=True)
    return (rows[:, None] * side + cols).flatten()


@lru_cache(maxsize=512)
def row_cols(h: int, w: int) -> torch.Tensor:
    rows = torch.arange(h).view(h, 1).expand(h, w).flatten()
    cols = torch.arange(w).view(1, w).expand(h, w).flatten()
    return torch.stack([rows, cols], dim=-1).float()


def minicpmv_metadata(lay: BatchLayout, side: int, budget: int | None, slots: int | None) -> dict[str, torch.Tensor]:
    """pos, rc, kseg, dead, cu for a batch of slices; padded to `budget` tokens and `slots` slice slots
    when given (a graph's static shapes), exact otherwise (one slot per slice).

    - `pos` [N]: SigLIP's bucketed position ids. The learned table covers a `side x side` grid
      (image_size / patch = 70 for MiniCPM-V 4.5); a slice of h x w patches takes, per axis, the bucket
      of each patch's fractional coordinate k / h among the boundaries 1/side, 2/side, ...;
    - `rc` [N, 2] float32: (row, col) of each patch in its slice, for the resampler's 2-D sin-cos keys;
    - `kseg` [N]: the slice slot of each patch (padding tokens: the number of slots, matching no slot);
    - `dead` [slots]: slots holding no slice (in the resampler's masked attention their queries attend
      to every key, so that their unused rows stay finite);
    - `cu`: slice boundaries (padding one sequence of its own): the SigLIP self-attention's, and the
      keys' of the resampler's variable-length attention (where empty slots get zero rows)."""
    n, count = lay.num_tokens, lay.num_items
    slots = count if slots is None else slots
    if count > slots:
        raise ValueError(f"{count} slices exceed the {slots} slots")
    pos = torch.cat([bucketed_positions(h, w, side) for _, h, w in lay.grids])
    rc = torch.cat([row_cols(h, w) for _, h, w in lay.grids])
    kseg = torch.repeat_interleave(torch.arange(count), torch.tensor(lay.seq_lens))
    dead = torch.arange(slots) >= count
    if budget is None:
        return {"pos": pos, "rc": rc, "kseg": kseg, "dead": dead, "cu": cu_seqlens(lay.seq_lens)}
    pad = budget - n
    if pad < 0:
        raise ValueError(f"{n} tokens exceed the budget {budget}")
    return {"pos": torch.cat([pos, pos.new_zeros(pad)]), "rc": torch.cat([rc, rc.new_zeros(pad, 2)]),
            "kseg": torch.cat([kseg, kseg.new_full((pad,), slots)]), "dead": dead,
            "cu": cu_seqlens(lay.seq_lens, pad_to_tokens=budget, pad_to_seqs=slots)}
