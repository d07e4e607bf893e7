"""Pinned staging of patch rows (app/vision/staging.py): the logic on the CPU, the real thing on a GPU."""

from __future__ import annotations

import pytest
import torch

from app.vision.staging import PinnedStaging


def _parts(sizes, seed=0, width=12):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n, width), generator=g, dtype=torch.uint8) for n in sizes]


def test_rows_arrive_in_order_through_buffers_used_in_turn():
    st = PinnedStaging(64, 12, torch.uint8, torch.device("cpu"), pin=False)
    for seed, sizes in enumerate([[10, 20], [64], [1], [30, 3, 7]]):
        parts = _parts(sizes, seed)
        assert torch.equal(st.to_device(parts), torch.cat(parts))
    assert (st.staged, st.direct, st._next) == (4, 0, 0)


def test_a_batch_larger_than_a_buffer_is_copied_directly_into_its_place():
    st = PinnedStaging(16, 12, torch.uint8, torch.device("cpu"), pin=False)
    parts = _parts([10, 20], 3)
    out = torch.zeros(40, 12, dtype=torch.uint8)
    st.copy(parts, out[5:35])
    assert torch.equal(out[5:35], torch.cat(parts)) and not out[:5].any() and not out[35:].any()
    assert (st.staged, st.direct) == (0, 1)


def test_a_batch_below_the_minimum_is_copied_directly_and_larger_ones_are_staged():
    st = PinnedStaging(64, 12, torch.uint8, torch.device("cpu"), pin=False, min_rows=16)
    small, large = _parts([5, 10], 4), _parts([10, 6], 5)
    assert torch.equal(st.to_device(small), torch.cat(small))
    assert (st.staged, st.direct) == (0, 1)
    assert torch.equal(st.to_device(large), torch.cat(large))
    assert (st.staged, st.direct) == (1, 1)


@pytest.mark.gpu
def test_pinned_buffers_reused_under_queued_work_keep_every_batch_intact():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda")
    st = PinnedStaging(4096, 1536, torch.uint8, dev)
    assert st._bufs[0].is_pinned()
    busy = torch.randn(4096, 4096, device=dev)
    outs, refs = [], []
    for seed in range(8):  # each copy queued behind a long matmul: a buffer reused too early would show
        for _ in range(4):
            busy = busy @ busy / 64
        parts = _parts([1000, 3000, 96], seed, width=1536)
        refs.append(torch.cat(parts))
        outs.append(st.to_device(parts))
    torch.cuda.synchronize()
    for o, r in zip(outs, refs):
        assert torch.equal(o.cpu(), r)
    assert st.staged == 8
