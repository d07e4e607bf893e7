"""Log-probabilities of a step's rows: the chosen token's and the k most likely tokens', packed for one
copy to the host.

They come from the raw logits (log-softmax, before penalties, temperature, top-k and top-p), as vLLM
returns them by default: they describe the model, whatever the sampling settings. PyTorch's
`logsumexp` and `topk` run one block per row over the whole vocabulary, too slow for a decode step
(benchmarks/results/2026-11-25-logprobs-cost.md), so on CUDA two Triton kernels do it: one program per
(row, chunk of 4096 logits) finds the chunk's max, its sum of exp(x - max) and its k largest logits
with their ids (k passes of max-and-remove, in registers); one per row then takes the logsumexp from
the chunks' (max, sum), the top k of their candidates and the chosen token's logit, each minus the
logsumexp. k is a runtime loop bound: one compiled kernel serves every `top_logprobs`.
"""

from __future__ import annotations

import torch

from .sampling import MAX_LOGPROBS

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

CHUNK = 4096  # logits per first-stage program
# per chunk, room for the most a request may ask for, rounded up to a power of two: the first stage's
# output width (32 for MAX_LOGPROBS = 20)
CANDIDATES = 1 << (MAX_LOGPROBS - 1).bit_length()


def token_logprobs_torch(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """[S, 1 + 2k] float32: (the chosen token's log-probability, the k largest in descending order,
    their ids as float32, exact below 2^24)."""
    lse = torch.logsumexp(logits.float(), dim=-1, keepdim=True)
    chosen = logits.gather(1, tokens[:, None]).float() - lse
    top_vals, top_ids = logits.topk(min(k, logits.shape[1]), dim=-1)
    return torch.cat([chosen, top_vals.float() - lse, top_ids.float()], dim=1)


if triton is not None:

    @triton.jit
    def _chunk_stats(x_ptr, stride_x, vocab, k, max_ptr, sum_ptr, cand_v_ptr, cand_i_ptr, n_chunks,
                     CHUNK: tl.constexpr, CAND: tl.constexpr):
        row = tl.program_id(0)
        c = tl.program_id(1)
        offs = c * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(x_ptr + row * stride_x + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        m = tl.max(x, axis=0)
        s = tl.sum(tl.exp(x - m), axis=0)
        out = row * n_chunks + c
        tl.store(max_ptr + out, m)
        tl.store(sum_ptr + out, s)
        for j in range(k):  # the chunk's k largest, in descending order
            v = tl.max(x, axis=0)
            i = tl.argmax(x, axis=0)
            tl.store(cand_v_ptr + out * CAND + j, v)
            tl.store(cand_i_ptr + out * CAND + j, c * CHUNK + i)
            x = tl.where(tl.arange(0, CHUNK) == i, float("-inf"), x)

    @triton.jit
    def _merge_rows(x_ptr, stride_x, tokens_ptr, k, max_ptr, sum_ptr, cand_v_ptr, cand_i_ptr, out_ptr, n_chunks,
                    CAND: tl.constexpr, CHUNKS: tl.constexpr, SLOTS: tl.constexpr):
        row = tl.program_id(0)
        ch = tl.arange(0, CHUNKS)
        cm = ch < n_chunks
        maxes = tl.load(max_ptr + row * n_chunks + ch, mask=cm, other=float("-inf"))
        sums = tl.load(sum_ptr + row * n_chunks + ch, mask=cm, other=0.0)
        m = tl.max(maxes, axis=0)
        lse = m + tl.log(tl.sum(sums * tl.exp(maxes - m), axis=0))
        tok = tl.load(tokens_ptr + row)
        width = 1 + 2 * k
        chosen = tl.load(x_ptr + row * stride_x + tok).to(tl.float32)
        tl.store(out_ptr + row * width, chosen - lse)
        slot = tl.arange(0, SLOTS)  # candidate (chunk, j) = slot; those with j >= k were never written
        sm = (slot < n_chunks * CAND) & (slot % CAND < k)
        vals = tl.load(cand_v_ptr + row * n_chunks * CAND + slot, mask=sm, other=float("-inf"))
        for j in range(k):
            v = tl.max(vals, axis=0)
            at = tl.argmax(vals, axis=0)
            i = tl.load(cand_i_ptr + row * n_chunks * CAND + at)
            tl.store(out_ptr + row * width + 1 + j, v - lse)
            tl.store(out_ptr + row * width + 1 + k + j, i.to(tl.float32))
            vals = tl.where(slot == at, float("-inf"), vals)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """`token_logprobs_torch`'s result; on CUDA from the two kernels above (ties among equal logits
    may come out in another order)."""
    if triton is None or not logits.is_cuda or k > CANDIDATES:
        return token_logprobs_torch(logits, tokens, k)
    rows, vocab = logits.shape
    k = min(k, vocab)
    n_chunks = triton.cdiv(vocab, CHUNK)
    dev = logits.device
    maxes = torch.empty(rows, n_chunks, dtype=torch.float32, device=dev)
    sums = torch.empty_like(maxes)
    cand_v = torch.empty(rows, n_chunks, CANDIDATES, dtype=torch.float32, device=dev)
    cand_i = torch.empty(rows, n_chunks, CANDIDATES, dtype=torch.int32, device=dev)
    out = torch.empty(rows, 1 + 2 * k, dtype=torch.float32, device=dev)
    _chunk_stats[(rows, n_chunks)](logits, logits.stride(0), vocab, k, maxes, sums, cand_v, cand_i, n_chunks,
                                   CHUNK=CHUNK, CAND=CANDIDATES, num_warps=8)
    _merge_rows[(rows,)](logits, logits.stride(0), tokens, k, maxes, sums, cand_v, cand_i, out, n_chunks,
                         CAND=CANDIDATES, CHUNKS=triton.next_power_of_2(n_chunks),
                         SLOTS=triton.next_power_of_2(n_chunks * CANDIDATES), num_warps=4)
    return out
