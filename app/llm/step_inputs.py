"""A step's inputs on the device: every array the forward, the attention kernel and the sampler read,
laid out in one int32 buffer and copied to the device in one go (host time per step is what caps a
Python engine). `StepLayout` fixes where a step graph reads each array; the bucket helpers say which
batch sizes and token counts get a graph.
"""

from __future__ import annotations

import numpy as np
import torch


def decode_buckets(max_batch: int) -> list[int]:
    """Batch sizes with a decode graph: 1, 2, 4, 8, then every multiple of 8 up to max_batch."""
    out = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return sorted(set(out + [max_batch]))


def step_buckets(max_tokens: int) -> list[int]:
    """Token counts with a step graph: 16, 32, 64, 128, then every 128 up to 1024, every 256 up to 4096,
    every 512 beyond, and max_tokens itself. A step pads to at most twice its tokens up to 128, then by
    fewer than 128 tokens up to 1024 (2.4% of a 1000-token prompt), 256 up to 4096, 512 beyond: 15
    graphs for the default 2048-token budget."""
    out, b = [], 16
    while b < max_tokens:
        out.append(b)
        b = 2 * b if b < 128 else b + (128 if b < 1024 else 256 if b < 4096 else 512)
    return out + [max_tokens]


class StepLayout:
    """Where a step's forward reads its inputs: int32 arrays for `tokens` rows, `seqs` sequences and
    `work` attention programs, each on a 16-byte boundary, in one array that `StepInputs.pack` puts at
    the start of the device buffer (the fixed addresses a step graph was captured on).

    A step graph's layout is larger than the steps it serves; the tail entries are padding that does
    nothing: token rows write KV slot 0 (block 0, nobody's cache), sequences have no queries and no
    keys, and attention programs point at such a sequence."""

    FIELDS = ("ids", "pos", "slots", "vis_mask", "qstart", "lens", "rows", "wseq", "wq0")

    def __init__(self, tokens: int, seqs: int, work: int):
        self.tokens, self.seqs, self.work = tokens, seqs, work
        shapes = [(tokens,), (3, tokens), (tokens,), (tokens,), (seqs + 1,), (seqs,), (seqs,), (work,), (work,)]
        self.slices, off = {}, 0
        for name, shape in zip(self.FIELDS, shapes):
            n = int(np.prod(shape))
            self.slices[name] = (off, n, shape)
            off += -(-n // 4) * 4
        self.words = off

    def views(self, buf):
        """name -> view of a flat int32 buffer (numpy array or tensor) laid out this way."""
        return {name: buf[o:o + n].reshape(shape) for name, (o, n, shape) in self.slices.items()}

    def fill(self, a: dict[str, np.ndarray], padding_row: int) -> np.ndarray:
        """The flat array for a step's host arrays `a` (as `ModelRunner._step_arrays` makes them), padded."""
        out = np.zeros(self.words, dtype=np.int32)
        v = self.views(out)
        t, n, w = len(a["ids"]), len(a["lens"]), len(a["wseq"])
        for name in ("ids", "slots", "vis_mask"):
            v[name][:t] = a[name]
        v["pos"][:, :t] = a["pos"]
        v["qstart"][:n + 1] = a["qstart"]
        v["qstart"][n + 1:] = t
        v["lens"][:n] = a["lens"]
        v["rows"][:n] = a["rows"]
        v["rows"][n:] = padding_row
        v["wseq"][:w] = a["wseq"]
        v["wseq"][w:] = self.seqs - 1  # a padding sequence: padded layouts have one more than any step
        v["wq0"][:w] = a["wq0"]
        return out


class StepInputs:
    """Lays host arrays out in one int32 buffer, copies it to the device in one go, and returns device
    views. On the CPU the views are the host arrays themselves.

    Every array starts on a 16-byte boundary: Triton compiles a kernel per combination of its pointer
    arguments' 16-byte alignment, so arrays at arbitrary offsets made slow new compilations appear at
    random while serving (benchmarks/results/2026-11-21-llm-engine.md)."""

    def __init__(self, device: torch.device, capacity: int):
        self.device = device
        self.frozen = False  # set once CUDA graphs read from the buffer: it must not move
        self._alloc(capacity)

    def _alloc(self, capacity: int) -> None:
        cuda = self.device.type == "cuda"
        # two pinned host buffers, used in turn: the previous step's copy may still be queued. Each has an
        # event recorded after its copy, waited on before the buffer is written again: a step that samples
        # nothing (a prompt's middle chunk) is never waited on otherwise, so with overlapped steps the
        # buffer of step N could be rewritten by step N + 2 while step N's copy still waits in the queue.
        self.hosts = [torch.empty(capacity, dtype=torch.int32, pin_memory=cuda) for _ in range(2 if cuda else 1)]
        self.copied = [torch.cuda.Event() if cuda else None for _ in self.hosts]
        self.turn = 0
        self.host = self.hosts[0]
        self.dev = torch.empty(capacity, dtype=torch.int32, device=self.device) if cuda else self.host

    def pack(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        layout, off = [], 0
        for name, a in arrays.items():
            a = np.ascontiguousarray(a)
            off = -(-off // 4) * 4  # 16 bytes
            words = a.dtype.itemsize // 4 * a.size
            layout.append((name, a, off, words))
            off += words
        if off > self.host.numel():
            if self.frozen:
                raise RuntimeError(f"step inputs of {off} words overflow the graph input buffer")
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()  # the old buffer may still be in flight
            self._alloc(max(off, 2 * self.host.numel()))
        self.turn = (self.turn + 1) % len(self.hosts)
        self.host = self.hosts[self.turn]
        copied = self.copied[self.turn]
        if copied is not None:
            copied.synchronize()  # this buffer's previous copy has left it (at once unless a step lags)
        host_np = self.host.numpy()
        for _, a, o, w in layout:
            host_np[o:o + w] = a.reshape(-1).view(np.int32)
        if self.dev is not self.host:
            self.dev[:off].copy_(self.host[:off], non_blocking=True)
            copied.record(torch.cuda.current_stream(self.device))  # the stream the copy is on
        dtypes = {np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64,
                  np.dtype(np.float32): torch.float32}
        return {name: self.dev[o:o + w].view(dtypes[a.dtype]).view(a.shape) for name, a, o, w in layout}
