"""What every CUDA-graph capture in the project shares: Python's garbage collection paused for it.

Python's cyclic garbage collector runs in whichever thread allocates, often the capturing one, and a
collection there may free an object that owns a CUDA graph from earlier work (an engine or graph
manager that a test or a reload left in a reference cycle). Destroying a graph is a call CUDA forbids
while the thread captures: the capture is invalidated, and the next kernel launch inside it fails
with "operation failed due to a previous error during capture". PyTorch no longer collects on entering
`torch.cuda.graph` unless `TORCH_CUDAGRAPH_GC` is set, so such garbage lives until a collection happens
to start, possibly mid-capture. Collection is therefore paused for every capture's length and the
garbage collected after it, outside.
"""

from __future__ import annotations

import contextlib
import gc
import threading

_lock = threading.Lock()
_depth = 0  # captures in progress, in any thread
_was_enabled = False  # whether collection was on before the first of them


@contextlib.contextmanager
def collection_paused():
    """Python's automatic garbage collection off for the block, for the whole process (captures are
    short). Nested or concurrent blocks (captures in several threads) turn it back on when the last
    one ends, and only if it was on before the first began.

    The invalidated capture was seen in the GPU suite run as one process (each failing test passed
    alone), after three "operation not permitted when stream is capturing (function reset)" warnings
    from CUDAGraph's destructor. An explicit `gc.collect()` from another thread (Ray runs one in its
    workers) is not stopped by this; captures that must tolerate other threads use CUDA's thread-local
    capture mode."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
