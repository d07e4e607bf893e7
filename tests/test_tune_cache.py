"""The vision auto-tune's table on disk (app/gpu/tune_cache.py): a replica that starts where one already
tuned applies that table instead of timing, and replicas starting together let the first one tune.

On the CPU with the tiny tower, a captured graph and the timer stand in as in test_autotune_towers.py;
everything else is the graph manager's own code."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from test_autotune_towers import emulate_capture, script_timer

from app.gpu.tune_cache import TOWER_CODE, TuneCache, source_digest
from app.vision.graphs import GraphManager, GraphSettings

B = 64  # the tiny tower's smallest budget


@pytest.fixture(scope="module")
def tower(model_cache):
    from app.checkpoints.model_builder import ensure_embedded
    from app.vision.loading import build_tower

    return build_tower(ensure_embedded("tiny", model_cache), torch.float32)


def ms(kind: str, tokens: int) -> float:
    """Graphs win at B and 4B and lose at 2B."""
    if kind == "graph":
        return 20.0 if tokens == 2 * B else 1.0
    return 2.0 + tokens / 1000


def tuned(tower, cache: TuneCache, budgets=(B, 2 * B, 4 * B)) -> tuple[GraphManager, list]:
    mgr = GraphManager(tower, GraphSettings(budgets=list(budgets), max_items_per_batch=8, max_frames_per_batch=8,
                                            tune_cache=cache))
    emulate_capture(mgr)
    calls = script_timer(mgr, ms)
    mgr.autotune()
    return mgr, calls


def test_a_replica_applies_the_table_another_measured_and_times_nothing(tower, tmp_path):
    parts = {"gpu": "test", "code": source_digest(TOWER_CODE)}
    first, timed = tuned(tower, TuneCache(tmp_path, parts))
    assert timed and set(first.graphs) == {B, 4 * B}  # measured: the 2B graph lost and was dropped
    second, timed_again = tuned(tower, TuneCache(tmp_path, dict(parts)))
    assert timed_again == []  # nothing timed: the first one's table
    assert set(second.graphs) == set(first.graphs) and second.autotune_table == first.autotune_table
    assert second._tuned == {b: tuple(round(x, 3) for x in t) for b, t in first._tuned.items()}  # to the µs
    for tokens in ([40], [100], [32, 32], [200], [120]):  # the same choices as the replica that measured
        lay = tower.layout([tower.synthetic_grid(n) for n in tokens])
        assert second.choose_budget(lay) == first.choose_budget(lay)
    other, timed_other = tuned(tower, TuneCache(tmp_path, {**parts, "gpu": "another"}))
    assert timed_other  # another GPU model (or settings, or code): measured again


def test_a_table_for_other_graphs_is_not_applied(tower, tmp_path):
    cache = TuneCache(tmp_path, {"gpu": "test"})
    tuned(tower, cache, budgets=(B, 2 * B))
    cache.save([{"budget": B, "eager_ms": 1, "eager_equal_ms": 1, "graph_ms": 9, "kept": False}])
    mgr, timed = tuned(tower, cache)  # three budgets captured, the table has one: measure
    assert timed and set(mgr.graphs) == {B, 4 * B} and len(cache.load()) == 3


def test_replicas_starting_together_wait_for_the_first_ones_table(tmp_path):
    parts = {"gpu": "test"}
    got, order = {}, []

    def first():
        with TuneCache(tmp_path, parts).claim() as held:
            order.append(("first", held))
            time.sleep(0.4)  # measuring
            TuneCache(tmp_path, parts).save([{"budget": B, "kept": True}])

    def second():
        time.sleep(0.1)
        t = time.monotonic()
        with TuneCache(tmp_path, parts).claim() as held:
            got["waited"], got["held"] = time.monotonic() - t, held
            got["table"] = TuneCache(tmp_path, parts).load()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(10)
    assert order == [("first", True)] and got["held"] and got["waited"] >= 0.25
    assert got["table"] == [{"budget": B, "kept": True}]
    with TuneCache(tmp_path, parts).claim() as held:  # a holder that never lets go: tune without the lock
        with TuneCache(tmp_path, parts).claim(wait_s=0.3) as other:
            assert held and other is False


def test_an_unreadable_or_foreign_file_is_no_table(tmp_path):
    cache = TuneCache(tmp_path, {"gpu": "test"})
    assert cache.load() is None
    cache.folder.mkdir(parents=True, exist_ok=True)
    cache.path.write_text("{half")
    assert cache.load() is None
    cache.path.write_text('{"parts": {"gpu": "other"}, "table": []}')  # a key collision: not ours
    assert cache.load() is None


def test_the_key_follows_the_gpu_the_checkpoint_the_settings_and_the_code(tower, tiny_checkpoint, tmp_path,
                                                                          monkeypatch):
    """EncoderService's key (`tune_cache_for`, on CUDA only; the GPU's name stood in here): the same
    inputs give the same table file under cache_dir, any of them changed another."""
    from app.config import AppConfig
    from app.vision import service

    cfg = AppConfig(model=str(tiny_checkpoint), cache_dir=str(tmp_path))
    settings = GraphSettings(budgets=[B, 2 * B], max_items_per_batch=8, max_frames_per_batch=8, uint8_pixels=True)
    name = {"gpu": "NVIDIA H100 80GB HBM3"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name["gpu"])

    def key(**change):
        s = GraphSettings(**{**settings.__dict__, **change})
        return service.tune_cache_for(cfg, str(tiny_checkpoint), "cuda", torch.bfloat16, s, tower)

    a = key()
    assert a.path.parent == tmp_path / "vision-tune" and key().key == a.key
    assert a.parts["code"] == source_digest(TOWER_CODE) and a.parts["tower"] == type(tower).__name__
    assert key(budgets=[B]).key != a.key and key(max_items_per_batch=4).key != a.key
    assert service.tune_cache_for(cfg, str(tiny_checkpoint), "cuda", torch.float16, settings, tower).key != a.key
    name["gpu"] = "NVIDIA H200"
    assert key().key != a.key


def test_a_folder_that_cannot_be_written_costs_a_tuning_not_a_start(tower, tmp_path):
    """A read-only or full cache folder (here: a file where the folder should be) once raised out of the
    tower's start-up; now the replica measures and starts, and nothing is kept."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    cache = TuneCache(blocker / "vision-tune", {"gpu": "test"})
    with cache.claim() as held:
        assert held is False
    mgr, timed = tuned(tower, cache)
    assert timed and set(mgr.graphs) == {B, 4 * B} and cache.load() is None


