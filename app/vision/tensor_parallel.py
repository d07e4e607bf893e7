"""The vision tower inside a tensor-parallel LLM replica: three ways to give every rank the embeddings.

Every rank of a TP group needs every item's embeddings (and deepstack features) for its share of the
LLM. (a) rank 0 encodes everything and broadcasts the outputs (`broadcast_outputs`); (b) the items are
split over the ranks by token count, each encodes its share, and the outputs are gathered in item order
(`balanced_shares`, `gather_outputs`); (c) every rank holds 1/N of each block's heads and MLP units,
Megatron-style as app/llm/parallel.py splits the LLM, with two all-reduces per block
(`ShardedVisionTower`, `shard_tower`). Which wins depends on the batch and the GPUs
(benchmarks/tower_tp.py measures it). Qwen3-VL towers only; the receiving ranks need no tower for (a)
and (b), only the outputs' shape (`OutputSpec`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..llm.parallel import TensorParallel
from .graphs import VisionEmbedding
from .kernels import rotary_qk
from .tower import VisionTower
from .tower_api import TowerBatch


# ---------------------------------------------------------------------------- (c) the sharded tower
def _replace(lin: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Give `lin` its share: fresh tensors (copies), so that the whole ones can be freed."""
    lin.weight = nn.Parameter(weight.clone(memory_format=torch.contiguous_format), requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias.clone(memory_format=torch.contiguous_format), requires_grad=False)
    lin.out_features, lin.in_features = lin.weight.shape


def shard_blocks(visual: nn.Module, tp: TensorParallel) -> None:
    """Slice a Qwen3-VL vision module's blocks (qwen3_params.py's names) in place to this rank's share: qkv by output
    rows (heads), the attention output projection by input columns, fc1 by rows and fc2 by columns (MLP
    units). The biases of the column-split projections stay whole: they are added once, after the
    all-reduce. Patch embedding, position table, merger and deepstack mergers stay replicated. The
    module's own forward is then no longer valid; `ShardedVisionTower` runs it."""
    cfg = visual.config
    heads, hidden, width = cfg.num_heads, cfg.hidden_size, cfg.intermediate_size
    if getattr(visual, "tp_shard", None) is not None:
        raise ValueError(f"the vision tower is already sharded ({visual.tp_shard})")
    if heads % tp.size:
        raise ValueError(f"the vision tower's {heads} attention heads do not split evenly over {tp.size} "
                         "tensor-parallel ranks")
    if width % tp.size:
        raise ValueError(f"the vision tower's MLP width {width} does not split evenly over {tp.size} "
                         "tensor-parallel ranks")
    h0, h1 = tp.part(heads, "vision attention heads")
    u0, u1 = tp.part(width, "vision MLP units")
    d = hidden // heads
    with torch.no_grad():
        for blk in visual.blocks:
            qkv, proj = blk.attn.qkv, blk.attn.proj
            # qkv rows are (q, k, v) x heads x head_dim: this rank's heads of each of the three
            _replace(qkv, qkv.weight.reshape(3, heads, d, hidden)[:, h0:h1].reshape(-1, hidden),
                     qkv.bias.reshape(3, heads, d)[:, h0:h1].reshape(-1))
            _replace(proj, proj.weight[:, h0 * d:h1 * d], None)
            fc1, fc2 = blk.mlp.linear_fc1, blk.mlp.linear_fc2
            _replace(fc1, fc1.weight[u0:u1], fc1.bias[u0:u1])
            _replace(fc2, fc2.weight[:, u0:u1], None)
    visual.tp_shard = (tp.rank, tp.size)


class ShardedVisionTower(VisionTower):
    """`VisionTower` over this rank's share of the blocks (`shard_blocks`, done here): each block's
    attention and MLP end in a partial product that one all-reduce completes (`_reduce`, which the fused
    body calls too), then the whole bias is added. Every rank takes the same rows and metadata and ends
    with the whole output. Eager only: the graph manager's capture and auto-tune run per rank and could
    disagree on a path (a collective then waits forever)."""

    def __init__(self, visual: nn.Module, tp: TensorParallel, pixel_norm: tuple | None = None,
                 fused: bool | None = None):
        shard_blocks(visual, tp)  # before VisionTower pads the (now local) MLP widths for the fused body
        super().__init__(visual, pixel_norm, fused)
        self.tp = tp
        self.local_heads = self.heads // tp.size
        self.local_width = self.local_heads * self.head_dim

    def _reduce(self, y: torch.Tensor) -> torch.Tensor:
        """The fused body's partial products (this rank's columns), summed over the ranks; its fused
        residual add then adds the whole bias once."""
        return self.tp.all_reduce(y)

    def _row_parallel(self, x: torch.Tensor, lin: nn.Linear) -> torch.Tensor:
        """x @ W.T over this rank's columns, summed over the ranks, plus the bias once."""
        y = self._reduce(F.linear(x, lin.weight))
        return y if lin.bias is None else y + lin.bias

    def _block(self, blk, x, cos, sin, inp: TowerBatch):
        n = x.shape[0]
        qkv = blk.attn.qkv(blk.norm1(x))
        q, k = rotary_qk(qkv, cos, sin, self.local_heads)
        v = qkv.view(n, 3, self.local_heads, self.head_dim)[:, 2]
        x = x + self._row_parallel(self._attention(q, k, v, inp).reshape(n, self.local_width), blk.attn.proj)
        mlp = blk.mlp
        return x + self._row_parallel(mlp.act_fn(mlp.linear_fc1(blk.norm2(x))), mlp.linear_fc2)


