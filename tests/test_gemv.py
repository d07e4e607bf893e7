"""The one- and two-row projections (app/llm/gemv.py): the table's choice and dispatch on the CPU, the
Triton kernel against F.linear and the engine with it on CUDA."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
import torch.nn.functional as F

from app.llm import gemv as G

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or G.triton is None, reason="needs CUDA and Triton")


def _table_from(times: dict) -> G.GemvTable:
    """A table tuned by a fake timer: `times` maps "cublas" or a tile to microseconds per call (the timer
    returns them in the order tune asks: cuBLAS first, then every tile)."""
    order = ["cublas", *G.TILES]
    calls = itertools.cycle(order)
    table = G.GemvTable()
    weights = {(6, 4): [torch.zeros(6, 4), torch.zeros(6, 4)]}
    table.tune(weights, lambda fn: 2 * times[next(calls)], rows=(1, 2))  # two weights: per call = half
    return table


def test_tune_keeps_the_fastest_tile_only_where_it_beats_cublas():
    fast = {"cublas": 10.0, **{t: 12.0 for t in G.TILES}, G.TILES[2]: 7.0}
    table = _table_from(fast)
    for rows in (1, 2):
        c = table.choices[(rows, 6, 4)]
        assert (c.cublas_us, c.kernel_us, c.tile, c.used) == (10.0, 7.0, G.TILES[2], True)
    # within MIN_GAIN of cuBLAS is not enough: cuBLAS stays
    close = {"cublas": 10.0, **{t: 9.6 for t in G.TILES}}
    assert not any(c.used for c in _table_from(close).choices.values())
    assert [d["used"] for d in table.as_dict()] == [True, True]


def test_linear_dispatches_by_rows_and_shape(monkeypatch):
    table = _table_from({"cublas": 10.0, **{t: 5.0 for t in G.TILES}})
    seen = []
    monkeypatch.setattr(G, "gemv", lambda x, w, b, tile: seen.append((x.shape[0], tuple(w.shape), tile)) or F.linear(x, w, b))
    w = torch.randn(6, 4)
    for rows in (1, 2, 3):
        x = torch.randn(rows, 4)
        assert torch.equal(table.linear(x, w), F.linear(x, w))
    other = torch.randn(5, 4)  # a shape the table never timed
    table.linear(torch.randn(1, 4), other)
    # a view whose rows are not contiguous goes to F.linear too (the kernel reads x rows as contiguous)
    table.linear(torch.randn(4, 2).t()[:1], w)
    assert seen == [(1, (6, 4), G.TILES[0]), (2, (6, 4), G.TILES[0])]


def test_a_tile_that_disagrees_with_f_linear_now_and_then_is_not_used(monkeypatch):
    """The check after timing: a kernel whose sum comes out wrong once in a while (a race) is caught by the
    repeats, and its shape stays on cuBLAS however fast it was."""
    x, ws = torch.randn(1, 64), [torch.randn(32, 64) for _ in range(4)]
    monkeypatch.setattr(G, "gemv", lambda x, w, b, tile: F.linear(x, w, b))
    assert G.agrees_with_f_linear(x, ws, G.TILES[0])
    calls = itertools.count()
    monkeypatch.setattr(G, "gemv", lambda x, w, b, tile: F.linear(x, w, b) * (1.5 if next(calls) == 13 else 1.0))
    assert not G.agrees_with_f_linear(x, ws, G.TILES[0])
    assert not G.GemvChoice(1, 32, 64, cublas_us=10.0, kernel_us=1.0, tile=G.TILES[0], agrees=False).used


def test_an_empty_table_is_f_linear():
    x, w, b = torch.randn(1, 8), torch.randn(3, 8), torch.randn(3)
    assert torch.equal(G.GemvTable().linear(x, w, b), F.linear(x, w, b))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("n,k,bias", [(2048, 4096, False), (5120, 2048, False), (128, 2048, False),
                                      (1000, 1000, True), (37, 300, True)])
def test_gemv_equals_f_linear(rows, n, k, bias):
    g = torch.Generator(device="cuda").manual_seed(n + k + rows)
    x = torch.randn(rows, k, device="cuda", generator=g)
    w = torch.randn(n, k, device="cuda", generator=g) * k ** -0.5
    b = torch.randn(n, device="cuda", generator=g) if bias else None
    exact = F.linear(x.double(), w.double(), b.double() if b is not None else None)
    for tile in G.TILES + G.SPLIT_TILES:
        # float32: one rounding of a float32 sum, as F.linear (TF32 off), within summation order
        got = G.gemv(x, w, b, tile)
        assert (got.double() - exact).abs().max().item() < 1e-4, tile
        # bf16: no further from the exact product than cuBLAS's bf16 F.linear, give or take one ulp
        xb, wb = x.bfloat16(), w.bfloat16()
        bb = b.bfloat16() if b is not None else None
        exact_b = F.linear(xb.double(), wb.double(), bb.double() if bb is not None else None)
        mine = (G.gemv(xb, wb, bb, tile).double() - exact_b).abs().max().item()
        cublas = (F.linear(xb, wb, bb).double() - exact_b).abs().max().item()
        assert mine <= 1.5 * cublas + 1e-2, (tile, mine, cublas)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tile", [G.TILES[0], *G.SPLIT_TILES])
def test_gemv_replays_in_a_cuda_graph(tile):
    """Unsplit and split-K tiles: a replay follows new inputs, and a split tile's counters are back at zero
    after every call (the next replay's last program depends on it); the split parts sum in a fixed order,
    so replays give the same bits as eager calls."""
    x = torch.randn(2, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)
    eager = G.gemv(x, w, None, tile)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        G.gemv(x, w, None, tile)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = G.gemv(x, w, None, tile)
    for _ in range(3):
        x2 = torch.randn_like(x)
        x.copy_(x2)
        graph.replay()
        torch.cuda.synchronize()
        assert not torch.equal(out, eager)
        assert torch.equal(out, G.gemv(x2, w, None, tile))
    assert all(int(counts.abs().sum()) == 0 for _, counts in G._SCRATCH.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or G.triton is None or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a Hopper GPU (PDL)")
@pytest.mark.parametrize("tile", [G.TILES[0], G.TILES[2], *G.SPLIT_TILES])
def test_the_weight_prefetch_sees_the_kernel_before_it_write_x(tile, monkeypatch):
    """Under PDL each program loads its first weight tile before it waits on the kernel before it. In a
    graph, as decode replays it, behind an add+RMSNorm that writes x just before: the product is that of
    the new x on every replay, and the same bits as with the load after the wait (the sums are the same)."""
    from app.llm import pdl
    from app.llm.kernels import add_rmsnorm

    g = torch.Generator(device="cuda").manual_seed(7)
    k = 2048
    w = (torch.randn(4096, k, device="cuda", generator=g) * k ** -0.5).bfloat16()
    norm = torch.rand(k, device="cuda", generator=g).bfloat16() + 0.5
    inputs = [(torch.randn(2, k, device="cuda", generator=g).bfloat16(),
               torch.randn(2, k, device="cuda", generator=g).bfloat16()) for _ in range(4)]
    got = {}
    try:
        assert pdl.enable(True, torch.device("cuda"))
        for prefetch in (True, False):
            monkeypatch.setattr(G, "PREFETCH", prefetch)
            residual, delta = torch.zeros(2, k, device="cuda", dtype=torch.bfloat16), torch.zeros_like(inputs[0][0])

            def step(residual=residual, delta=delta):  # the sum is written into `residual` in place
                _, h = add_rmsnorm(residual, delta, norm, 1e-6)
                return h, G.gemv(h, w, None, tile)

            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                h, out = step()
            got[prefetch] = []
            for r, d in inputs:
                residual.copy_(r)
                delta.copy_(d)
                graph.replay()
                torch.cuda.synchronize()
                want_h = add_rmsnorm(r.clone(), d, norm, 1e-6)[1]
                assert torch.equal(h, want_h)
                want = F.linear(want_h.double(), w.double())
                assert (out.double() - want).abs().max().item() <= 1.5 * (F.linear(want_h, w).double() - want
                                                                          ).abs().max().item() + 1e-2
                got[prefetch].append(out.clone())
    finally:
        pdl.enable(False)
    assert all(torch.equal(a, b) for a, b in zip(got[True], got[False]))


@pytest.mark.gpu
@needs_cuda
def test_engine_tunes_its_projections_and_answers_as_with_cublas(tmp_path):
    """A tiny MoE engine in float32 on CUDA: the start-up times every projection shape, and greedy
    answers (decode graphs on) equal those of the same engine with cuBLAS throughout."""
    from app.checkpoints.model_builder import resolve_model
    from app.llm.engine import Engine
    from app.llm.sampling import SamplingParams
    from app.llm.sequence import GenerationRequest

    path = str(resolve_model("embedded:tiny-qwen3-vl-moe", str(tmp_path)))
    answers = {}
    for on in (True, False):
        engine = Engine(path, "cuda", dtype="float32", decode_gemv=on, max_num_seqs=4)
        try:
            if on:
                shapes = {(d["n"], d["k"]) for d in engine.stats()["gemv"]}
                assert shapes == set(engine.model.projection_weights())
                assert any(name == "matrix-vector choice" for name, _, _ in engine.startup)
            reqs = [GenerationRequest(list(range(3 + i, 40 + i)), [0] * 37, [],
                                      SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)) for i in range(2)]
            answers[on] = [[t for c in engine.generate(r) for t in c.token_ids] for r in reqs]
            assert engine.graph_steps > 0
        finally:
            engine.shutdown()
    assert answers[True] == answers[False]


@pytest.mark.skipif(G.triton is None or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="Triton's interpreter (docs/guides/benchmarks.md, 'Triton kernels on the CPU')")
@pytest.mark.parametrize("rows", [1, 2])
def test_gemv_under_the_triton_interpreter(rows):
    """Every tile on CPU tensors against float64, uneven K and a bias included, each twice: a split tile's
    counters are back at zero after a call (the next call's last program depends on it)."""
    g = torch.Generator().manual_seed(rows)
    for n, k, bias in ((40, 512, False), (33, 300, True), (20, 2048, True)):
        x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
        b = torch.randn(n, generator=g) if bias else None
        exact = F.linear(x.double(), w.double(), b.double() if b is not None else None)
        for tile in G.TILES + G.SPLIT_TILES:
            for _ in range(2):
                assert (G.gemv(x, w, b, tile).double() - exact).abs().max().item() < 1e-3, tile
    assert all(int(counts.abs().sum()) == 0 for _, counts in G._SCRATCH.values())


def test_a_kept_choice_is_applied_whole_or_not_at_all(tmp_path):
    """The choice one replica timed, through its file (tune_cache.TuneCache), is what the next applies:
    every (rows, N, K) asked for, tiles and agreement included. A file that misses one, names a tile not
    among the candidates, or is damaged changes nothing, and the replica times for itself."""
    from app.gpu.tune_cache import TuneCache

    timed = _table_from({"cublas": 10.0, **{t: 12.0 for t in G.TILES}, G.TILES[1]: 4.0})
    timed.choices[(2, 6, 4)].agrees = False
    cache = TuneCache(tmp_path, {"gpu": "test"}, "matrix-vector choice")
    cache.save(timed.file_rows())
    keys = {(1, 6, 4), (2, 6, 4)}
    applied = G.GemvTable()
    assert applied.apply(cache.load(), keys) and applied.choices == timed.choices  # times exact, not rounded
    in_order = G.GemvTable()  # in the order timed, whatever the order asked for: the stats read the same
    assert in_order.apply(cache.load(), sorted(keys, reverse=True)) and list(in_order.choices) == list(timed.choices)
    assert [c.used for c in applied.choices.values()] == [True, False]  # the second's disagreement kept
    edge = _table_from({"cublas": 10.0, **{t: 12.0 for t in G.TILES}, G.TILES[1]: 9.5001})  # just above MIN_GAIN
    again = G.GemvTable()
    assert again.apply(edge.file_rows(), keys) and not any(c.used for c in again.choices.values())
    rounded = G.GemvTable()  # what a file of as_dict's rounded times (9.5) would have made of it
    assert rounded.apply(edge.as_dict(), keys) and all(c.used for c in rounded.choices.values())
    for table, ks, tiles in (
            (timed.file_rows(), keys | {(1, 8, 4)}, G.TILES),  # a shape the file has not
            (timed.file_rows(), keys, G.TILES[:1]),  # its tile is not a candidate here
            ([{**r, "tile": "big"} for r in timed.file_rows()], keys, G.TILES),
            ([{k: v for k, v in r.items() if k != "agrees"} for r in timed.file_rows()], keys, G.TILES),
            ([None], keys, G.TILES)):
        fresh = G.GemvTable()
        assert not fresh.apply(table, ks, tiles) and fresh.choices == {}


@pytest.mark.gpu
@needs_cuda
def test_a_second_engine_applies_the_first_ones_kept_choice_and_answers_the_same(tmp_path, monkeypatch):
    """`tune_dir`: the first engine times and keeps its choice; the second, on the same GPU model and code,
    times nothing (its timing would raise), compiles what it applies before its graphs, and answers the
    same greedy tokens."""
    from app.checkpoints.model_builder import resolve_model
    from app.llm.engine import Engine
    from app.llm.sampling import SamplingParams
    from app.llm.sequence import GenerationRequest

    path = str(resolve_model("embedded:tiny-qwen3-vl-moe", str(tmp_path)))
    tune, tables, answers = tmp_path / "gemv-tune", [], []
    for i in range(2):
        if i:
            monkeypatch.setattr(G, "_time_gemv", lambda *a: pytest.fail("timed again"))
        engine = Engine(path, "cuda", dtype="float32", max_num_seqs=4, tune_dir=str(tune))
        try:
            tables.append(engine.stats()["gemv"])
            reqs = [GenerationRequest(list(range(3 + j, 40 + j)), [0] * 37, [],
                                      SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)) for j in range(2)]
            answers.append([[t for c in engine.generate(r) for t in c.token_ids] for r in reqs])
            assert engine.graph_steps > 0
        finally:
            engine.shutdown()
    assert len(list(tune.glob("*.json"))) == 1 and tables[0] == tables[1] and tables[0]
    assert answers[0] == answers[1]
