"""Rotary positions for one prompt, per family, from its token types and its items' grids.

- Qwen3-VL (`mrope_positions`, `Rope("qwen3_vl")`): text advances all three axes together; each image,
  and each temporal group of a video (they are separated by timestamp text), is a block placed at the
  current position with height and width spread over its merged grid, after which the position jumps
  past its larger side.
- Qwen2.5-VL (`Rope("qwen2_5_vl")`): the same, except that a video is one block of all its temporal
  groups and its time axis is spaced by `tokens_per_second x second_per_grid_ts` per group (truncated
  to an integer, as transformers' `get_rope_index` does in float32), so that positions follow seconds
  rather than frames. The position after a video still advances by its larger spatial side only.
- 1-D RoPE (`Rope("1d")`, MiniCPM-V's Qwen3): every token's position is its index; placeholders too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .spec import family as spec_family

MROPE_FAMILIES = ("qwen3_vl", "qwen2_5_vl")


def _block(cur: int, t: int, gh: int, gw: int, interval: float | None) -> np.ndarray:
    """[3, t*gh*gw] positions of a vision block starting at `cur`; `interval`: the time axis' step, a
    float32 product truncated as transformers computes it (None: 1)."""
    if t == 1:
        tt = np.zeros(1, dtype=np.int64)
    elif interval is None:
        tt = np.arange(t, dtype=np.int64)
    else:
        tt = (np.arange(t, dtype=np.float32) * np.float32(interval)).astype(np.int64)
    return np.stack([np.repeat(tt, gh * gw) + cur,
                     np.tile(np.repeat(np.arange(gh, dtype=np.int64), gw), t) + cur,
                     np.tile(np.arange(gw, dtype=np.int64), gh * t) + cur])


def mrope_positions(mm_token_type_ids: list[int], grids: list[tuple[int, int, int]], merge: int,
                    seconds_per_group: list[float | None] | None = None, tokens_per_second: float | None = None
                    ) -> tuple[torch.Tensor, int]:
    """Positions [3, L] (int64) and the delta that later (text-only) positions add to their index.

    Without `tokens_per_second`: Qwen3-VL's layout (one block per image and per video group). With it:
    Qwen2.5-VL's (one block per item; a video's groups spaced by `tokens_per_second` x its
    `seconds_per_group` entry, 1 s when None). Built with numpy: this runs once per request on the LLM
    replica's event loop, where the dozen small torch calls it took cost about half of `Sequence()`."""
    per_item = tokens_per_second is not None
    if per_item:
        seconds = seconds_per_group or [None] * len(grids)
        blocks = iter([(g, s) for g, s in zip(grids, seconds, strict=True)])
    else:  # one grid per contiguous vision run: images as they are, videos split per temporal group
        blocks = iter([((1, h, w), None) for t, h, w in grids for _ in range(t)])
    types = np.asarray(mm_token_type_ids, dtype=np.int64)
    length = len(types)
    # the runs of equal token types: their starts, and each run's type and length
    starts = np.flatnonzero(np.diff(types, prepend=types[:1] - 1)) if length else np.zeros(0, dtype=np.int64)
    ends = np.append(starts[1:], length)
    parts, cur = [], 0
    for start, end in zip(starts.tolist(), ends.tolist()):
        kind, n = int(types[start]), end - start
        if kind == 0:
            parts.append(np.broadcast_to(np.arange(cur, cur + n, dtype=np.int64), (3, n)))
            cur += n
            continue
        (t, h, w), secs = next(blocks)
        gh, gw = h // merge, w // merge
        if t * gh * gw != n:
            raise ValueError(f"vision run of {n} tokens does not match its grid ({t} x {gh} x {gw})")
        interval = None
        if per_item and kind == 2:  # float32 product, as the reference computes it
            interval = np.float32(tokens_per_second) * np.float32(1.0 if secs is None else secs)
        parts.append(_block(cur, t, gh, gw, interval))
        cur += max(gh, gw)
    pos = np.concatenate(parts, axis=1) if parts else np.zeros((3, 0), dtype=np.int64)
    delta = int(pos.max()) + 1 - length if length else 0
    return torch.from_numpy(pos), delta


@dataclass(frozen=True)
class Rope:
    """How a family positions a prompt: `kind` is a model_type of MROPE_FAMILIES or "1d"."""

    kind: str = "qwen3_vl"
    merge: int = 2
    tokens_per_second: float = 1.0

    @classmethod
    def from_config(cls, config: dict) -> Rope:
        family = spec_family(config)
        vision = config.get("vision_config") or {}
        if family not in MROPE_FAMILIES:
            return cls("1d", 1)
        return cls(family, vision.get("spatial_merge_size", 2), vision.get("tokens_per_second", 1.0))

    def positions(self, mm_token_type_ids: list[int], grids: list[tuple[int, int, int]],
                  seconds_per_group: list[float | None] | None = None) -> tuple[torch.Tensor, int]:
        if self.kind == "1d":
            n = len(mm_token_type_ids)
            return torch.arange(n).expand(3, n), 0
        if self.kind == "qwen2_5_vl":
            return mrope_positions(mm_token_type_ids, grids, self.merge, seconds_per_group, self.tokens_per_second)
        return mrope_positions(mm_token_type_ids, grids, self.merge)