def test_an_old_damaged_or_foreign_table_is_measured_again(tower, tmp_path):
    import json

    from app.gpu import tune_cache

    cache = TuneCache(tmp_path, {"gpu": "test"})
    first, _ = tuned(tower, cache)
    data = json.loads(cache.path.read_text())
    cache.path.write_text(json.dumps({**data, "written_at": time.time() - tune_cache.MAX_AGE_S - 1}))
    assert cache.load() is None  # older than a week: measured again
    broken = [dict(r) for r in data["table"]]
    del broken[-1]["graph_ms"]
    cache.path.write_text(json.dumps({**data, "table": broken}))
    mgr = GraphManager(tower, GraphSettings(budgets=[B, 2 * B, 4 * B], max_items_per_batch=8, max_frames_per_batch=8))
    emulate_capture(mgr)
    graphs = set(mgr.graphs)
    assert mgr._apply(broken) is False and set(mgr.graphs) == graphs and mgr._tuned == {}  # nothing half-applied
    again, timed = tuned(tower, cache)
    assert timed and again.autotune_table == first.autotune_table


def test_the_code_digest_follows_every_source_file(tmp_path):
    for name in ("vision", "gpu"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "kernel.py").write_text("A = 1\n")
    folders = (tmp_path / "vision", tmp_path / "gpu")
    before = source_digest(folders)
    (tmp_path / "gpu" / "kernel.py").write_text("A = 2\n")  # an attention backend's change, say
    assert source_digest(folders) != before
    assert source_digest(TOWER_CODE) != source_digest(TOWER_CODE[:1])  # the tower's covers app/gpu as well


