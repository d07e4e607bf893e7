"""What runs in the next step: continuous batching with chunked prefill under a token budget.

Each step has a budget of `max_num_batched_tokens` tokens, filled by decodes first, then prefill
chunks of admitted requests, then new requests (`Scheduler.schedule` gives the order). So a long
prompt is prefilled in chunks over several steps while everyone else keeps decoding. When a decode
needs a block and none is free, the most recently admitted request is preempted: its blocks are
freed and it goes back to the head of the queue, to be recomputed (its prompt's blocks usually come
back from the prefix cache). Nothing it produced is lost: its tokens stay in the sequence.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .sequence import Sequence, Status


@dataclass
class StepPlan:
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    sample: list[bool] = field(default_factory=list)  # does the sequence reach its last token (and sample)?
    decode_only: bool = True

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_tokens.append(n)
        self.sample.append(seq.num_computed + n == len(seq.token_ids))
        self.decode_only = self.decode_only and n == 1


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.blocks = blocks
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self.preempted: list[Sequence] = []  # since the engine last looked (it releases their rows)
        self.short_of_room = False  # see schedule(), step 3

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        """The next step, its token budget filled in this order:
        1. every running request that is decoding (one token each), growing its block table by a
           block when it crosses a block boundary;
        2. running requests still prefilling, one chunk each (what is left of the prompt, or what fits);
        3. waiting requests, first come first served, while the budget, `max_num_seqs` and free KV
           blocks last. A request's blocks, past a cached prefix, are taken when it is admitted. A
           request whose prompt continues with blocks that an admitted one is about to compute
           (another choice of the same request, the same prompt sent twice) is passed over until they
           are in the cache, and then takes them instead of computing them again; the requests behind
           it go ahead."""
        plan, budget = StepPlan(), self.max_num_batched_tokens
        blocks, bs = self.blocks, self.blocks.block_size
        running = Status.RUNNING
        # 1. decodes (the hot loop: one pass over the running requests, checks inlined)
        for seq in list(self.running):
            if budget == 0:
                break
            length = len(seq.token_ids)
            if length - seq.num_computed != 1 or seq.status is not running:
                continue
            if length - seq.prompt_len >= seq.max_new:  # its last token is still on the device (overlapped steps)
                continue
            if len(seq.block_table) * bs < length:  # crosses into a new block
                while not blocks.num_free:
                    victim = self.running[-1]
                    self.preempt(victim)
                    if victim is seq:
                        break
                if seq.status is not running:
                    continue
                blocks.append(seq)
            plan.seqs.append(seq)
            plan.num_tokens.append(1)
            plan.sample.append(True)
            budget -= 1
        # 2. prefill chunks of admitted requests
        for seq in self.running:
            if budget == 0:
                break
            left = len(seq.token_ids) - seq.num_computed
            if left > 1:
                n = min(left, budget)
                plan.add(seq, n)
                budget -= n
        # 3. new requests
        waiting, i, no_blocks = self.waiting, 0, False
        while i < len(waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = waiting[i]
            if seq.token_ids[-1] < 0:  # preempted with a token still on the device: admitted once it is read
                break
            if blocks.computed_by(seq) is not None:  # its prefix is being computed: it takes it next step
                i += 1
                continue
            if not blocks.allocate(seq):
                no_blocks = True
                break
            del waiting[i]
            seq.status = running
            if seq.scheduled_time is None:
                seq.scheduled_time = time.perf_counter()
            self.running.append(seq)
            n = min(seq.num_remaining, budget)
            plan.add(seq, n)
            budget -= n
        # Requests left waiting for a sequence slot or KV blocks, not just for the next step's token
        # budget: the fused replica's encoder batches longer meanwhile (Engine.short_of_room).
        self.short_of_room = bool(waiting) and (no_blocks or len(self.running) >= self.max_num_seqs)
        return plan

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free_seq(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.preemptions += 1
        self.preempted.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or cancelled request out, wherever it is, and free its blocks."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self.blocks.free_seq(seq)
        elif seq.status is Status.WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        seq.status = Status.FINISHED
