"""A graph manager over any tower, checked against a reference forward (tests of Qwen2.5-VL, MiniCPM-V).

`reference(pixels, grids)` returns the reference's outputs for a batch as a list of tensors (rows in
item order), the same list our manager's embeddings concatenate to. On the CPU it runs in the
tower's dtype (float32) and ours must be within `tol` of it. On a GPU `truth` (the reference in
float32) is the judge: ours in bf16 must be within `tol` of it and no further from it than the
reference's own bf16 forward (`reference`) is.
"""

from __future__ import annotations

import torch

from app.vision.graphs import GraphManager, GraphSettings, VisionItem


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|; a must be finite."""
    a, b = a.float(), b.float()
    assert torch.isfinite(a).all()
    return ((a - b).abs().max() / b.abs().max()).item()


class TowerHarness:
    def __init__(self, tower, reference, budgets, tol, truth=None, max_items=4, max_frames=8, **settings):
        self.tower, self.reference, self.truth, self.tol = tower, reference, truth, tol
        self.device, self.dtype = tower.device, tower.dtype
        self.mgr = GraphManager(tower, GraphSettings(budgets=budgets, max_items_per_batch=max_items,
                                                     max_frames_per_batch=max_frames, autotune=False, **settings))
        self.mgr.capture()

    def items(self, grids, seed=0) -> list[VisionItem]:
        g = torch.Generator().manual_seed(seed)
        return [VisionItem(torch.randn(t * h * w, self.tower.patch_dim, generator=g).to(self.device, self.dtype),
                           (t, h, w)) for t, h, w in grids]

    @staticmethod
    def concat(out) -> list[torch.Tensor]:
        return [torch.cat([o.main for o in out])] + [torch.cat([o.deepstack[j] for o in out])
                                                     for j in range(len(out[0].deepstack))]

    @torch.inference_mode()
    def check(self, items, expect_graph: bool | None = None, force_eager: bool = False):
        st = self.mgr.stats
        hits, eager = st.graph_hits, st.eager_batches
        out = self.mgr.encode(items, force_eager=force_eager)
        if expect_graph is not None:
            assert (st.graph_hits - hits, st.eager_batches - eager) == ((1, 0) if expect_graph else (0, 1))
        assert len(out) == len(items)
        pixels = torch.cat([it.pixels for it in items])
        grids = [it.grid for it in items]
        ours = self.concat(out)
        if self.truth is None:
            for a, b in zip(ours, self.reference(pixels, grids), strict=True):
                assert a.shape == b.shape and rel(a, b) <= self.tol, rel(a, b)
            return out
        truth = self.truth(pixels.float(), grids)
        ref16 = self.reference(pixels, grids)
        for a, b, c in zip(ours, truth, ref16, strict=True):
            assert a.shape == b.shape and rel(a, b) <= self.tol, (rel(a, b), rel(c, b))
            assert rel(a, b) <= 1.05 * rel(c, b) + 1e-3, (rel(a, b), rel(c, b))
        return out

    def check_uniform_graphs(self, grid_sets) -> None:
        """Each equal-length batch shape, seen twice, is captured as an exact-shape graph at the next
        idle point; later batches of it replay that graph, match the reference, and a result
        outlives the next replay."""
        mgr = self.mgr
        mgr.capture_pending()
        for grids in grid_sets:
            for seed in (0, 1):
                self.check(self.items(grids, seed=seed), expect_graph=True)
            assert mgr.capture_pending() == 1
            hits = mgr.stats.uniform_hits
            first = self.check(self.items(grids, seed=2), expect_graph=True)
            kept = first[0].main.clone()
            self.check(self.items(grids, seed=3), expect_graph=True)
            assert mgr.stats.uniform_hits == hits + 2 and torch.equal(first[0].main, kept)

    def check_eager_without_cudnn(self, batches) -> None:
        """Eager batches use SDPA but never cuDNN's attention (a plan per new shape), and match the
        reference."""
        from helpers import attention_calls, skip_unless_cudnn_is_the_default

        skip_unless_cudnn_is_the_default(self.tower.heads, self.tower.head_dim)
        with torch.inference_mode():
            sdpa, cudnn = attention_calls(lambda: [self.mgr.encode(b, force_eager=True) for b in batches])
        assert sdpa > 0 and cudnn == 0
        for b in batches:
            self.check(b, expect_graph=False, force_eager=True)
