"""What every CUDA-graph capture in the project shares.

Python's cyclic garbage collector runs whenever enough objects have been allocated, in whichever
thread allocates them. During a capture that thread is the capturing one, and a collection there may
free an object that owns a CUDA graph from earlier work (an engine or graph manager a test or a
reload left behind in a reference cycle). Destroying a graph is a call CUDA forbids while the thread
captures: the capture is invalidated, and the next kernel launch inside it fails with "operation
failed due to a previous error during capture" (seen in the GPU suite run as one process, where each
failing test passed alone). `torch.cuda.graph` collects on entry, but objects can still become
garbage, and a collection start, while the capture runs; so collection is paused for its length.
"""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def collection_paused():
    """Python's cyclic garbage collection off for the block (for the whole process: captures are short)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