def shard_tower(tower: VisionTower, tp: TensorParallel) -> ShardedVisionTower:
    """This rank's TP shard of a loaded Qwen3-VL tower, on the same modules (sliced in place: `tower`
    must not be used afterwards), with its pixel normalisation, body and dense-attention choice."""
    if type(tower) is not VisionTower:
        raise TypeError(f"only Qwen3-VL's VisionTower can be sharded, not {type(tower).__name__}")
    sharded = ShardedVisionTower(tower.visual, tp, tower._pixel_norm, tower.fused)
    sharded.flash4 = tower.flash4
    return sharded


# ---------------------------------------------------------------------------- (a) and (b): moving outputs
@dataclass(frozen=True)
class OutputSpec:
    """What a rank must know to receive a tower's outputs without holding the tower."""

    width: int  # columns of the main embeddings and of each deepstack feature
    layers: int  # deepstack features per row
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, tower) -> OutputSpec:
        return cls(tower.out_dim, tower.num_deepstack, tower.dtype, tower.device)


def _pack(out: list[VisionEmbedding], spec: OutputSpec, rows: int | None = None) -> torch.Tensor:
    """[1 + layers, rows, width]: every item's main rows then each deepstack feature's, item after item;
    padded (uninitialised) up to `rows`."""
    n = sum(o.main.shape[0] for o in out)
    buf = torch.empty(1 + spec.layers, n if rows is None else rows, spec.width, dtype=spec.dtype, device=spec.device)
    off = 0
    for o in out:
        k = o.main.shape[0]
        buf[0, off:off + k] = o.main
        for j, d in enumerate(o.deepstack):
            buf[1 + j, off:off + k] = d
        off += k
    return buf


def _unpack(buf: torch.Tensor, out_rows: list[int]) -> list[VisionEmbedding]:
    items, off = [], 0
    for k in out_rows:
        piece = buf[:, off:off + k]
        items.append(VisionEmbedding(piece[0], list(piece[1:].unbind(0))))
        off += k
    return items


def _global_rank(tp: TensorParallel, group_rank: int) -> int:
    if tp.group is None:
        return group_rank
    import torch.distributed as dist

    return dist.get_global_rank(tp.group, group_rank)


def broadcast_outputs(out: list[VisionEmbedding] | None, out_rows: list[int], spec: OutputSpec,
                      tp: TensorParallel, src: int = 0) -> list[VisionEmbedding]:
    """(a): rank `src` (of the group) holds every item's outputs (`out`), the others None; every rank
    returns them all, in item order (`out_rows`: each item's rows). One broadcast of the packed rows."""
    if tp.rank == src:
        if tp.size == 1:
            return out
        buf = _pack(out, spec)
    else:
        buf = torch.empty(1 + spec.layers, sum(out_rows), spec.width, dtype=spec.dtype, device=spec.device)
    if tp.size > 1:
        import torch.distributed as dist

        dist.broadcast(buf, src=_global_rank(tp, src), group=tp.group)
    return _unpack(buf, out_rows)


def balanced_shares(tokens: list[int], size: int) -> list[list[int]]:
    """(b): item indices per rank, balanced by patch tokens (largest item first to the least loaded rank,
    ties to the lower rank: a single item goes to rank 0); each share in item order. Every rank computes
    the same shares from the grids alone."""
    shares: list[list[int]] = [[] for _ in range(size)]
    load = [0] * size
    for i in sorted(range(len(tokens)), key=lambda i: (-tokens[i], i)):
        r = min(range(size), key=lambda r: (load[r], r))
        shares[r].append(i)
        load[r] += tokens[i]
    return [sorted(s) for s in shares]


def gather_outputs(mine: list[VisionEmbedding], shares: list[list[int]], out_rows: list[int], spec: OutputSpec,
                   tp: TensorParallel) -> list[VisionEmbedding]:
    """(b): this rank's outputs (`mine`, for the items of `shares[tp.rank]` in that order) -> every item's
    outputs in item order, on every rank. Shares differ in size: each is padded to the largest, one
    all_gather, then each item's rows are cut back out (views of the gathered tensor)."""
    share_rows = [sum(out_rows[i] for i in s) for s in shares]
    if len(mine) != len(shares[tp.rank]) or sum(o.main.shape[0] for o in mine) != share_rows[tp.rank]:
        raise ValueError("this rank's outputs do not match its share of the items")
    if tp.size == 1:
        return list(mine)
    import torch.distributed as dist

    most = max(share_rows)
    buf = _pack(mine, spec, most)
    gathered = torch.empty(tp.size * (1 + spec.layers), most, spec.width, dtype=spec.dtype, device=spec.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    gather(gathered, buf, group=tp.group)
    gathered = gathered.view(tp.size, 1 + spec.layers, most, spec.width)
    out: list[VisionEmbedding | None] = [None] * len(out_rows)
    for r, share in enumerate(shares):
        for i, emb in zip(share, _unpack(gathered[r], [out_rows[i] for i in share])):
            out[i] = emb
    return out  # type: ignore[return-value]


def data_parallel_encode(encode, mine: list, shares: list[list[int]], out_rows: list[int], spec: OutputSpec,
                         tp: TensorParallel) -> list[VisionEmbedding]:
    """(b) whole: `encode(items) -> list[VisionEmbedding]` (a graph manager's `encode`) over this rank's
    items (`mine`: the items of `shares[tp.rank]`, in order, their rows already here), then
    `gather_outputs`."""
    return gather_outputs(encode(mine) if mine else [], shares, out_rows, spec, tp)
