"""Frame chunking and budget-aware packing of encoder work (pure functions, no I/O).

Chunking: a video's temporal groups are independent attention sequences with positions that
depend only on (h, w), so splitting it along time at group boundaries and concatenating the
chunks' embeddings gives exactly the unchunked result. Long videos thus fit captured graphs
instead of falling back to eager.

Packing: first-fit-decreasing into batches that respect the largest budget's tokens, the items
per batch and the attention sequences per batch, except that the oldest piece always opens the
first batch, so nothing waits behind a stream of larger items.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    max_tokens: int  # patch tokens of the largest budget
    max_items: int
    max_seqs: int  # attention sequences (images + video temporal groups)


@dataclass
class Piece:
    """One unit of encoder work: an image, a video, or a chunk of temporal groups of a video."""

    key: object  # opaque owner reference (request, item, chunk)
    tokens: int
    seqs: int
    age: float = 0.0  # enqueue time; smaller is older


def chunk_video(grid: tuple[int, int, int], limits: Limits) -> list[tuple[int, int]]:
    """[start, end) temporal-group ranges so each chunk fits one batch. A single group that is
    larger than the budget cannot be split (it is one attention sequence) and stays whole."""
    t, h, w = grid
    per_group = h * w
    if per_group > limits.max_tokens:
        return [(0, t)]
    step = max(1, min(limits.max_seqs, limits.max_tokens // per_group))
    return [(s, min(t, s + step)) for s in range(0, t, step)]


def fits(batch_tokens: int, batch_seqs: int, batch_items: int, p: Piece, limits: Limits) -> bool:
    return (batch_tokens + p.tokens <= limits.max_tokens and batch_seqs + p.seqs <= limits.max_seqs
            and batch_items + 1 <= limits.max_items)


def pack(pieces: list[Piece], limits: Limits) -> list[list[Piece]]:
    """Every piece lands in exactly one batch. Pieces that alone exceed a limit get a batch of their
    own (the manager runs those eagerly); all other batches respect every limit."""
    if not pieces:
        return []
    oldest = min(pieces, key=lambda p: p.age)
    rest = sorted((p for p in pieces if p is not oldest), key=lambda p: (-p.tokens, p.age))
    batches: list[list[Piece]] = []
    totals: list[list[int]] = []  # tokens, seqs, items per batch
    for p in [oldest, *rest]:
        for b, tot in zip(batches, totals):
            if fits(*tot, p, limits):
                b.append(p)
                tot[0] += p.tokens
                tot[1] += p.seqs
                tot[2] += 1
                break
        else:
            batches.append([p])
            totals.append([p.tokens, p.seqs, 1])
    return batches
