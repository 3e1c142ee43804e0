"""summary.json built from explicit inputs (hybridrec.reports.summary.run_summary), without a process
group: the headline numbers, the loss, a resumed run's throughput, memory per rank, and which
keys appear, checked against the schema (RunSummary) and hand-computed values."""

import json
import re

import pytest

from hybridrec.reports.summary import (
    MemoryRow,
    RankMeasurement,
    RunSummary,
    TrainBlock,
    format_summary,
    headline,
    run_summary,
)

pytestmark = pytest.mark.unit

MB = 2**20
EVAL = {"auc": 0.75, "ne": 0.9, "n": 512}
PROVENANCE = {
    "resumed_from": None,
    "config_sha256": "0" * 64,
    "versions": {
        "python": "3.11.7",
        "torch": "2",
        "torchrec": "1",
        "fbgemm_gpu": None,
        "hydra": "1.3",
        "hybridrec": None,
    },
}
PLAN = {  # hybridrec.parallel.sharding.plan_report's shape, two ranks
    "tables": {
        "t0": {
            "rows": 100,
            "dim": 8,
            "sharding_type": "table_wise",
            "compute_kernel": "fused",
            "ranks": [1],
            "est_device_bytes": 0,
            "est_host_bytes": 4 * MB,
        }
    },
    "ranks": [
        {"rank": 0, "est_device_bytes": 0, "est_host_bytes": MB // 2, "est_step_ms": 0.1},
        {"rank": 1, "est_device_bytes": 3 * MB, "est_host_bytes": 4 * MB + MB // 10, "est_step_ms": 0.2},
    ],
}


def summarize(**given):
    """A 2-rank, 20-step run of 64 samples per step in 2 s, with ``given`` replacing any input."""
    inputs = dict(
        losses=[1.0] * 20,
        start_step=0,
        step_times=[0.1] * 20,
        global_batch_size=64,
        wall_s=2.0,
        final={"eval": EVAL},
        eval_history=[{"step": 20, "split": "eval", **EVAL}],
        world_size=2,
        device="cpu",
        dense_parallel="fsdp",
        dense_parameters=1234,
        provenance=PROVENANCE,
        plan=PLAN,
        ranks=[RankMeasurement(900.5, {}, None), RankMeasurement(1010.2, {}, None)],
        profiled=False,
    )
    return run_summary(**(inputs | given))


def test_headline_numbers_are_the_train_blocks_own():
    s = summarize(wall_s=2.0004, step_times=[0.01] * 19 + [0.1])
    t = s["train"]
    assert t["steps"] == s["steps"] == 20 and t["samples"] == 20 * 64
    assert t["wall_time_s"] == s["wall_time_s"] == 2.0  # rounded to ms
    assert t["samples_per_second"] == s["samples_per_second"] == pytest.approx(20 * 64 / 2.0004)
    assert t["resumed_from_step"] == 0 and t["step_time_p50_ms"] == pytest.approx(10.0)
    assert s["global_batch_size"] == 64 and s["dense_parameters"] == 1234 and s["world_size"] == 2
    assert list(t) == list(TrainBlock.__annotations__)  # the schema's order


def test_train_loss_is_the_mean_of_the_last_tenth_of_steps():
    assert summarize(losses=[float(i) for i in range(1, 31)])["train_loss"] == pytest.approx((28 + 29 + 30) / 3)
    assert summarize(losses=[float(i) for i in range(100)])["train_loss"] == pytest.approx(sum(range(90, 100)) / 10)
    assert summarize(losses=[4.0, 3.0, 2.0, 1.0, 0.5])["train_loss"] == 0.5  # fewer than 10 steps: the last one


def test_a_resumed_runs_speed_counts_only_its_own_steps():
    resumed = {"path": "/ckpt/step_20", "step": 20}
    s = summarize(
        losses=[1.0] * 30,
        start_step=20,
        step_times=[0.05] * 10,
        global_batch_size=8,
        wall_s=0.5,
        provenance=PROVENANCE | {"resumed_from": resumed},
    )
    t = s["train"]
    assert t["steps"] == s["steps"] == 30 and t["samples"] == 30 * 8  # every step of the run
    assert t["samples_per_second"] == s["samples_per_second"] == pytest.approx(10 * 8 / 0.5)  # not 30 * 8 / 0.5
    assert t["resumed_from_step"] == 20 and s["provenance"]["resumed_from"] == resumed
    # a run resumed at its last step timed none: no step-time percentiles, no division by zero
    done = summarize(losses=[1.0] * 30, start_step=30, step_times=[], wall_s=0.0)
    assert done["samples_per_second"] == 0.0 and "step_time_p50_ms" not in done["train"]


def test_memory_per_rank_pairs_the_planners_estimate_with_the_measured_rss():
    gpu = {"peak_device_allocated_mb": 1500.0, "peak_device_reserved_mb": 1800.0}
    s = summarize(ranks=[RankMeasurement(900.5, {}, None), RankMeasurement(1010.2, gpu, None)])
    assert s["peak_rss_mb"] == [900.5, 1010.2]
    assert s["memory_per_rank"] == [
        {"rank": 0, "est_device_mb": 0.0, "est_host_mb": 0.5, "peak_rss_mb": 900.5},
        {"rank": 1, "est_device_mb": 3.0, "est_host_mb": 4.1, "peak_rss_mb": 1010.2, **gpu},
    ]
    assert list(s["memory_per_rank"][1]) == list(MemoryRow.__annotations__)
    assert s["plan"] == PLAN["tables"]
    # paired by the plan's rank, not by position
    flipped = summarize(plan=PLAN | {"ranks": PLAN["ranks"][::-1]})
    assert [(r["rank"], r["peak_rss_mb"], r["est_host_mb"]) for r in flipped["memory_per_rank"]] == [
        (1, 1010.2, 4.1),
        (0, 900.5, 0.5),
    ]
    # ranks other than 0 have no plan report: every rank's RSS, no rows
    other = summarize(plan=None)
    assert other["plan"] == {} and other["memory_per_rank"] == [] and other["peak_rss_mb"] == [900.5, 1010.2]


def test_optional_keys_appear_only_when_given():
    plain = summarize()
    assert list(plain) == [k for k in RunSummary.__annotations__ if k in RunSummary.__required_keys__]
    valid = {"auc": 0.7, "ne": 0.95, "n": 256}
    profile = {
        "rank": 0,
        "profiled_steps": 5,
        "profiled_ms": 100.0,
        "comm_ms": 25.0,
        "compute_ms": 75.0,
        "comm_share": 0.25,
        "comm_ms_by_kind": {"embedding all-to-all": 25.0},
        "breakdown_ms": {"other": 20.0},
    }
    report = {
        "rows": 300,
        "bad_rows": 1,
        "unreadable": [],
        "files": {},
        "dropped_tail_rows": {"train": 4},
        "collisions": {},
    }
    freshness = {
        "partitions": [],
        "mean_after_first": {"auc": 0.71, "ne": 0.9, "logloss": 0.5},
        "mean_trained": {"auc": 0.71, "ne": 0.9, "logloss": 0.5},
        "mean_scored_only": {},
    }
    full = summarize(
        final={"valid": valid, "eval": EVAL},
        profiled=True,
        data=report,
        freshness=freshness,
        ranks=[RankMeasurement(900.5, {}, profile), RankMeasurement(1010.2, {}, None)],
    )
    assert list(full) == list(RunSummary.__annotations__)  # every key, in the schema's order
    assert full["valid"] == valid and full["eval"] == EVAL
    assert full["profile"] == [profile, None] and full["data"] == report
    # profiles measured but profiling off: no profile key
    assert "profile" not in summarize(ranks=[RankMeasurement(1.0, {}, profile), RankMeasurement(1.0, {}, None)])
    # what summary.json holds is plain JSON, read back equal
    assert json.loads(json.dumps(full)) == full
    rows = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in format_summary(full).splitlines())
    assert rows["samples/s"] == "640 (after the first 10 steps: 640)" and rows["steps / samples"] == "20 / 1,280"
    assert full["train"]["steady_samples_per_second"] == pytest.approx(640) and full["train"][
        "first_steps_s"
    ] == pytest.approx(1.0)
    assert rows["valid"].startswith("AUC 0.7000") and rows["eval (test)"].startswith("AUC 0.7500")
    assert rows["comm share of step time per rank"] == "25%, not reached"
    assert rows["progressive (after day 1)"] == "trained (0): AUC 0.7100, NE 0.9000"


OBJECTIVE = {
    "name": "valid.logloss",
    "direction": "minimize",
    "value": 0.45,
    "best_step": 300,
    "best_value": 0.45,
    "best_checkpoint": "/ck/step_00000300",
    "stopped_early_at": 400,
    "early_stop_patience": 2,
}
PLANTED = [
    {"name": "planted model", "metric": "valid.logloss", "value": 0.412, "source": "benchmarks/planted_model.py"},
    {"name": "planted model", "metric": "eval.auc", "value": 0.8779, "source": "benchmarks/planted_model.py"},
    {"name": "a ranker", "metric": "eval.ndcg@10", "value": 0.3, "source": "results"},
]


def test_the_summary_says_whether_the_run_is_good():
    """The objective, its best step, the early stop with its patience, and each reference
    beside the run's own final score on the same split and metric."""
    s = summarize(
        final={"valid": {"logloss": 0.45, "auc": 0.85, "n": 8}, "eval": {"auc": 0.86, "logloss": 0.44, "n": 8}},
        objective=OBJECTIVE,
        references=PLANTED,
    )
    assert s["objective"] == OBJECTIVE
    logloss, auc, ndcg = s["references"]
    assert logloss["run_value"] == 0.45 and logloss["difference"] == pytest.approx(0.038)
    assert auc["run_value"] == 0.86 and auc["difference"] == pytest.approx(0.86 - 0.8779)
    assert ndcg["run_value"] is None and ndcg["difference"] is None  # this run does not report it
    table = format_summary(s)
    assert "valid.logloss 0.4500 (minimize), best 0.4500 at step 300, kept in /ck/step_00000300" in table
    assert "stopped early at step 400 (patience 2)" in table
    assert re.search(
        r"vs planted model +valid.logloss 0.4120 on valid \(benchmarks/planted_model.py\); this run "
        r"0.4500 \(\+0.0380\)",
        table,
    )
    assert "eval.auc 0.8779 on test (benchmarks/planted_model.py); this run 0.8600 (-0.0179)" in table
    assert "eval.ndcg@10 0.3000 on test (results); not reported by this run" in table
    line = headline(s)
    assert line.startswith(
        "20 steps, 640 samples/s, train loss 1.0000, valid.logloss 0.4500 (best at step 300), "
        "stopped early at step 400, valid.logloss +0.0380 vs planted model, eval AUC"
    )


def test_a_resumed_training_lists_its_resumes_and_times_only_its_own_steps():
    resumes = [{"path": "/ck/step_00000040", "step": 40}, {"path": "/ck/step_00000080", "step": 80}]
    s = summarize(losses=[1.0] * 100, start_step=80, step_times=[0.1] * 20, resumes=resumes)
    assert s["resumes"] == resumes and s["train"]["samples_per_second"] == 20 * 64 / 2.0
    assert re.search(
        r"resumed +at step 40 from /ck/step_00000040, at step 80 from /ck/step_00000080", format_summary(s)
    )
    assert re.search(r"wall time +2.0 s \(this run's steps 81-100\)", format_summary(s))
    assert headline(s).startswith("100 steps (resumed at 80), 640 samples/s")
    assert summarize()["resumes"] == [] and summarize()["references"] == []


def test_report_png_marks_the_objective_the_references_and_the_resumes(tmp_path):
    """report.png of a resumed, early-stopped run with references: drawn without error, with
    one panel more (the objective's) than a run without validation."""
    import matplotlib.image

    from hybridrec.reports.runlog import plot_report, resume_record

    records = [
        {"step": s, "loss": 0.7 - s / 1000, "loss_mean": 0.7 - s / 1000, "samples_per_second": 100.0}
        for s in range(10, 210, 10)
    ]
    records += [
        {"step": s, "split": "valid", "eval": {"auc": 0.7 + s / 2000, "ne": 0.9, "logloss": 0.5 - s / 2000}}
        for s in range(50, 250, 50)
    ]
    records.insert(10, resume_record(100, "/ck/step_00000100"))
    records.append({"step": 150, "split": "eval", "eval": {"auc": 0.8, "ne": 0.9, "logloss": 0.42}})
    s = summarize(
        final={"valid": {"logloss": 0.4, "auc": 0.8}, "eval": {"auc": 0.8}},
        objective=OBJECTIVE | {"best_step": 150, "best_value": 0.425, "stopped_early_at": 200},
        references=PLANTED[:2],
    )
    plot_report(records, str(tmp_path / "report.png"), s)
    plot_report([r for r in records if "eval" not in r], str(tmp_path / "plain.png"))
    judged, plain = (matplotlib.image.imread(tmp_path / name) for name in ("report.png", "plain.png"))
    assert judged.shape[1] == plain.shape[1] * 4 // 3  # 5 inches per panel


def test_a_continuous_report_leads_with_the_progressive_metric_and_one_evaluation_says_so(tmp_path, monkeypatch):
    """A continuous run's report.png: its first panel is the progressive AUC per partition,
    titled with the mean over the days after the first and which days those are; a panel with
    a single evaluation states it on an axis of its own scale, not magnified."""
    import matplotlib.figure

    from hybridrec.reports.runlog import plot_report

    drawn = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: drawn.append(fig))
    records = [{"step": s, "loss": 0.6, "loss_mean": 0.6, "samples_per_second": 100.0} for s in range(1, 13)]
    aucs = [0.5, 0.77, 0.78, 0.79]
    records += [
        {
            "step": 4 * i,
            "split": "progressive",
            "partition": f"day=2026-11-0{i + 1}",
            "trained": True,
            "eval": {"auc": a, "ne": 0.9, "logloss": 0.5},
        }
        for i, a in enumerate(aucs)
    ]
    records.append({"step": 12, "split": "valid", "eval": {"auc": 0.7749, "ne": 0.9, "logloss": 0.5}})
    plot_report(records, str(tmp_path / "report.png"))
    axes = drawn[0].axes
    assert (
        axes[0]
        .get_title()
        .startswith("progressive AUC per partition: mean 0.7800\nover 3: day=2026-11-02 to day=2026-11-04\n")
    )
    validation = next(ax for ax in axes if ax.get_title() == "validation")
    assert "one evaluation: AUC 0.7749 at step 12" in [t.get_text() for t in validation.texts]
    low, high = validation.get_ylim()
    assert high - low > 0.05  # not a magnified axis around one point
