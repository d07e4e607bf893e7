"""The contract between the graph manager and a vision tower.

The graph manager (graphs.py) knows nothing about any model. It owns token budgets, static input
buffers, CUDA graphs, padding, auto-tune and the eager fallback; a tower supplies the rest through
`GraphTower` (its docstring lists what). Padding rules every tower follows, so that a padded batch
gives its real rows exactly the eager result: padding tokens are zero pixel rows that form an
attention sequence of their own (never mixed with real tokens, always finite), unused sequence slots
have zero length, and `cu_seqlens` stays monotonic. Real output rows come first, in item order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..gpu.tune_cache import TuneCache
from . import flash4
from .down_projection import DownProjection
from .kernels import normalize_rows, pad_mlp_modules
from .metadata import BatchLayout, Grid


@dataclass
class TowerBatch:
    """One packed batch on the tower's device. Shapes are static for a given budget or uniform shape."""

    pixels: torch.Tensor  # [N, patch_dim]: normalised float rows, or raw uint8 rows (see GraphTower.pixel_norm)
    meta: dict[str, torch.Tensor] = field(default_factory=dict)  # the tower's metadata, on its device
    max_seqlen: int = 0  # host int: an upper bound of every attention sequence's length
    uniform: tuple[int, int] | None = None  # (sequences, length) when all sequences are equally long
    static: bool = False  # a graph's static buffers (fixed shapes), not an eager batch


