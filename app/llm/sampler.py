"""Sampling for a whole step's batch on the device: penalties, temperature, min-p, top-k, top-p, seeds.

One call per step, no per-request kernels, no host round trip: the host learns only the chosen ids
(one copy after the step), plus log-probabilities where asked (logprobs.py). In vLLM's order:
`min_tokens` (end and stop ids at -inf until reached), the repetition penalty (transformers' rule),
frequency and presence penalties (OpenAI's), the greedy choice, then for sampled rows temperature,
min-p, top-k and top-p. Per-row state (output counts, prompt tokens, held-back ids) lives in tensors
indexed by the request's row, written once at `admit` from pinned memory without a device wait.

Randomness is counter-based: the noise for token `v` of a request's `n`-th output is a hash of
(seed, n, v) made Gumbel, and argmax(logits / T + noise) draws from softmax(logits / T) over what
top-k and top-p leave, so a seed gives the same output whatever shares the batch, and after a preemption.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .logprobs import token_logprobs
from .sampling import MAX_STOP_TOKEN_IDS

HELD_IDS = MAX_STOP_TOKEN_IDS + 16  # per row: a request's stop_token_ids and up to 16 end-of-sequence ids
TIE_ROOM = 256  # candidates beyond the largest top_k, for the tokens tied with a row's k-th logit

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
    return noise_at(seeds, steps, torch.arange(vocab, device=seeds.device, dtype=torch.int64)[None, :])


def noise_at(seeds: torch.Tensor, steps: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """`uniform_noise`'s values at the token ids `ids` ([S, n] int64, or [1, n] for every row) alone."""
    key = _mix(_mix(seeds) ^ steps)[:, None]
    return unit_interval(_mix(key ^ ids * _MIX2))


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
    return x.masked_fill(x < nucleus_floor(x.sort(dim=-1, descending=True).values, top_p), float("-inf"))


def nucleus_floor(ordered: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[S, 1]: the lowest logit each row's nucleus keeps, from its logits sorted in descending order
    (every token at or above it stays: ties with the last one kept are kept)."""
    probs = ordered.softmax(-1)
    keep = (probs.cumsum(-1) - probs < top_p[:, None]) | (top_p[:, None] >= 1)
    return ordered.masked_fill(~keep, float("inf")).min(-1, keepdim=True).values


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
    repetition_penalty: torch.Tensor | None = None  # [S] float32, 1 = off
    min_p: torch.Tensor | None = None  # [S] float32, 0 = off
    min_tokens: torch.Tensor | None = None  # [S] int32: its row's held-back ids stay at -inf while steps < this
    all_greedy: bool = True
    max_top_k: int = 0
    any_top_p: bool = False
    any_penalty: bool = False  # frequency, presence or repetition: the output counts are kept
    any_repetition: bool = False
    any_min_p: bool = False
    any_min_tokens: bool = False
    # every row that samples has a top_k: they are all drawn from their top-k candidates alone (`Sampler`);
    # False (the safe default) also runs the whole-vocabulary draw, for the rows without one
    all_top_k: bool = False


# SamplingBatch's tensors, in order: the step's host arrays (`host_sampling_arrays`) by these names
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "seeds", "steps", "frequency_penalty", "presence_penalty", "rows",
                   "repetition_penalty", "min_p", "min_tokens")


def uses_counts(p) -> bool:
    """Whether a request's sampling reads its output-token counts (frequency, presence or repetition penalty)."""
    return bool(p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1.0)


def host_sampling_flags(seqs, holds_back) -> tuple[dict, bool]:
    """(SamplingBatch's flags for `seqs`, whether the sampler needs their arrays at all: not for a batch
    of plain greedy rows). `holds_back(seq)`: whether min_tokens still holds tokens back for it. One
    pass over the rows: this is host time of every step."""
    greedy, penalty, repetition, min_p, top_p, held, top_k = True, False, False, False, False, False, 0
    all_top_k = True  # every row that samples has a top_k (Sampler.drawn_from_top_k alone)
    for s in seqs:
        p = s.params
        greedy = greedy and p.temperature == 0
        if p.temperature > 0 and p.top_k <= 0:
            all_top_k = False
        if p.frequency_penalty or p.presence_penalty:
            penalty = True
        if p.repetition_penalty != 1.0:
            penalty = repetition = True
        min_p = min_p or p.min_p > 0
        top_p = top_p or p.top_p < 1.0
        top_k = max(top_k, p.top_k)
        if p.min_tokens and not held:
            held = holds_back(s)
    flags = {"all_greedy": greedy, "any_penalty": penalty, "any_min_tokens": held}
    if greedy and not penalty and not held:
        return flags, False
    return flags | {"any_repetition": repetition, "max_top_k": top_k, "any_top_p": top_p, "any_min_p": min_p,
                    "all_top_k": all_top_k}, True


def host_sampling_arrays(seqs, holds_back=None) -> dict[str, np.ndarray]:
    """The parameters of `seqs` as host arrays, ready to travel in the step's one copy. `holds_back`
    as in `host_sampling_flags` (None: min_tokens holds nothing back)."""
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
        "repetition_penalty": np.array([p.repetition_penalty for p in ps], dtype=np.float32),
        "min_p": np.array([p.min_p for p in ps], dtype=np.float32),
        "min_tokens": np.array([s.params.min_tokens if holds_back is not None and holds_back(s) else 0
                                for s in seqs], dtype=np.int32),
    }


