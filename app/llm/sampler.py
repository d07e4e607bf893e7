"""Sampling for a whole step's batch on the device: penalties, temperature, top-k, top-p, seeds.

One call per step for every request that samples, with no per-request kernels and no host round
trip: the host learns only the chosen token ids (one copy, after the step), plus, for steps where a
request asked for them, log-probabilities (logprobs.py).

Randomness is counter-based: the noise for token `v` of a request's `n`-th output is a hash of
(seed, n, v), turned into Gumbel noise, and the sample is argmax(logits / T + noise), which draws
from softmax(logits / T) over the tokens top-k and top-p leave. A seed thus gives the same output
whatever else shares the batch, and after a preemption.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .logprobs import token_logprobs

_M64 = (1 << 64) - 1


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _MIX1, _MIX2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser, in wrapping int64 arithmetic."""
    x = x + _GOLDEN
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """[S, vocab] float32 in (0, 1), a pure function of (seed, step, token id)."""
    key = _mix(_mix(seeds) ^ steps)[:, None]
    return unit_interval(_mix(key ^ torch.arange(vocab, device=seeds.device, dtype=torch.int64)[None, :] * _MIX2))


def unit_interval(bits: torch.Tensor) -> torch.Tensor:
    """Random int64 bits -> float32 strictly inside (0, 1), from the top 23 bits: (k + 0.5) / 2^23 is exact
    in float32. With 24 bits, (2^24 - 1 + 0.5) rounds to 2^24: a noise of exactly 1.0 made its Gumbel
    +inf, so once per 2^24 tokens (about 1% of rows over a 152k vocabulary) a token that top-k, top-p
    or a structured-output mask had set to -inf came back as NaN, and argmax took it."""
    return (_shr(bits, 41).float() + 0.5) * (1.0 / (1 << 23))


def top_p_filter(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """x [S, vocab] with each row's tokens outside its nucleus (the smallest set whose probability
    reaches top_p) at -inf. The most likely token always stays; top_p 1 keeps every token (a float32
    cumsum over 152k tokens ends above 1, which cut a top_p=1 row's tail when another row of the step
    used top_p)."""
    ordered = x.sort(dim=-1, descending=True).values
    probs = ordered.softmax(-1)
    keep = (probs.cumsum(-1) - probs < top_p[:, None]) | (top_p[:, None] >= 1)
    floor = ordered.masked_fill(~keep, float("inf")).min(-1, keepdim=True).values
    return x.masked_fill(x < floor, float("-inf"))


@dataclass
class SamplingBatch:
    """Per-row parameters of the rows that sample this step (device tensors), and what the host
    knows about them (which transforms are needed at all)."""

    temperature: torch.Tensor  # [S] float32, 0 = greedy
    top_k: torch.Tensor  # [S] int32, 0 = off
    top_p: torch.Tensor  # [S] float32
    seeds: torch.Tensor  # [S] int64
    steps: torch.Tensor  # [S] int64, the index of the output token being sampled
    frequency_penalty: torch.Tensor  # [S] float32
    presence_penalty: torch.Tensor  # [S] float32
    rows: torch.Tensor  # [S] int64, each request's row of the penalty counts (its block-table row)
    all_greedy: bool = True
    max_top_k: int = 0
    any_top_p: bool = False
    any_penalty: bool = False


def host_sampling_arrays(seqs) -> dict[str, np.ndarray]:
    """The parameters of `seqs` as host arrays, ready to travel in the step's one copy."""
    ps = [s.params for s in seqs]
    return {
        "temperature": np.array([p.temperature for p in ps], dtype=np.float32),
        "top_k": np.array([p.top_k for p in ps], dtype=np.int32),
        "top_p": np.array([p.top_p for p in ps], dtype=np.float32),
        "seeds": np.array([s.seed for s in seqs], dtype=np.int64),
        "steps": np.array([s.num_output for s in seqs], dtype=np.int64),
        "frequency_penalty": np.array([p.frequency_penalty for p in ps], dtype=np.float32),
        "presence_penalty": np.array([p.presence_penalty for p in ps], dtype=np.float32),
        "rows": np.array([s.row for s in seqs], dtype=np.int64),
    }


class Sampler:
    def __init__(self, vocab: int, rows: int, device: torch.device):
        self.vocab, self.rows, self.device = vocab, rows, device
        self.counts: torch.Tensor | None = None  # [rows, vocab] output-token counts, made on first use

    def _counts(self) -> torch.Tensor:
        if self.counts is None:
            self.counts = torch.zeros(self.rows, self.vocab, dtype=torch.int32, device=self.device)
        return self.counts

    def reset_counts(self, row: int, output_ids: list[int]) -> None:
        """A penalised request took `row`: it counts its output so far (none, or the tokens it had
        before a preemption)."""
        counts = self._counts()
        counts[row].zero_()
        if output_ids:
            ids = torch.tensor(output_ids, device=self.device)
            counts[row].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))

    def __call__(self, logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
        """logits [S, vocab] -> token ids [S] (int64, on the device)."""
        logits = logits[:, :self.vocab].float()
        if b.any_penalty:
            counts = self._counts()[b.rows].float()
            logits = logits - b.frequency_penalty[:, None] * counts - b.presence_penalty[:, None] * (counts > 0)
        greedy = logits.argmax(-1)
        if b.all_greedy:
            return greedy
        temp = torch.where(b.temperature > 0, b.temperature, torch.ones_like(b.temperature))
        x = logits / temp[:, None]
        if b.max_top_k:
            k = min(b.max_top_k, self.vocab)
            kth = x.topk(k, dim=-1).values.gather(1, (b.top_k.long().clamp(1, k) - 1)[:, None])
            kth = torch.where(b.top_k[:, None] > 0, kth, torch.full_like(kth, float("-inf")))
            x = x.masked_fill(x < kth, float("-inf"))
        if b.any_top_p:
            x = top_p_filter(x, b.top_p)
        noise = uniform_noise(b.seeds, b.steps, x.shape[-1])
        sampled = (x - torch.log(-torch.log(noise))).argmax(-1)
        return torch.where(b.temperature > 0, sampled, greedy)

    def token_logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
        """The rows' log-probabilities, packed [S, 1 + 2k] for one copy to the host (logprobs.py)."""
        return token_logprobs(logits[:, :self.vocab], tokens, k)

    def count(self, tokens: torch.Tensor, b: SamplingBatch) -> None:
        """Add this step's tokens to the penalty counts of the rows that use penalties."""
        if b.any_penalty:
            self._counts().index_put_((b.rows, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)
