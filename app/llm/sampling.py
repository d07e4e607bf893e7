"""Token sampling and stop-string handling for one request."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    ignore_eos: bool = False  # benchmarks: always generate max_tokens


class Sampler:
    """Penalties, then greedy at temperature 0, else temperature, top-k and nucleus sampling from a
    per-request generator (so a seed reproduces the output whatever else shares the batch)."""

    def __init__(self, params: SamplingParams, device: torch.device):
        self.p = params
        self.gen = None
        if params.temperature > 0:
            self.gen = torch.Generator(device=device)
            if params.seed is not None:
                self.gen.manual_seed(params.seed)
            else:
                self.gen.seed()

    def __call__(self, logits: torch.Tensor, generated: list[int] | None = None) -> int:
        logits = logits.float()
        if generated and (self.p.frequency_penalty or self.p.presence_penalty):
            ids, counts = torch.tensor(generated, device=logits.device).unique(return_counts=True)
            logits = logits.clone()
            logits[ids] -= self.p.frequency_penalty * counts.float() + self.p.presence_penalty
        if self.gen is None:
            return int(logits.argmax(-1))
        logits = logits / self.p.temperature
        if 0 < self.p.top_k < logits.shape[-1]:
            kth = logits.topk(self.p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if self.p.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            keep = sorted_p.cumsum(-1) - sorted_p < self.p.top_p  # always keeps the most likely token
            sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
            return int(order[torch.multinomial(sorted_p, 1, generator=self.gen)])
        return int(torch.multinomial(probs, 1, generator=self.gen))


class StopChecker:
    """Finds stop strings in the decoded text and holds back text that may begin one."""

    def __init__(self, stop: list[str]):
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) - 1 for s in self.stop), default=0)

    def find(self, text: str) -> int | None:
        """Index where the earliest stop string starts, or None."""
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def safe_length(self, text: str) -> int:
        """How much of `text` can be emitted without risking a stop string's prefix."""
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            text = text[:-1]
        n = len(text)
        for k in range(min(self.hold, n), 0, -1):
            if any(s.startswith(text[n - k:]) for s in self.stop):
                return n - k
        return n
