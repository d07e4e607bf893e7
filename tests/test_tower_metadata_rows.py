"""Every tower's metadata for a captured graph has exactly the rows its static buffers give it.

GraphManager copies `tower.metadata(...)` into views of `tower.metadata_buffers(...)` sized by
`tower.metadata_rows(...)` before a replay; a mismatch only shows on a GPU, as a failed capture (the
uniform graph is then silently not kept). This checks the contract on the CPU, for budget graphs and
for uniform (equal-sequence) graphs, for each tower family."""

from __future__ import annotations

import pytest
import torch

SEQ_SLOTS = 13  # max_frames_per_batch + 1, as GraphManager sizes them


@pytest.fixture(scope="module", params=["tiny", "tiny-qwen2.5-vl", "tiny-minicpm-v-4.5"])
def tower(request, model_cache):
    from app.checkpoints.model_builder import ensure_embedded
    from app.vision.loading import build_tower

    return build_tower(ensure_embedded(request.param, model_cache), torch.float32)


def check_rows(tower, grids, budget, uniform):
    lay = tower.layout(grids)
    meta = tower.metadata(lay, budget, uniform, SEQ_SLOTS)
    rows = tower.metadata_rows(budget, uniform, SEQ_SLOTS)
    assert meta.keys() == rows.keys()
    assert {k: t.shape[0] for k, t in meta.items()} == rows
    buffers = tower.metadata_buffers(budget, SEQ_SLOTS)
    assert all(buffers[k].shape[0] >= r and buffers[k].shape[1:] == meta[k].shape[1:] for k, r in rows.items())


@pytest.mark.parametrize("seqs", [1, 3, 4])
def test_uniform_graph_metadata_fills_its_buffers(tower, seqs):
    unit = tower.budget_unit
    length = 16 * unit
    shape = (seqs, length)
    grids = tower.uniform_grids(shape)
    assert tower.layout(grids).num_tokens == seqs * length
    check_rows(tower, grids, seqs * length, shape)


def test_budget_graph_metadata_fills_its_buffers(tower):
    unit = tower.budget_unit
    grids = tower.uniform_grids((2, 16 * unit))  # two sequences, padded to a larger budget
    check_rows(tower, grids, 64 * unit, None)
