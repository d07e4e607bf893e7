"""Dispatch's observed batch times (app/vision/observed.py): the corrections it applies and when it
sends a batch down the other path. The clock-free parts, fed ratios directly; tests/test_vision_encoder.py
drives them through the graph manager."""

from __future__ import annotations

import random

import numpy as np
import pytest

from app.vision.observed import EAGER, GRAPH, ObservedSettings, ObservedTimes, quantile


def test_quantile_matches_numpy_linear():
    rng = random.Random(0)
    for n in (1, 2, 3, 7, 32):
        values = [rng.uniform(0.5, 2.0) for _ in range(n)]
        for q in (0.0, 0.25, 0.5, 0.75, 0.9, 1.0):
            assert quantile(values, q) == pytest.approx(float(np.quantile(values, q)), abs=1e-12)


def test_a_correction_counts_only_after_min_samples_and_over_the_last_window():
    obs = ObservedTimes(ObservedSettings(window=8, min_samples=4, quantile=0.75), cuda=False)
    for i, r in enumerate([1.0, 1.2, 0.8]):
        obs.add(896, EAGER, r)
        assert obs.factor(896, EAGER) is None, i
    obs.add(896, EAGER, 1.4)
    assert obs.factor(896, EAGER) == pytest.approx(float(np.quantile([1.0, 1.2, 0.8, 1.4], 0.75)))
    assert obs.factor(896, GRAPH) is None and obs.factor(1024, EAGER) is None  # kept apart
    ratios = [0.5 + 0.1 * i for i in range(20)]
    for r in ratios:
        obs.add(896, EAGER, r)
    assert obs.factor(896, EAGER) == pytest.approx(float(np.quantile(ratios[-8:], 0.75)))
    assert obs.summary() == {"896": {"eager": [round(float(np.quantile(ratios[-8:], 0.75)), 3), 8]}}


def test_the_cpu_clock_times_a_batch_against_its_prediction():
    obs = ObservedTimes(ObservedSettings(min_samples=1), cuda=False)
    mark = obs.start()
    sum(range(200_000))  # some work
    obs.finish(mark, 512, GRAPH, predicted_ms=1e6)  # a prediction far above: a tiny ratio
    assert 0 < obs.factor(512, GRAPH) < 1e-3
    obs.finish(obs.start(), 512, EAGER, predicted_ms=0.0)  # no prediction: nothing to compare
    assert obs.factor(512, EAGER) is None


def test_exploration_only_near_a_tie_often_while_the_other_path_is_unknown_then_rarely():
    s = ObservedSettings(min_samples=4, explore_band=0.2, explore_every=16, explore_every_unknown=4)
    obs = ObservedTimes(s, cuda=False)
    assert not any(obs.explore(896, 1.0, 1.3) for _ in range(100))  # 30% apart: no tie
    # eager expected faster (1.0 < 1.1): the graph is the other path, unknown at first
    picks = [i for i in range(1, 17) if obs.explore(896, 1.0, 1.1)]
    assert picks == [4, 8, 12, 16] and obs.explored == 4
    for _ in range(4):
        obs.add(896, GRAPH, 1.0)
    picks = [i for i in range(1, 33) if obs.explore(896, 1.0, 1.1)]
    assert len(picks) == 2 and picks[1] - picks[0] == 16  # known: one in 16
    assert [i for i in range(1, 5) if obs.explore(1024, 1.1, 1.0)] == [4]  # per budget; eager unknown there
