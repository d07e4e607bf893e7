"""benchmarks/minicpmv_reference.py: the encoder benchmark's MiniCPM-V references take the published
forward's two SigLIP attention paths, and both compute the same embeddings.

The published code drops the patch mask when no slice is padded, and runs its vision tower with eager
attention unless it is loaded with flash_attention_2. The benchmark's ratio is against the flash path
(the faster one), with the eager path timed beside it; these tests pin what each path runs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from app.checkpoints.minicpmv_builder import _random_vision
from app.checkpoints.model_builder import load_preset
from benchmarks.encoder_families import minicpmv_grids
from benchmarks.minicpmv_reference import PublishedStyleMiniCPMV

UNPADDED = minicpmv_grids([(448, 448), (448, 448)])  # two equal slices: no patch mask
PADDED = minicpmv_grids([(640, 480)])  # a thumbnail and two slices of other sizes: padded to the longest


@pytest.fixture(scope="module")
def model():
    return _random_vision(load_preset("tiny-minicpm-v-4.5"), seed=0).eval()


def pixels_for(grids, patch_dim: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.rand(sum(h * w for _, h, w in grids), patch_dim, generator=g) * 2 - 1


def run_recording(ref: PublishedStyleMiniCPMV, grids, monkeypatch):
    """ref's output, the masks its SigLIP encoder got, and how many SDPA calls the forward made."""
    masks, calls, sdpa = [], [0], F.scaled_dot_product_attention
    forward = ref.encoder.forward

    def recording_forward(*args, **kwargs):
        masks.append(kwargs.get("attention_mask"))
        return forward(*args, **kwargs)

    def counting_sdpa(*args, **kwargs):
        calls[0] += 1
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(ref.encoder, "forward", recording_forward)
    monkeypatch.setattr(F, "scaled_dot_product_attention", counting_sdpa)
    out = ref(pixels_for(grids, 3 * ref.patch ** 2), grids)
    monkeypatch.undo()
    return out, masks, calls[0]


@pytest.mark.parametrize("grids", [UNPADDED, PADDED], ids=["equal slices", "padded slices"])
def test_both_attention_paths_give_the_same_embeddings(model, grids, monkeypatch):
    flash, flash_masks, flash_sdpa = run_recording(PublishedStyleMiniCPMV(model), grids, monkeypatch)
    eager, eager_masks, eager_sdpa = run_recording(PublishedStyleMiniCPMV(model, "eager"), grids, monkeypatch)
    assert flash[0].shape == (len(grids) * model.resampler.query.shape[0], model.resampler.query.shape[1])
    torch.testing.assert_close(eager[0], flash[0], rtol=1e-5, atol=1e-5)
    # The published forward passes no mask when every slice has the longest length, a 4-D one otherwise.
    padded = grids is PADDED
    assert [m is not None for m in flash_masks + eager_masks] == [padded, padded]
    # The flash path's SigLIP attention is one SDPA call per layer; the eager path's makes none.
    assert flash_sdpa - eager_sdpa == len(model.vpm.encoder.layers)


def test_a_padded_slice_does_not_change_the_others(model):
    """The mask is live: a slice's embeddings are the same alone as beside a longer one."""
    ref = PublishedStyleMiniCPMV(model, "eager")
    thumb, *slices = PADDED
    px = pixels_for(PADDED, 3 * ref.patch ** 2)
    together = ref(px, PADDED)[0]
    alone = ref(px[: thumb[1] * thumb[2]], [thumb])[0]
    q = model.resampler.query.shape[0]
    torch.testing.assert_close(together[:q], alone, rtol=1e-5, atol=1e-5)


def test_unknown_attention_path_is_refused(model):
    with pytest.raises(ValueError, match="attention must be one of"):
        PublishedStyleMiniCPMV(model, "sdpa")
