"""Small all-reduces through torch's symmetric memory, for the decode steps of a tensor-parallel replica.

A decode step of 32B at TP=2 runs 129 all-reduces of about 10 KB. NCCL's ring took 9.85 us each on two
H100s: 1.27 ms of a 14.5 ms token (2026-11-27). At that size the cost is latency, not bandwidth. With
symmetric memory every rank maps the others' buffers over NVLink, and one kernel per rank reads every
peer's copy and sums it (torch's `one_shot_all_reduce`), behind a barrier of signal pads. NVLink
multicast is not needed. Larger inputs (prefill) stay with NCCL.
Opt-in (`decode.py --symm-all-reduce`, `llm.tp_all_reduce: symm_mem`): on two H200s it gave 1.017x NCCL
at one stream and the same at 64 (2026-11-27). It checks itself against NCCL at start. Under Ray each
rank sees its one GPU as cuda:0, which torch's rendezvous refuses: a served replica then keeps NCCL
(logged) until its ranks see every GPU.
"""

from __future__ import annotations

import logging
import warnings

import torch

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 512 * 1024  # 64 decode tokens at hidden 4096 in bf16; NCCL's ring above
SUPPORTED = (torch.bfloat16, torch.float32)


class SymmetricAllReduce:
    """One symmetric buffer per group; `fits(x)` says whether `x` goes through it, `__call__` sums in place."""

    def __init__(self, group, device: torch.device, dtype: torch.dtype, max_bytes: int = DEFAULT_MAX_BYTES):
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        group = group or dist.group.WORLD
        self.group_name = group.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # required before a rendezvous in older torch;
            with warnings.catch_warnings():  # newer ones call it deprecated but still honour it
                warnings.simplefilter("ignore", FutureWarning)
                symm_mem.enable_symm_mem_for_group(self.group_name)
        self.buffer = symm_mem.empty(max_bytes // dtype.itemsize, dtype=dtype, device=device)
        ops = torch.ops.symm_mem
        self._out = getattr(ops, "one_shot_all_reduce_out", None)
        self._ret = ops.one_shot_all_reduce

    def rendezvous(self) -> None:
        """Map every rank's buffer: a collective, so every rank calls it (after all have allocated)."""
        import torch.distributed._symmetric_memory as symm_mem

        symm_mem.rendezvous(self.buffer, self.group_name)

    def fits(self, x: torch.Tensor) -> bool:
        """Whether `x` goes through the buffer: its dtype, contiguous, small enough, whole 4-byte words, and
        16-byte aligned (the kernel writes the result into `x` in 16-byte vectors and checks only its
        input's alignment; a misaligned one would be a sticky CUDA error)."""
        return (x.dtype == self.buffer.dtype and x.is_contiguous() and x.numel() <= self.buffer.numel()
                and x.numel() * x.element_size() % 4 == 0 and x.data_ptr() % 16 == 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        staged = self.buffer[: x.numel()]
        staged.copy_(x.view(-1))
        if self._out is not None:
            self._out(staged, "sum", self.group_name, x.view(-1))
        else:
            x.view(-1).copy_(self._ret(staged, "sum", self.group_name))
        return x


def checked_symm_all_reduce(group, device: torch.device, dtype: torch.dtype, rank: int,
                            max_bytes: int = DEFAULT_MAX_BYTES) -> SymmetricAllReduce | None:
    """A SymmetricAllReduce that gave NCCL's sums on integers (exact in any order and dtype) on every rank,
    or None, with a warning, where torch, the driver or the links cannot (the caller keeps NCCL). Every
    rank must call it: the rendezvous, the sums and the agreements are collectives, and the ranks agree
    after each step so that none waits in a barrier another skipped. torch's kernel takes bf16 and
    float32 only, in multiples of 4 bytes (`fits` asks for that)."""
    import torch.distributed as dist

    def everyone(ok: bool) -> bool:
        flag = torch.tensor([int(ok)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        return bool(flag.item())

    fast, why = None, ""
    if dtype in SUPPORTED:
        try:
            fast = SymmetricAllReduce(group, device, dtype, max_bytes)
        except Exception as e:  # noqa: BLE001 - said below, NCCL kept
            why = f"{type(e).__name__}: {e}"
    else:
        why = f"{dtype} (torch's kernel takes {', '.join(map(str, SUPPORTED))})"
    # agreed before the rendezvous: a rank whose allocation failed would skip it and leave the others
    # waiting in it, each rank in a different collective
    if everyone(fast is not None):
        try:
            fast.rendezvous()
        except Exception as e:  # noqa: BLE001 - said below, NCCL kept
            fast, why = None, f"rendezvous: {type(e).__name__}: {e}"
    else:
        fast = None
    if not everyone(fast is not None):
        log.warning("symmetric-memory all-reduce unavailable, NCCL kept: %s", why or "another rank failed")
        return None
    same = True
    for n in (2, 4096 + 2, fast.buffer.numel()):
        x = (torch.arange(n, device=device) % 17 + rank).to(dtype)
        want = x.clone()
        dist.all_reduce(want, group=group)
        try:  # every rank makes the call whatever an earlier size gave: a rank that skipped it would hang the rest
            ok = torch.equal(fast(x.clone()), want)
        except Exception as e:  # noqa: BLE001 - a raise here is local (the size checks run before the kernel)
            ok, why = False, f"{type(e).__name__}: {e}"
        same = same and ok
    if not everyone(same):
        log.warning("symmetric-memory all-reduce differs from NCCL or failed on some rank, NCCL kept: %s",
                    why or "another rank")
        return None
    return fast
