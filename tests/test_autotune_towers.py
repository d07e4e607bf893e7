"""The auto-tune drops a losing graph for every tower family, so "ours" is never the slower path.

vLLM's draft encoder graphs for MiniCPM-V turned a 24 ms benchmark into 469 ms unnoticed. Here every
budget graph is timed against eager at capture and dropped when it is not faster; dispatch then skips
it. Capture needs CUDA, so on the CPU the test stands in for the two things that do: a captured graph
(`EmulatedGraph`: replay runs the static-shape body on the static buffers into the tensors returned at
"capture", which is what a replay does) and the timer (scripted milliseconds per path and size, the
peer's regression among them). Everything else is the graph manager's own code on the tiny towers:
the synthetic tuning batches, the table, the drop, the dispatch and the outputs, which must equal our
eager path's (itself checked against each family's reference in its own test file).
"""

from __future__ import annotations

import pytest
import torch
from tower_harness import rel

from app.vision.graphs import GraphManager, GraphSettings, VisionItem

PRESETS = {"tiny": 64, "tiny-qwen2.5-vl": 128, "tiny-minicpm-v-4.5": 64}  # preset -> smallest budget B


class EmulatedGraph:
    """A captured graph's contract, on the CPU."""

    def __init__(self, tower, inp):
        self.tower, self.inp = tower, inp
        main, extra = tower(inp)
        self.out = (main.clone(), [e.clone() for e in extra])
        self.replays = 0

    def replay(self) -> None:
        main, extra = self.tower(self.inp)
        self.out[0].copy_(main)
        for a, b in zip(self.out[1], extra, strict=True):
            a.copy_(b)
        self.replays += 1


def emulate_capture(mgr: GraphManager) -> None:
    """What GraphManager.capture does before its auto-tune: one graph per budget on the static buffers."""
    mgr.capture_enabled = True
    for b in mgr.budgets:
        # A real capture only records kernels; running them here needs metadata valid for this budget.
        warm = mgr._synthetic_batch(b)
        mgr._fill(warm, mgr._layout(warm), b)
        g = EmulatedGraph(mgr.tower, mgr._static_inputs(b))
        mgr.graphs[b], mgr._graph_out[b] = g, g.out


def script_timer(mgr: GraphManager, ms) -> list[tuple]:
    """Replace the manager's timer: each timed call runs once for real and takes `ms(kind, tokens)`
    milliseconds, kind "graph" (tokens = its budget), "eager" (unequal lengths) or "eager_equal"."""
    calls = []
    run_eager, run_graph = mgr._run_eager, mgr._run_graph

    def eager(items, lay):
        calls.append(("eager_equal" if lay.uniform else "eager", lay.num_tokens))
        return run_eager(items, lay)

    def graph(items, lay, budget):
        calls.append(("graph", budget))
        return run_graph(items, lay, budget)

    def time_ms(fn, reps=10):
        fn()
        return ms(*calls[-1])

    mgr._run_eager, mgr._run_graph, mgr._time_ms = eager, graph, time_ms
    return calls


@pytest.fixture(scope="module", params=list(PRESETS))
def tower(request, model_cache):
    from app.checkpoints.model_builder import ensure_embedded
    from app.vision.loading import build_tower

    t = build_tower(ensure_embedded(request.param, model_cache), torch.float32)
    t.unit_budget = PRESETS[request.param]
    return t


def tuned_manager(tower, ms) -> tuple[GraphManager, list[tuple]]:
    b = tower.unit_budget
    mgr = GraphManager(tower, GraphSettings(budgets=[b, 2 * b, 4 * b], max_items_per_batch=8, max_frames_per_batch=8))
    emulate_capture(mgr)
    calls = script_timer(mgr, ms)
    mgr.autotune()
    return mgr, calls


def items_of(tower, tokens: list[int], seed: int) -> list[VisionItem]:
    g = torch.Generator().manual_seed(seed)
    return [VisionItem(torch.randn(n, tower.patch_dim, generator=g), tower.synthetic_grid(n)) for n in tokens]