# ---------------------------------------------------------------- the tower's GEMM choice, kept beside it
ROWS = [64, 256, 1024]


def gemm_tower(monkeypatch):
    """A tower with a down projection (4 layers, width 40 padded to 48), whose timing runs, which need
    CUDA, are stood in for: each row count timed is recorded, and the last way wins."""
    from app.vision.tower_api import GraphTower

    tower = GraphTower()
    tower._init_down_projection([torch.randn(16, 48) for _ in range(4)], 40)
    down, timed = tower.down, []

    def timing_runs(rows_list, weights, runs=5):
        assert weights is tower.down_weights
        for rows in sorted(set(rows_list) - set(down.choice)):
            timed.append(rows)
            down.timings[rows] = {w: float(len(down.ways) - i) for i, w in enumerate(down.ways)}
            down.keep(rows, down.ways[-1])

    monkeypatch.setattr(down, "tune", timing_runs)
    return tower, timed


def test_a_replica_applies_the_gemm_choice_another_timed_and_times_nothing(monkeypatch, tmp_path):
    cache = TuneCache(tmp_path, {"gpu": "test"})
    first, timed = gemm_tower(monkeypatch)
    assert first.tune_gemms(ROWS, cache) == "measured" and timed == ROWS
    second, timed_again = gemm_tower(monkeypatch)
    source = second.tune_gemms(ROWS, TuneCache(tmp_path, {"gpu": "test"}))
    assert timed_again == [] and source == f"from {cache.beside('down projection').path}"
    assert second.down.choice == first.down.choice == dict.fromkeys(ROWS, "cublaslt_padded")
    # its own file: the graphs' auto-tune table of the same key is still to be measured
    assert cache.beside("down projection").path != cache.path and cache.load() is None
    other, timed_other = gemm_tower(monkeypatch)
    other.tune_gemms(ROWS, TuneCache(tmp_path, {"gpu": "another"}))
    assert timed_other == ROWS  # another key (GPU model, settings, code): timed again


def test_a_gemm_choice_that_misses_a_row_count_or_names_an_unknown_way_is_timed_again(monkeypatch, tmp_path):
    cache = TuneCache(tmp_path, {"gpu": "test"})
    gemm_tower(monkeypatch)[0].tune_gemms(ROWS, cache)
    more, timed = gemm_tower(monkeypatch)
    assert more.tune_gemms(ROWS + [4096], cache) == "measured" and timed == ROWS + [4096]  # nothing half-applied
    assert gemm_tower(monkeypatch)[0].tune_gemms(ROWS + [4096], cache).startswith("from ")  # kept, with 4096
    cache.beside("down projection").save([{"rows": r, "way": "a kernel of another build"} for r in ROWS])
    damaged, timed = gemm_tower(monkeypatch)
    assert damaged.tune_gemms(ROWS, cache) == "measured" and timed == ROWS
    assert set(damaged.down.choice.values()) <= set(damaged.down.ways)


def test_an_untimed_choice_is_not_kept_and_a_tower_without_one_writes_nothing(tmp_path):
    """Off CUDA the real timing runs do nothing: there is no choice to keep for the next replica."""
    from app.vision.tower_api import GraphTower

    cache = TuneCache(tmp_path / "t", {"gpu": "test"})
    tower = GraphTower()
    assert tower.tune_gemms(ROWS, cache) == "nothing to choose"
    tower._init_down_projection([torch.randn(16, 48) for _ in range(2)], 40)
    assert tower.tune_gemms(ROWS, cache) == "measured" and tower.down.choice == {}
    assert not cache.beside("down projection").path.exists()
    assert tower.tune_gemms(ROWS) == "measured"  # no cache at all
