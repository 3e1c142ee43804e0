"""Metric values against hand computation, and the comm/compute split's arithmetic."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hybridrec.reports.metrics import binary_metrics
from hybridrec.reports.profiling import BREAKDOWN_PHASES, comm_compute_split, percentiles_ms, step_breakdown

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


def _event(name, start, end, thread=1):
    return SimpleNamespace(name=name, thread=thread, time_range=SimpleNamespace(start=start, end=end))


def test_comm_split_adds_up_and_does_not_double_count_overlaps():
    events = [
        _event("ProfilerStep*", 0, 100),
        _event("ProfilerStep*", 100, 200),
        _event("gloo:all_to_all", 10, 30),
        _event("gloo:all_gather", 20, 40),  # overlap: 30 us
        _event("gloo:all_reduce", 190, 230),  # clipped at the window's end: 10 us
        _event("aten::mm", 50, 90),  # compute, not counted
    ]
    s = comm_compute_split(events)
    assert s["profiled_ms"] == pytest.approx(0.2) and s["comm_ms"] == pytest.approx(0.04)
    assert s["comm_ms"] + s["compute_ms"] == pytest.approx(s["profiled_ms"])
    assert s["comm_share"] == pytest.approx(0.2)
    assert s["comm_ms_by_kind"]["embedding all-to-all"] == pytest.approx(0.02)


def test_comm_split_files_nccl_kernels_under_their_kind():
    events = [
        _event("ProfilerStep*", 0, 1000),
        _event("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 0, 100),  # NCCL's all-to-all
        _event("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 100, 150),
        _event("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 200, 260),
        _event("ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)", 300, 310),  # older NCCL's names
        _event("nccl:_all_gather_base", 100, 102),  # the host's launch record: not comm time
    ]
    kinds = comm_compute_split(events)["comm_ms_by_kind"]
    assert kinds == pytest.approx(
        {
            "embedding all-to-all": 0.1,
            "FSDP2 all-gather": 0.05,
            "FSDP2 reduce-scatter": 0.06,
            "all-reduce (gradients, metrics)": 0.01,
        }
    )


def test_step_breakdown_innermost_label_wins_and_waits_go_to_the_collective():
    main = [
        _event("ProfilerStep#1", 0, 1000),
        _event("ProfilerStep#2", 1000, 2000),
        _event("## next_batch ##", 0, 50),
        _event("## forward 1 ##", 50, 400),
        _event("aten::addmm", 60, 160),  # unlabelled: dense, like its phase
        _event("FSDP::all_gather", 160, 200),
        _event("[lookup]_[model.sparse_arch.ebc]_[table_wise]", 200, 300),
        _event("fbgemm::split_embedding_codegen_lookup", 210, 290),  # inside a lookup: still embedding
        _event("## backward 1 ##", 400, 900),
        _event("aten::mm", 400, 600),
        # 600-700: the backward's own span, no op open, while gloo reduces on its thread
        _event("## optimizer 1 ##", 900, 950),
        # 950-1000: no event at all -> other
        _event("## forward 2 ##", 1000, 2000),
        _event("aten::mm", 1000, 1500),
        # 1500-2000: forward's own span while an all-to-all runs: a wait for the embeddings
    ]
    workers = [
        _event("gloo:all_reduce", 600, 700, thread=2),
        _event("gloo:all_to_all", 1500, 1800, thread=2),
        _event("gloo:all_to_all", 550, 580, thread=3),
    ]  # overlaps compute: not a wait
    b = step_breakdown(main + workers)
    assert list(b) == list(BREAKDOWN_PHASES)
    assert sum(b.values()) == pytest.approx(1.0)  # ms per step: 2 steps of 1000 us
    assert b["input"] == pytest.approx(0.025)
    assert b["dense collective"] == pytest.approx((40 + 100) / 2000)
    assert b["embedding lookup + all-to-all"] == pytest.approx((100 + 300) / 2000)
    assert b["optimizer"] == pytest.approx(0.025)
    assert b["other"] == pytest.approx(0.025)
    dense = (350 - 40 - 100) + (500 - 100) + 1000 - 300
    assert b["dense forward + backward"] == pytest.approx(dense / 2000)


def test_step_time_percentiles():
    p = percentiles_ms([0.01] * 95 + [0.1] * 5)
    assert p["step_time_p50_ms"] == pytest.approx(10) and p["step_time_p95_ms"] == pytest.approx(10, abs=5)


def test_summary_shows_gpu_memory_beside_the_planners_estimate():
    from hybridrec.reports.profiling import peak_device_mb
    from hybridrec.reports.summary import format_summary

    assert peak_device_mb(torch.device("cpu")) == {}  # on CPU the host RSS is the measure
    train = {"steps": 10, "samples": 640, "wall_time_s": 1.0, "samples_per_second": 640.0, "resumed_from_step": 0}
    objective = {
        "name": "train_loss",
        "direction": "minimize",
        "value": 0.5,
        "best_step": None,
        "best_value": None,
        "best_checkpoint": None,
        "stopped_early_at": None,
        "early_stop_patience": 0,
    }
    s = {
        "world_size": 2,
        "device": "cuda:0",
        "dense_parallel": "fsdp",
        "train": train,
        "train_loss": 0.5,
        "objective": objective,
        "references": [],
        "resumes": [],
        "eval": {"auc": 0.7, "n": 64},
        "peak_rss_mb": [900.0, 910.0],
        "memory_per_rank": [
            {
                "rank": r,
                "est_device_mb": 2048.0,
                "peak_device_allocated_mb": 1500.0 + r,
                "peak_device_reserved_mb": 1800.0,
            }
            for r in (0, 1)
        ],
    }
    assert "GPU peak allocated / planned  1,500 / 2,048 MB, 1,501 / 2,048 MB" in format_summary(s)
    s["memory_per_rank"] = [{"rank": 0, "est_device_mb": 0.0, "peak_rss_mb": 900.0}]
    assert "GPU" not in format_summary(s)
