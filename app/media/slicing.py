"""MiniCPM-V's image slicing, on the router: a source image becomes a thumbnail and up to
`max_slices` slices, each an image of its own for the vision tower (64 embeddings each).

The published scheme, from `preprocessor_config.json` (resizes PIL bicubic, as the processor does):
- the thumbnail is the image resized to at most `scale_resolution`^2 pixels, aspect kept, sides patch
  multiples; an image no larger is not sliced (its thumbnail may be upscaled to that area);
- else the count is ceil(area / scale_resolution^2), capped at `max_slices`; among the (cols, rows)
  factorisations of it and its two neighbours (not 1, not above the cap), the grid whose log aspect
  ratio is nearest the image's wins (the first on ties);
- the image is resized so each cell is a patch-multiple of about `scale_resolution`^2 pixels and cut
  into cols x rows slices, row by row. Rows then follow `patchify` with temporal patch 1 and merge 1.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .preprocess import Patches, PatchSpec, patchify


@dataclass(frozen=True)
class SliceSpec:
    patch: int = 14
    scale_resolution: int = 448
    max_slices: int = 9
    slice_mode: bool = True
    use_image_id: bool = True
    queries: int = 64  # embeddings per slice (the resampler's queries)
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    @property
    def patch_spec(self) -> PatchSpec:
        return PatchSpec(patch=self.patch, temporal=1, merge=1, mean=self.mean, std=self.std)

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> SliceSpec:
        cfg = json.loads((Path(path) / "preprocessor_config.json").read_text())
        return cls(patch=cfg.get("patch_size", 14), scale_resolution=cfg.get("scale_resolution", 448),
                   max_slices=cfg.get("max_slice_nums", 9), slice_mode=cfg.get("slice_mode", True),
                   use_image_id=cfg.get("use_image_id", True), queries=cfg.get("image_feature_size", 64),
                   mean=tuple(cfg.get("norm_mean", (0.5,) * 3)), std=tuple(cfg.get("norm_std", (0.5,) * 3)))


def _round_to(length: float, patch: int) -> int:
    """Nearest multiple of the patch (Python's rounding, ties to even), at least one patch."""
    return max(round(length / patch) * patch, patch)


def best_resize(width: float, height: float, scale: int, patch: int, allow_upscale: bool = False) -> tuple[int, int]:
    """(w, h): at most scale^2 pixels (or exactly about that with `allow_upscale`), patch multiples."""
    if width * height > scale * scale or allow_upscale:
        r = width / height
        height = int(scale / math.sqrt(r))
        width = int(height * r)
    return _round_to(width, patch), _round_to(height, patch)


def slice_grid(width: int, height: int, scale: int, max_slices: int) -> tuple[int, int] | None:
    """(cols, rows) of the slices, or None when the image is not sliced."""
    multiple = min(math.ceil(width * height / (scale * scale)), max_slices)
    if multiple <= 1:
        return None
    log_ratio = math.log(width / height)
    best, best_err = (1, 1), float("inf")
    for count in (multiple - 1, multiple, multiple + 1):
        if count == 1 or count > max_slices:
            continue
        for cols in range(1, count + 1):
            if count % cols == 0:
                err = abs(log_ratio - math.log(cols / (count // cols)))
                if err < best_err:
                    best, best_err = (cols, count // cols), err
    return best


def refine_size(width: int, height: int, grid: tuple[int, int], scale: int, patch: int) -> tuple[int, int]:
    """Size of the image to cut: each cell a patch multiple of about scale^2 pixels."""
    cols, rows = grid
    cell_w, cell_h = _round_to(width, cols) / cols, _round_to(height, rows) / rows
    best_w, best_h = best_resize(cell_w, cell_h, scale, patch, allow_upscale=True)
    return best_w * cols, best_h * rows


@dataclass
class SlicedImage:
    """A MiniCPM-V image as the tower and the prompt take it."""

    thumbnail: np.ndarray  # [h, w, 3] uint8
    slices: list[np.ndarray]  # row by row
    grid: tuple[int, int] | None  # (cols, rows), None when not sliced

    @property
    def images(self) -> list[np.ndarray]:
        """Thumbnail first, then the slices: the order of the tower's items and of the prompt."""
        return [self.thumbnail, *self.slices]


MAX_ASPECT_RATIO = 200  # as Qwen's smart_resize refuses: past it, the short side's upscale to a patch
# makes a few-KB image of 1 x 8,000,000 pixels a slice of 90,000 tokens (362,040 patch rows in all)


def slice_image(image, spec: SliceSpec) -> SlicedImage:
    """`image`: an RGB PIL image or an [H, W, 3] uint8 array. Sides further apart than MAX_ASPECT_RATIO
    are a client error (`invalid_image`), as on the Qwen path."""
    from PIL import Image

    from ..errors import ClientError

    if not isinstance(image, Image.Image):
        image = Image.fromarray(image)
    w, h = image.size
    if min(w, h) <= 0:
        raise ClientError("image has a zero dimension", code="invalid_image")
    if max(w, h) / min(w, h) > MAX_ASPECT_RATIO:
        raise ClientError(f"aspect ratio {max(w, h) / min(w, h):.0f} exceeds {MAX_ASPECT_RATIO}", code="invalid_image")
    bicubic = Image.Resampling.BICUBIC
    grid = slice_grid(w, h, spec.scale_resolution, spec.max_slices) if spec.slice_mode else None
    if grid is None:
        size = best_resize(w, h, spec.scale_resolution, spec.patch, allow_upscale=True)
        return SlicedImage(np.asarray(image.resize(size, bicubic)), [], None)
    thumb = image.resize(best_resize(w, h, spec.scale_resolution, spec.patch), bicubic)
    refined = image.resize(refine_size(w, h, grid, spec.scale_resolution, spec.patch), bicubic)
    cols, rows = grid
    cw, ch = refined.size[0] // cols, refined.size[1] // rows
    slices = [np.asarray(refined.crop((c * cw, r * ch, (c + 1) * cw, (r + 1) * ch)))
              for r in range(rows) for c in range(cols)]
    return SlicedImage(np.asarray(thumb), slices, grid)


def slice_patches(image, spec: SliceSpec, normalize: bool = False) -> tuple[list[Patches], tuple[int, int] | None]:
    """The tower's items for one image (raw uint8 rows by default, as the router sends them): one
    `Patches` per slice, grid (1, h, w) in patches, thumbnail first; and the slice grid for the prompt."""
    sliced = slice_image(image, spec)
    return [patchify(im[None], spec.patch_spec, normalize) for im in sliced.images], sliced.grid
