"""Metric values against hand computation, and the comm/compute split's arithmetic."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hybridrec.metrics import binary_metrics, comm_compute_split, percentiles_ms

pytestmark = pytest.mark.unit


def test_binary_metrics_by_hand():
    m = binary_metrics(torch.tensor([0.9, 0.8, 0.3, 0.2]), torch.tensor([1.0, 0.0, 1.0, 0.0]))
    # AUC: of the 4 (positive, negative) pairs, 3 are ordered right
    assert m["auc"] == pytest.approx(0.75)
    logloss = -(math.log(0.9) + math.log(0.2) + math.log(0.3) + math.log(0.8)) / 4
    assert m["logloss"] == pytest.approx(logloss)
    # NE: log loss over the entropy of the base rate (0.5 -> ln 2)
    assert m["ne"] == pytest.approx(logloss / math.log(2))
    assert m["calibration"] == pytest.approx(2.2 / 2)  # predicted / actual clicks
    assert m["ctr"] == 0.5 and m["accuracy"] == 0.5 and m["n"] == 4


def test_auc_matches_pairwise_count_on_random_scores():
    rng = np.random.default_rng(0)
    labels = rng.random(300) < 0.3
    scores = rng.random(300) + 0.3 * labels
    pos, neg = scores[labels], scores[~labels]
    pairwise = (pos[:, None] > neg[None, :]).mean()
    m = binary_metrics(torch.tensor(scores), torch.tensor(labels, dtype=torch.float32))
    assert m["auc"] == pytest.approx(pairwise, abs=1e-9)


def _event(name, start, end):
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end))


def test_comm_split_adds_up_and_does_not_double_count_overlaps():
    events = [
        _event("ProfilerStep*", 0, 100), _event("ProfilerStep*", 100, 200),
        _event("gloo:all_to_all", 10, 30), _event("gloo:all_gather", 20, 40),  # overlap: 30 us
        _event("gloo:all_reduce", 190, 230),  # clipped at the window's end: 10 us
        _event("aten::mm", 50, 90),  # compute, not counted
    ]
    s = comm_compute_split(events)
    assert s["profiled_ms"] == pytest.approx(0.2) and s["comm_ms"] == pytest.approx(0.04)
    assert s["comm_ms"] + s["compute_ms"] == pytest.approx(s["profiled_ms"])
    assert s["comm_share"] == pytest.approx(0.2)
    assert s["comm_ms_by_kind"]["embedding all-to-all"] == pytest.approx(0.02)


def test_step_time_percentiles():
    p = percentiles_ms([0.01] * 95 + [0.1] * 5)
    assert p["step_time_p50_ms"] == pytest.approx(10) and p["step_time_p95_ms"] == pytest.approx(10, abs=5)