def encode_and_check(mgr, items) -> None:
    with torch.inference_mode():
        ours = mgr.encode(items)
        eager = mgr.encode(items, force_eager=True)
    for a, b in zip(ours, eager, strict=True):
        assert rel(a.main, b.main) <= 1e-5


def test_a_losing_budget_graph_is_dropped_and_never_replayed(tower):
    """Graphs win at B and 4B; at 2B the graph takes 20x eager (the peer's 24 -> 469 ms). The 2B graph
    is dropped; a batch that 2B would hold replays the 4B graph, which still beats eager there."""
    b = tower.unit_budget

    def ms(kind, n):
        if kind == "graph":
            return 0.2 * n if n == 2 * b else 0.002 * n
        return 0.01 * n if kind == "eager" else 0.008 * n

    mgr, calls = tuned_manager(tower, ms)
    assert [(r["budget"], r["kept"]) for r in mgr.autotune_table] == [(b, True), (2 * b, False), (4 * b, True)]
    assert sorted(mgr.graphs) == [b, 4 * b]
    lose = next(r for r in mgr.autotune_table if r["budget"] == 2 * b)
    assert (lose["eager_ms"], lose["graph_ms"]) == (pytest.approx(0.02 * b), pytest.approx(0.4 * b))
    assert {c[0] for c in calls} >= {"graph", "eager"}  # both paths ran on the tower's synthetic batches
    assert 2 * b not in mgr._graph_out

    small = items_of(tower, [b // 2, b // 4], seed=1)  # unequal lengths within B
    mid = items_of(tower, [b, b // 4], seed=2)  # 1.25 B: the dropped 2B budget would hold it
    for items, budget in ((small, b), (mid, 4 * b)):
        replays = mgr.graphs[budget].replays
        assert mgr.choose_budget(mgr._layout(items)) == (budget, None)
        encode_and_check(mgr, items)
        assert mgr.graphs[budget].replays == replays + 1 and mgr.stats.per_budget[budget] == 1


def test_when_every_graph_loses_everything_runs_eagerly(tower):
    """Graphs 2x slower than eager at every budget: all dropped, every fitting batch goes eager."""
    b = tower.unit_budget

    def ms(kind, n):
        return 0.02 * n if kind == "graph" else 0.01 * n

    mgr, _ = tuned_manager(tower, ms)
    assert [r["kept"] for r in mgr.autotune_table] == [False] * 3 and not mgr.graphs
    items = items_of(tower, [b // 2, b // 4], seed=3)
    assert mgr.choose_budget(mgr._layout(items)) == (None, "no_graph")
    encode_and_check(mgr, items)
    assert mgr.stats.graph_hits == 0 and mgr.stats.eager_reasons["no_graph"] == 1


def test_a_kept_graph_loses_to_eager_on_a_small_batch(tower):
    """Only the 4B graph is kept (0.02 B ms; eager 0.01 ms a token, interpolated). A 1.75 B batch runs
    eagerly (0.0175 B, raised by the 10% margin, beats the padded graph); a 1.94 B batch replays it
    (0.0194 B x 1.1 does not)."""
    b = tower.unit_budget

    def ms(kind, n):
        if kind == "graph":
            return 1e9 if n < 4 * b else 0.02 * b
        return 0.01 * n if kind == "eager" else 0.008 * n

    mgr, _ = tuned_manager(tower, ms)
    assert sorted(mgr.graphs) == [4 * b] and mgr.settings.eager_margin == pytest.approx(0.1)
    eager_wins, graph_wins = items_of(tower, [b, 3 * b // 4], seed=4), items_of(tower, [b, 15 * b // 16], seed=5)
    assert mgr.choose_budget(mgr._layout(eager_wins)) == (None, "faster_eager")
    assert mgr.choose_budget(mgr._layout(graph_wins)) == (4 * b, None)
    for items in (eager_wins, graph_wins):
        encode_and_check(mgr, items)
    assert mgr.stats.eager_reasons["faster_eager"] == 1 and mgr.stats.per_budget[4 * b] == 1
