"""app/gpu/capture.py: Python's garbage collection paused while a CUDA graph is captured."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from app.gpu.capture import collection_paused


def test_collection_is_paused_in_the_block_and_restored_after():
    assert gc.isenabled()
    with collection_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:  # a caller that had it off keeps it off
        with collection_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(ValueError), collection_paused():
        raise ValueError
    assert gc.isenabled()


def test_overlapping_blocks_in_two_threads_keep_collection_off_until_the_last_ends():
    """Captures in two threads (an encoder capturing while another does): the first to end must not
    turn collection back on under the other."""
    import threading

    inside, release = threading.Event(), threading.Event()

    def other():
        with collection_paused():
            inside.set()
            release.wait(10)

    t = threading.Thread(target=other)
    with collection_paused():
        t.start()
        assert inside.wait(10)
    assert not gc.isenabled()  # the other thread is still in its block
    release.set()
    t.join(10)
    assert gc.isenabled()


class _Cycle:
    """An object in a reference cycle, as an engine or graph manager left behind is."""

    def __init__(self, graph):
        self.me, self.graph = self, graph


def _capture_while_a_graph_becomes_garbage(pause: bool) -> torch.Tensor:
    x = torch.ones(64, device="cuda")
    old = torch.cuda.CUDAGraph()
    with torch.cuda.graph(old):
        x.mul_(2)
    g = torch.cuda.CUDAGraph()
    with collection_paused() if pause else nullcontext(), torch.cuda.graph(g):
        _Cycle(old)  # garbage at once, freed only by a collection
        del old
        y = x * 3
        junk = [[i] for i in range(20_000)]  # allocations enough for collections of the youngest generation
        del junk
        y.add_(1)
    g.replay()
    torch.cuda.synchronize()
    gc.collect()
    return y


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_graph_freed_by_a_collection_inside_a_capture_does_not_break_it():
    """Without the pause a collection inside the capture frees the old graph, which CUDA forbids while
    the thread captures: the capture fails (in a process of its own: a failed capture leaves CUDA's
    state broken for the process). With it the capture completes and replays."""
    y = _capture_while_a_graph_becomes_garbage(pause=True)
    assert torch.equal(y, torch.full((64,), 4.0, device="cuda"))
    code = "from test_capture import _capture_while_a_graph_becomes_garbage as f; f(pause=False)"
    path = os.pathsep.join(filter(None, [str(Path(__file__).parent.parent), os.environ.get("PYTHONPATH")]))
    unpaused = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, capture_output=True,
                              text=True, timeout=120, env={**os.environ, "PYTHONPATH": path})
    assert unpaused.returncode != 0, unpaused.stderr[-2000:]
    assert any(s in unpaused.stderr for s in ("previous error during capture", "StreamCaptureInvalidated",
                                              "not permitted when stream is capturing")), unpaused.stderr[-2000:]
