"""Keeping the engines of a tensor-parallel replica in step.

Each rank of a tensor-parallel group runs a whole engine over its share of the model; requests reach
only rank 0's (the leader). Every turn the leader sends the followers a `Tick`: the sequences it took
from its queue, those cancelled, or the word to stop, their vision embeddings following as tensors.
Each rank then runs the same step: the scheduler is deterministic given the same queue, the logits are
identical (gathered whole) and sampling noise is a function of (seed, position, token), so every rank
samples the same tokens, plans the same next step, and their collectives meet. Only the queue's changes
cross between ranks; only the leader's outputs reach clients.

Ticks are pickles over a CPU (gloo) group, embeddings go over the device group (NCCL). Cancellation is
read once per turn on the leader and applied from the tick on every rank, so no rank drops a request alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .sampling import SamplingParams
from .sequence import GenerationRequest, Sequence, VisionInput


@dataclass
class NewSequence:
    """A sequence the leader queued: a first choice carries its request (without tensors), a fork
    (OpenAI's `n`) names its first choice."""

    id: int  # the leader's Sequence.id
    seed: int
    parent: int | None = None
    input_ids: list[int] | None = None
    mm_token_type_ids: list[int] | None = None
    items: list[tuple] = field(default_factory=list)  # per media item: (grid, rows, key, seconds_per_group)
    params: SamplingParams | None = None
    deepstack_layers: int = 0


@dataclass
class Tick:
    new: list[NewSequence] = field(default_factory=list)
    cancelled: list[int] = field(default_factory=list)  # the leader's ids
    stop: bool = False


def describe(seq: Sequence, req: GenerationRequest | None, parent: Sequence | None) -> NewSequence:
    """The leader's record of a sequence at submit (the request's tensors are not kept: they may be
    GPU memory; the sequence's own concatenated copy travels)."""
    if parent is not None:
        return NewSequence(seq.id, seq.seed, parent=parent.id)
    items = [(tuple(v.grid), v.main.shape[0], v.key, v.seconds_per_group) for v in req.vision]
    layers = len(req.vision[0].deepstack) if req.vision else 0
    return NewSequence(seq.id, seq.seed, None, list(req.input_ids), list(req.mm_token_type_ids), items, req.params,
                       layers)


def rebuild(new: NewSequence, main: torch.Tensor | None, deepstack: torch.Tensor | None) -> GenerationRequest:
    """A follower's copy of a first choice's request, its embeddings split back per item."""
    vision, row = [], 0
    for grid, rows, key, seconds in new.items:
        ds = [deepstack[j, row:row + rows] for j in range(deepstack.shape[0])] if deepstack is not None else []
        vision.append(VisionInput(grid, main[row:row + rows], ds, key, seconds))
        row += rows
    return GenerationRequest(new.input_ids, new.mm_token_type_ids, vision, new.params)


class Channel:
    """From rank 0 to the others: ticks over `cpu_group` (gloo), embeddings over `device_group`."""

    def __init__(self, rank: int, cpu_group, device_group, device: torch.device, hidden: int, dtype: torch.dtype):
        self.rank, self.cpu_group, self.device_group = rank, cpu_group, device_group
        self.device, self.hidden, self.dtype = device, hidden, dtype

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def _send_tick(self, tick: Tick) -> None:
        """The tick's pickle after its length; an empty tick (most decode steps) is the length 0 alone:
        one small broadcast per step."""
        import pickle

        import torch.distributed as dist

        empty = not (tick.new or tick.cancelled or tick.stop)
        data = b"" if empty else pickle.dumps(tick)
        dist.broadcast(torch.tensor([len(data)], dtype=torch.int64), src=0, group=self.cpu_group)
        if data:
            dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=0, group=self.cpu_group)

    def _receive_tick(self) -> Tick:
        import pickle

        import torch.distributed as dist

        size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.cpu_group)
        if not int(size):
            return Tick()
        data = torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(data, src=0, group=self.cpu_group)
        return pickle.loads(data.numpy().tobytes())

    def send(self, tick: Tick, seqs: dict[int, Sequence]) -> None:
        """Leader: the tick, then each new first choice's embeddings in order (`seqs` by id)."""
        import torch.distributed as dist

        self._send_tick(tick)
        for new in tick.new:
            seq = seqs[new.id]
            if new.parent is None and new.items:
                dist.broadcast(seq.vision_main.to(self.device, self.dtype).contiguous(), src=0, group=self.device_group)
                if new.deepstack_layers:
                    dist.broadcast(seq.vision_deepstack.to(self.device, self.dtype).contiguous(), src=0,
                                   group=self.device_group)

    def receive(self) -> tuple[Tick, dict[int, tuple]]:
        """Follower: the tick and, per new first choice with media, its (main, deepstack)."""
        import torch.distributed as dist

        tick = self._receive_tick()
        tensors = {}
        for new in tick.new:
            if new.parent is None and new.items:
                rows = sum(r for _, r, _, _ in new.items)
                main = torch.empty(rows, self.hidden, dtype=self.dtype, device=self.device)
                dist.broadcast(main, src=0, group=self.device_group)
                deep = None
                if new.deepstack_layers:
                    deep = torch.empty(new.deepstack_layers, rows, self.hidden, dtype=self.dtype, device=self.device)
                    dist.broadcast(deep, src=0, group=self.device_group)
                tensors[new.id] = (main, deep)
        return tick, tensors
