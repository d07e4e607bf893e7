"""Qwen3-VL's multimodal rotary positions (M-RoPE) for one prompt, from its token types and grids.

Text advances all three axes together; each image, and each temporal group of a video (they are
separated by timestamp text), is a block placed at the current position with height and width
spread over its merged grid, after which the position jumps past its larger side.
"""

from __future__ import annotations

import itertools

import torch


def mrope_positions(mm_token_type_ids: list[int], grids: list[tuple[int, int, int]], merge: int
                    ) -> tuple[torch.Tensor, int]:
    """Positions [3, L] and the delta that later (text-only) positions add to their index."""
    # one grid per contiguous vision run: images as they are, videos split per temporal group
    blocks = iter([g for t, h, w in grids for g in [(1, h, w)] * t])
    parts, cur = [], 0
    for kind, run in itertools.groupby(mm_token_type_ids):
        n = len(list(run))
        if kind == 0:
            parts.append(torch.arange(cur, cur + n).expand(3, n))
            cur += n
            continue
        _, h, w = next(blocks)
        gh, gw = h // merge, w // merge
        if gh * gw != n:
            raise ValueError(f"vision run of {n} tokens does not match its grid ({gh} x {gw})")
        hh = torch.arange(gh).repeat_interleave(gw)
        ww = torch.arange(gw).repeat(gh)
        parts.append(torch.stack([torch.full((n,), cur), hh + cur, ww + cur]))
        cur += max(gh, gw)
    pos = torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.long)
    length = len(mm_token_type_ids)
    delta = int(pos.max()) + 1 - length if length else 0
    return pos, delta