def worst_case_batch(rows: int, device: torch.device) -> SamplingBatch:
    """Every transform on `rows` rows (the memory profile of the largest step)."""
    f = torch.full((rows,), 0.5, device=device)
    zeros = torch.zeros(rows, dtype=torch.int64, device=device)
    top_k = torch.full((rows,), 50, dtype=torch.int32, device=device)
    top_k[::2] = 0  # rows with and without a top_k: both draws run (all_top_k False)
    return SamplingBatch(f, top_k, f, zeros, zeros, f, f, zeros,
                         repetition_penalty=f, min_p=f, min_tokens=torch.ones(rows, dtype=torch.int32, device=device),
                         all_greedy=False, max_top_k=50, any_top_p=True, any_penalty=True, any_repetition=True,
                         any_min_p=True, any_min_tokens=True)


class Sampler:
    def __init__(self, vocab: int, rows: int, device: torch.device):
        self.vocab, self.rows, self.device = vocab, rows, device
        self.counts: torch.Tensor | None = None  # [rows, vocab] output-token counts, made on first use
        self.prompt_seen: torch.Tensor | None = None  # [rows, vocab] bool: the prompt's tokens (repetition)
        # the end-of-sequence ids (the engine sets them): held back, with a request's stop_token_ids,
        # until it has min_tokens output tokens
        self.eos_ids: list[int] = []
        self.held: torch.Tensor | None = None  # [rows, HELD_IDS] those ids per row
        self.holds: list[bool] = [False] * rows  # whether a row's request has any id to hold back

    def _counts(self) -> torch.Tensor:
        if self.counts is None:
            self.counts = torch.zeros(self.rows, self.vocab, dtype=torch.int32, device=self.device)
        return self.counts

    def _prompt_seen(self) -> torch.Tensor:
        if self.prompt_seen is None:
            self.prompt_seen = torch.zeros(self.rows, self.vocab, dtype=torch.bool, device=self.device)
        return self.prompt_seen

    def _held(self) -> torch.Tensor:
        if self.held is None:
            self.held = torch.zeros(self.rows, HELD_IDS, dtype=torch.int64, device=self.device)
        return self.held

    def _to_device(self, ids: list[int]) -> torch.Tensor:
        """int64 ids on the device, from pinned memory without waiting (the engine thread must not
        wait for the step in flight; the pinned block is kept until its copy has run)."""
        t = torch.tensor(ids, dtype=torch.int64)
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    def held_ids(self, p) -> list[int]:
        """The ids `min_tokens` holds back for a request: the end-of-sequence ids (unless it ignores
        them) and its stop_token_ids, those of the vocabulary."""
        ids = ([] if p.ignore_eos else sorted(self.eos_ids)[:HELD_IDS - MAX_STOP_TOKEN_IDS]) + list(p.stop_token_ids)
        return list(dict.fromkeys(i for i in ids if 0 <= i < self.vocab))[:HELD_IDS]

    def holds_back(self, seq) -> bool:
        """Whether min_tokens holds ids back for `seq` at its next token (its row is assigned)."""
        return seq.params.min_tokens > seq.num_output and self.holds[seq.row]

    def admit(self, row: int, seq) -> None:
        """A request (`seq`: its params, token_ids, prompt_len, output_ids) took `row`: its per-row state,
        what each of its settings reads (none for most requests), written without a host wait."""
        params = seq.params
        if uses_counts(params):
            self.reset_counts(row, seq.output_ids)
        if params.repetition_penalty != 1.0:
            seen = self._prompt_seen()[row]
            seen.zero_()
            # the whole prompt, as transformers' and vLLM's rule reads it (vision placeholders too)
            ids = [i for i in seq.token_ids[:seq.prompt_len] if 0 <= i < self.vocab]
            if ids:
                seen.index_fill_(0, self._to_device(ids), True)
        self.holds[row] = False
        if params.min_tokens > 0:
            ids = self.held_ids(params)
            if ids:  # padded with its first id: a scatter writes the same value twice
                held = self._held()[row]
                held.copy_(self._to_device(ids + [ids[0]] * (held.numel() - len(ids))), non_blocking=True)
                self.holds[row] = True

    def reset_counts(self, row: int, output_ids: list[int]) -> None:
        """A penalised request took `row`: it counts its output so far (none, or the tokens it had
        before a preemption)."""
        counts = self._counts()
        counts[row].zero_()
        output_ids = [i for i in output_ids if 0 <= i < self.vocab]
        if output_ids:
            ids = self._to_device(output_ids)
            counts[row].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))

    def __call__(self, logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
        """logits [S, vocab] -> token ids [S] (int64, on the device)."""
        logits = self.penalized(logits[:, :self.vocab].float(), b)
        greedy = logits.argmax(-1)
        if b.all_greedy:
            return greedy
        if not b.max_top_k:
            sampled = self.drawn(logits, b)
        elif b.all_top_k:
            sampled = self.drawn_from_top_k(logits, b)
        else:  # rows with and rows without a top_k: each row's draw is made the way its own settings ask
            sampled = torch.where(b.top_k > 0, self.drawn_from_top_k(logits, b), self.drawn(logits, b))
        return torch.where(b.temperature > 0, sampled, greedy)

    def drawn(self, logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
        """The sampled ids [S] over the whole vocabulary: argmax of the `filtered` logits plus Gumbel
        noise (a draw from their softmax)."""
        x = self.filtered(logits, b)
        return (x - torch.log(-torch.log(uniform_noise(b.seeds, b.steps, x.shape[-1])))).argmax(-1)

    def drawn_from_top_k(self, logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
        """`drawn` for rows with a top_k, from their `max_top_k + TIE_ROOM` highest logits alone: top-k
        keeps nothing outside them, so min-p, top-p and the noise need only those, already sorted. Over
        Qwen3-VL's 151,936 tokens the whole-vocabulary draw sorts every row for top-p and hashes noise for
        every token: a 64-row step at Qwen3-VL's defaults took 532 ms that way on the CPU machine, 9.4 this
        way, and 2.5 greedy (benchmarks/sampler.py).

        The same draw as `drawn`, token for token, where a row has fewer than TIE_ROOM tokens tied with its
        k-th logit beyond the k (ties are kept, as transformers' and vLLM's top-k keep them); past that
        the ties kept are those `topk` returned first. Top-p's probabilities are summed over the
        candidates rather than the vocabulary, so a row whose nucleus ends within float32 rounding of
        top_p may keep one token more or fewer. Among perturbed logits equal to the last bit the lowest
        id wins, as argmax over the vocabulary picks it."""
        k = min(b.max_top_k, self.vocab)
        vals, ids = logits.topk(min(self.vocab, k + TIE_ROOM), dim=-1)  # sorted, highest first
        temp = torch.where(b.temperature > 0, b.temperature, torch.ones_like(b.temperature))
        x = vals / temp[:, None]
        if b.any_min_p:
            x = x.masked_fill(x < x[:, :1] + torch.log(b.min_p)[:, None], float("-inf"))
        kth = x.gather(1, (b.top_k.long().clamp(1, k) - 1)[:, None])
        x = x.masked_fill((x < kth) & (b.top_k[:, None] > 0), float("-inf"))
        if b.any_top_p:
            x = x.masked_fill(x < nucleus_floor(x, b.top_p), float("-inf"))
        z = x - torch.log(-torch.log(noise_at(b.seeds, b.steps, ids)))
        best = z.max(-1, keepdim=True).values
        return ids.masked_fill(z != best, self.vocab).min(-1).values

    def penalized(self, logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
        """What every row's choice reads, greedy or sampled: float32 logits [S, vocab] with min_tokens'
        held-back ids at -inf and the penalties applied."""
        if b.any_min_tokens:  # the held-back ids of rows short of min_tokens at -inf, the others' as they are
            ids = self._held()[b.rows]
            short = (b.steps < b.min_tokens)[:, None]
            logits = logits.scatter(1, ids, torch.where(short, float("-inf"), logits.gather(1, ids)))
        if b.any_penalty:
            counts = self._counts()[b.rows]
            if b.any_repetition:
                seen = self._prompt_seen()[b.rows] | (counts > 0)
                rep = b.repetition_penalty[:, None]
                logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
            counts = counts.float()
            logits = logits - b.frequency_penalty[:, None] * counts - b.presence_penalty[:, None] * (counts > 0)
        return logits

    def filtered(self, logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
        """The distribution sampled rows draw from, as logits: `penalized` ones over the temperature, with
        the tokens min-p, top-k and top-p leave out at -inf."""
        temp = torch.where(b.temperature > 0, b.temperature, torch.ones_like(b.temperature))
        x = logits / temp[:, None]
        if b.any_min_p:  # p >= min_p * p_max  <=>  x >= max(x) + log(min_p); min_p 0 keeps every token
            floor = x.max(-1, keepdim=True).values + torch.log(b.min_p)[:, None]
            x = x.masked_fill(x < floor, float("-inf"))
        if b.max_top_k:
            k = min(b.max_top_k, self.vocab)
            kth = x.topk(k, dim=-1).values.gather(1, (b.top_k.long().clamp(1, k) - 1)[:, None])
            kth = torch.where(b.top_k[:, None] > 0, kth, torch.full_like(kth, float("-inf")))
            x = x.masked_fill(x < kth, float("-inf"))
        if b.any_top_p:
            x = top_p_filter(x, b.top_p)
        return x

    def token_logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
        """The rows' log-probabilities, packed [S, 1 + 2k] for one copy to the host (logprobs.py)."""
        return token_logprobs(logits[:, :self.vocab], tokens, k)

    def count(self, tokens: torch.Tensor, b: SamplingBatch) -> None:
        """Add this step's tokens to the penalty counts of the rows that use penalties."""
        if b.any_penalty:
            self._counts().index_put_((b.rows, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)