class GraphTower(nn.Module):
    """Base class of the towers the graph manager runs. Subclasses implement the methods that raise,
    chiefly:

    - `layout(grids)`: how a batch of items splits into patch tokens, attention sequences and output
      rows;
    - `metadata(layout, budget, uniform, seq_slots)`: every data-dependent tensor the body needs
      (position ids, permutations, `cu_seqlens`, attention tables), built on the host from the grids,
      padded to a budget's static shapes when a budget is given;
    - `metadata_buffers` / `metadata_rows`: the static buffers those tensors are copied into (allocated
      once at the largest budget) and how many rows of each one budget reads;
    - `forward(TowerBatch)`: the static-shape body, free of host synchronisation when `batch.static`."""

    #: budgets (patch tokens) must be multiples of this; an item's tokens always are
    budget_unit: int = 1

    def __init__(self, pixel_norm: tuple | None = None):
        """`pixel_norm` = (scale, offset) per pixel-row column (`PatchSpec.column_norm`) lets the tower take
        uint8 patch rows and normalise them itself, in float32 as the processor does; without it, rows
        come normalised (float)."""
        super().__init__()
        self.pixel_scale = self.pixel_offset = None
        self._pixel_norm = pixel_norm
        self.down: DownProjection | None = None  # the fused body's MLP down projection, if it has one
        self.down_weights: list[torch.Tensor] = []
        self.flash4 = False  # FlashAttention-4 for the graphs' dense attention (flash4.py; use_dense_attention)

    def use_dense_attention(self, choice: str) -> bool:
        """Pick the kernel of the dense (equal-length) attention: `encoder.dense_attention` (flash4.resolve).
        Call before capturing graphs. Returns whether FlashAttention-4 is used."""
        self.flash4 = flash4.resolve(choice, self.head_dim, self.device, self.dtype)
        return self.flash4

    def _init_pixel_norm(self) -> None:
        """Call at the end of a subclass's __init__, once `device` is known."""
        if self._pixel_norm is not None:
            self.pixel_scale, self.pixel_offset = (torch.as_tensor(t, dtype=torch.float32, device=self.device)
                                                   for t in self._pixel_norm)

    def _pad_mlps(self, pairs: list[tuple[nn.Linear | tuple[nn.Linear, ...], nn.Linear]]
                  ) -> list[tuple[torch.Tensor, ...]]:
        """(fc1, fc2) per layer, padded (`kernels.pad_mlp_modules`; fc1 may be (gate, up)), and the down
        projection over them. Returns (fc1 weight, fc1 bias, fc2 weight) per layer."""
        mlps = [pad_mlp_modules(fc1, fc2) for fc1, fc2 in pairs]
        if mlps:
            self._init_down_projection([w2 for _, _, w2 in mlps], pairs[0][1].in_features)
        return mlps

    def _init_down_projection(self, weights: list[torch.Tensor], width: int) -> None:
        """The fused body's down projections: one weight per layer, [hidden, padded width], all alike."""
        w = weights[0]
        self.down_weights = weights
        self.down = DownProjection(width, w.shape[1], w.shape[0], w.dtype, w.device)

    def tune_gemms(self, rows: list[int], cache: TuneCache | None = None) -> str:
        """Pick the fastest way to run the GEMMs that have several, for batches of these token counts
        (down_projection.py); the graph manager calls it before capturing. Nothing to do off CUDA.

        With `cache` (the auto-tune table's TuneCache), the choice that a replica timed for the same key is
        applied instead, and one timed here is kept for the next: a replica added under load timed its
        GEMMs beside the serving replica's kernels on the GPU, and the serving replica's TTFT p99 rose to
        2.73x warm in that second (one H200, 2026-12-04). Returns where the choice came from."""
        if self.down is None:
            return "nothing to choose"
        if cache is None:
            self.down.tune(rows, self.down_weights)
            return "measured"

        def measure() -> list[dict] | None:
            self.down.tune(rows, self.down_weights)
            return self.down.table() if set(rows) <= set(self.down.choice) else None  # timed (on CUDA): kept

        return cache.beside("down projection").applied_or_measured(lambda t: self.down.apply(t, rows), measure)

    def normalized_pixels(self, px: torch.Tensor, pad: int = 0, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Rows in the tower's dtype; uint8 rows get the processor's rescale and normalise first (one
        kernel on CUDA: kernels.normalize_rows). `rows` gathers rows, `pad` appends zero columns."""
        if px.dtype == torch.uint8:
            if self.pixel_scale is None:
                raise ValueError("uint8 pixel rows need the tower's pixel_norm")
            return normalize_rows(px, self.pixel_scale, self.pixel_offset, self.dtype, pad, rows)
        px = px.to(self.dtype)
        if rows is not None:
            px = px.index_select(0, rows)
        return F.pad(px, (0, pad)) if pad else px

    # ------------------------------------------------------------------ what subclasses provide
    @property
    def device(self) -> torch.device:
        raise NotImplementedError

    @property
    def dtype(self) -> torch.dtype:
        raise NotImplementedError

    @property
    def patch_dim(self) -> int:
        """Columns of one pixel row."""
        raise NotImplementedError

    def layout(self, grids: list[Grid]) -> BatchLayout:
        raise NotImplementedError

    def metadata(self, lay: BatchLayout, budget: int | None, uniform: tuple[int, int] | None,
                 seq_slots: int) -> dict[str, torch.Tensor]:
        """Host tensors for `lay`; padded to `budget` tokens and `seq_slots` sequences (shapes then equal
        `metadata_rows`), or exact for an eager batch (`budget` None)."""
        raise NotImplementedError

    def metadata_buffers(self, max_budget: int, seq_slots: int) -> dict[str, torch.Tensor]:
        """Zeroed device buffers large enough for every budget up to `max_budget` and every uniform shape."""
        raise NotImplementedError

    def metadata_rows(self, budget: int, uniform: tuple[int, int] | None, seq_slots: int) -> dict[str, int]:
        """Rows (first dimension) of each buffer that a graph of this budget / uniform shape reads."""
        raise NotImplementedError

    def synthetic_grid(self, tokens: int) -> Grid:
        """An image grid of exactly `tokens` patch tokens (capture and auto-tune batches)."""
        raise NotImplementedError

    def uniform_grids(self, shape: tuple[int, int]) -> list[Grid]:
        """Items whose attention sequences are `shape[0]` sequences of `shape[1]` tokens each."""
        raise NotImplementedError

    def forward(self, batch: TowerBatch) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """-> (main embeddings, extra per-row outputs such as deepstack features), rows in item order."""
        raise NotImplementedError
