"""The paged KV cache's bookkeeping: which blocks are free, which sequences use which, and which
blocks hold a known prefix.

The cache is a pool of fixed-size blocks and a sequence owns a list of them (its block table), so no
memory is reserved for tokens a request may never produce. Prefix caching: a computed full prompt
block is registered under a hash chained over every block before it (a block's KV depends on the
whole prefix), and a later prompt that starts with the same blocks, same text and same media
content, takes them by reference instead of recomputing them. Freed blocks keep their contents and
registration until the pool hands them out again, least recently freed first. Block 0 is never
handed out: padded rows of a CUDA-graph batch write their keys and values there.
"""

from __future__ import annotations

from collections import OrderedDict

from .sequence import Sequence

# A waiting prompt waits for another's computation of their shared blocks only when they hold this many
# tokens at least (computed_by).
WAIT_MIN_TOKENS = 64


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        if num_blocks < 2:
            raise ValueError("the KV cache needs at least 2 blocks (one is the padding block)")
        self.block_size, self.prefix_caching = block_size, prefix_caching
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self.cached: dict[int, int] = {}  # chained hash -> block
        self.meta: dict[int, tuple[int, tuple, int]] = {}  # block -> (parent hash, keys, own hash)
        self.computing: dict[int, Sequence] = {}  # chained hash -> the admitted sequence about to compute it
        self.queried_tokens = 0
        self.hit_tokens = 0

    # ------------------------------------------------------------------ capacity
    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        return 1.0 - self.num_free / self.usable_blocks

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    # ------------------------------------------------------------------ prefix cache
    @staticmethod
    def chain(seq: Sequence) -> list[int]:
        """The chained hash of each full prompt block of `seq` (a block's KV depends on every block
        before it), computed once per sequence."""
        if seq.prompt_hashes is None:
            hashes, parent = [], 0
            for keys in seq.block_keys:
                parent = hash((parent, keys))
                hashes.append(parent)
            seq.prompt_hashes = hashes
        return seq.prompt_hashes

    def _lookup(self, seq: Sequence) -> list[int]:
        """Registered blocks matching the start of `seq`, leaving at least one token to compute (its
        logits give the next token)."""
        if not self.prefix_caching:
            return []
        hits, parent, chain = [], 0, self.chain(seq)
        for i, keys in enumerate(seq.block_keys[:(len(seq) - 1) // self.block_size]):
            h = chain[i]
            b = self.cached.get(h)
            if b is None or self.meta[b][:2] != (parent, keys):
                break
            hits.append(b)
            parent = h
        return hits

    def computed_by(self, seq: Sequence) -> Sequence | None:
        """The admitted sequence about to compute the next blocks `seq` could take from the cache (past
        the blocks already there), or None.

        A block is registered only once the step computing it is launched, so prompts that share a
        prefix and arrive together would each compute it. `allocate` therefore notes the blocks an
        admitted prompt is about to compute (`computing`), and a waiting prompt whose next uncached
        block is among them waits until they are registered, then takes them (several choices of one
        request, rollouts sent as separate requests, many questions about one image). It waits only
        when they hold at least WAIT_MIN_TOKENS: waiting costs a step, not worth it for a shared
        chat-template head on a cold cache."""
        if not self.computing:
            seq.waits_on = None
            return None
        if seq.waits_on is not None:  # the last shared block is still the owner's to compute: O(1) per step
            last, owner = seq.waits_on
            if self.computing.get(last) is owner:
                return owner
            seq.waits_on = None
        chain = self.chain(seq)  # the prompt's blocks only: a preempted sequence also holds output tokens
        k, limit = len(self._lookup(seq)), min((len(seq) - 1) // self.block_size, len(chain))
        owner = self.computing.get(chain[k]) if k < limit else None
        if owner is None or owner is seq:
            return None
        run = 1
        while k + run < limit and self.computing.get(chain[k + run]) is owner:
            run += 1
        if run * self.block_size < WAIT_MIN_TOKENS:
            return None
        seq.waits_on = (chain[k + run - 1], owner)
        return owner

    def register_computed(self, seq: Sequence) -> None:
        """Register the full prompt blocks of `seq` whose KV is now in the cache."""
        if not self.prefix_caching:
            return
        done = min(seq.num_computed // self.block_size, len(seq.block_keys))
        hashes, chain = seq.block_hashes, self.chain(seq)
        while len(hashes) < done:
            i = len(hashes)
            parent = hashes[-1] if hashes else 0
            h = chain[i]
            hashes.append(h)
            if self.computing.get(h) is seq:
                del self.computing[h]
            b = seq.block_table[i]
            if h not in self.cached and b not in self.meta:
                self.cached[h] = b
                self.meta[b] = (parent, seq.block_keys[i], h)

    def _forget_computing(self, seq: Sequence) -> None:
        """`seq` will not compute its noted blocks after all (freed: finished, cancelled, preempted)."""
        if self.computing:
            for h in self.chain(seq)[len(seq.block_hashes):]:
                if self.computing.get(h) is seq:
                    del self.computing[h]

    def _take(self, b: int) -> None:
        """Remove a block from the free list; if it is reused for other content, forget its prefix."""
        del self.free[b]

    def _fresh(self) -> int:
        b, _ = self.free.popitem(last=False)
        m = self.meta.pop(b, None)
        if m is not None and self.cached.get(m[2]) == b:
            del self.cached[m[2]]
        self.ref[b] = 1
        return b

    # ------------------------------------------------------------------ sequences
    def allocate(self, seq: Sequence) -> bool:
        """Blocks for every token of `seq` (the prompt, or prompt + output after a preemption), the
        cached prefix shared. False, with nothing taken, if the pool is short."""
        hits = self._lookup(seq)
        need = self.blocks_for(len(seq)) - len(hits)
        idle_hits = sum(1 for b in hits if self.ref[b] == 0)
        if need > self.num_free - idle_hits:
            return False
        for b in hits:
            if self.ref[b] == 0:
                self._take(b)
            self.ref[b] += 1
        seq.block_table = hits + [self._fresh() for _ in range(need)]
        seq.block_hashes = [self.meta[b][2] for b in hits]
        seq.num_cached = seq.num_computed = len(hits) * self.block_size
        if self.prefix_caching:
            for h in self.chain(seq)[len(hits):]:
                self.computing.setdefault(h, seq)
        self.queried_tokens += len(seq)
        self.hit_tokens += seq.num_cached
        return True

    def append(self, seq: Sequence) -> None:
        """Make room for the token at index len(seq) - 1 (the one about to be computed)."""
        if len(seq.block_table) * self.block_size < len(seq):
            seq.block_table.append(self._fresh())

    def free_seq(self, seq: Sequence) -> None:
        """Return the sequence's blocks; the tail goes first into the free list, so it is reused
        before the (more shareable) head."""
        self._forget_computing(seq)
        for b in reversed(seq.block_table):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed = 0
