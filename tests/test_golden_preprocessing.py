"""Our preprocessing against golden outputs of transformers' Qwen3-VL processors.

tests/fixtures/golden_preprocessing.npz was made by tests/fixtures/make_golden.py with transformers
5.17's PIL image processor and its Qwen3VLVideoProcessor (torchvision, hence made on the GPU
machine's image). Inputs are rebuilt here from the same seeds.
"""

from pathlib import Path

import numpy as np
import pytest

from app.media.preprocess import PatchSpec, preprocess_image, preprocess_video
from fixtures.make_golden import IMAGE_BOUNDS, IMAGES, VIDEOS, image_input, video_input

GOLDEN = np.load(Path(__file__).parent / "fixtures" / "golden_preprocessing.npz")


@pytest.mark.parametrize("i,name,h,w", [(i, *c) for i, c in enumerate(IMAGES)], ids=[c[0] for c in IMAGES])
def test_images_match_the_image_processor(i, name, h, w):
    ours = preprocess_image(image_input(h, w, i), PatchSpec(), *IMAGE_BOUNDS)
    assert list(ours.grid) == GOLDEN[f"{name}_grid"].tolist()
    assert np.abs(ours.pixel_values - GOLDEN[f"{name}_pixels"]).max() <= 1e-2


@pytest.mark.parametrize("i,name,t,h,w", [(i, *c) for i, c in enumerate(VIDEOS)], ids=[c[0] for c in VIDEOS])
def test_videos_match_the_video_processor(i, name, t, h, w):
    # the processor's bounds do not bind at these sizes; ours are set not to bind either
    ours = preprocess_video(video_input(t, h, w, 100 + i), PatchSpec(), 1024, 1 << 22)
    assert list(ours.grid) == GOLDEN[f"{name}_grid"].tolist()
    diff = np.abs(ours.pixel_values - GOLDEN[f"{name}_pixels"])
    if name == "video_exact":  # no resize: normalisation and patch layout must agree to rounding
        assert diff.max() <= 1e-5
    else:  # PIL bicubic vs torchvision's antialiased bicubic: within one intensity level
        assert diff.max() <= 1e-2, diff.max()
