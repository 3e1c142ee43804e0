"""The sweep summary (hybridrec.reports.sweep) on hand-made job directories: rows, swept keys,
metrics, a failed and an unfinished job, and the callback's record of a failed job."""

import csv
import io
import json
import os

import pytest
from hydra.core.utils import JobReturn, JobStatus
from hydra.types import RunMode
from omegaconf import OmegaConf

from hybridrec.reports.sweep import FAILED_FILE, SweepSummary, one_line, read_jobs, to_csv, to_markdown, write_summary

pytestmark = pytest.mark.unit

COMMON = ["+experiment=ctr", "train.steps=5"]


def _summary(auc, ne, rate, rss, dense, valid_logloss=0.5):
    return {
        "eval": {"auc": auc, "ne": ne, "logloss": 0.5, "ctr": 0.33, "n": 4096},
        "valid": {"auc": auc - 0.01, "logloss": valid_logloss, "n": 1024},
        "objective": {
            "name": "valid.logloss",
            "direction": "minimize",
            "value": valid_logloss,
            "best_step": 5,
            "best_value": valid_logloss,
            "best_checkpoint": None,
            "stopped_early_at": None,
        },
        "samples_per_second": rate,
        "peak_rss_mb": rss,
        "dense_parameters": dense,
        "train_loss": 0.45,
        "steps": 5,
        "global_batch_size": 2048,
        "world_size": len(rss),
        "wall_time_s": 1.5,
    }


def _job(sweep, num, overrides, summary=None, failed=None):
    """What Hydra (.hydra/), the trainer (summary.json) and the callback (failed.json) leave."""
    d = sweep / f"{num}_{','.join(overrides)}"
    (d / ".hydra").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(overrides), d / ".hydra" / "overrides.yaml")
    OmegaConf.save(OmegaConf.create({"hydra": {"job": {"num": num}}}), d / ".hydra" / "hydra.yaml")
    if summary:
        (d / "summary.json").write_text(json.dumps(summary))
    if failed:
        (d / FAILED_FILE).write_text(json.dumps({"error": failed}))
    return d


@pytest.fixture
def sweep(tmp_path):
    s = tmp_path / "sweep"
    # written out of order, and 10 after 2: rows follow the job number, not the name
    _job(s, 10, [*COMMON, "model=deepfm"])  # no summary, no failure: still running or killed
    _job(s, 0, [*COMMON, "model=dlrm"], _summary(0.7512, 0.91, 20480.4, [900.0, 812.5], 499521, valid_logloss=0.52))
    _job(
        s,
        2,
        [*COMMON, "model=dcn", "optimizer=sgd"],
        failed="hybridrec: invalid config: data.batch_size=2048 is the global batch and must divide evenly over "
        "world_size=3 ranks",
    )
    _job(s, 1, [*COMMON, "model=dcn"], _summary(0.7601, 0.89, 9000.0, [1200.0], 1342849, valid_logloss=0.48))
    (s / ".submitit" / "123").mkdir(parents=True)  # launcher files: not jobs
    (s / "multirun.yaml").write_text("{}")
    return s


def test_jobs_in_order_with_their_status(sweep):
    jobs = read_jobs(str(sweep))
    assert [(j.num, j.status) for j in jobs] == [(0, "ok"), (1, "ok"), (2, "failed"), (10, "unfinished")]
    assert jobs[2].error.startswith("hybridrec: invalid config: data.batch_size=2048")
    assert jobs[0].dir == "0_+experiment=ctr,train.steps=5,model=dlrm"


def test_csv_has_one_row_per_job_with_every_field(sweep):
    rows = list(csv.DictReader(io.StringIO(to_csv(read_jobs(str(sweep))))))
    assert list(rows[0]) == [
        "job",
        "status",
        "model",
        "optimizer",
        "objective",
        "chosen",
        "objective_name",
        "direction",
        "valid_auc",
        "valid_logloss",
        "samples_per_second",
        "peak_rss_mb",
        "dense_parameters",
        "test_auc",
        "test_ne",
        "test_logloss",
        "train_loss",
        "steps",
        "global_batch_size",
        "world_size",
        "wall_time_s",
        "best_step",
        "overrides",
        "dir",
        "error",
    ]
    # best first by the validation objective (log loss: lower), then the failed and unfinished jobs
    assert [(r["job"], r["status"], r["model"], r["optimizer"], r["chosen"]) for r in rows] == [
        ("1", "ok", "dcn", "", "yes"),
        ("0", "ok", "dlrm", "", ""),
        ("2", "failed", "dcn", "sgd", ""),
        ("10", "unfinished", "deepfm", "", ""),
    ]
    ok = rows[1]
    assert float(ok["objective"]) == 0.52 and ok["objective_name"] == "valid.logloss"
    assert float(ok["test_auc"]) == 0.7512 and float(ok["samples_per_second"]) == 20480.4
    assert float(ok["peak_rss_mb"]) == 900.0  # the largest rank's peak
    assert int(ok["dense_parameters"]) == 499521 and int(ok["world_size"]) == 2
    assert ok["overrides"] == "+experiment=ctr train.steps=5 model=dlrm" and ok["error"] == ""
    assert rows[2]["test_auc"] == "" and rows[2]["objective"] == "" and "world_size=3" in rows[2]["error"]


def test_markdown_table_is_for_choosing(sweep):
    text = to_markdown(read_jobs(str(sweep)))
    lines = text.splitlines()
    assert lines[0] == "Every job: `+experiment=ctr train.steps=5`"  # shared overrides, once
    table = [line for line in lines if line.startswith("|")]
    assert table[0] == (
        "| job | status | model | optimizer | valid.logloss (lower is better) | valid auc "
        "| samples/s | peak RSS MB (max rank) | dense params | dir | error |"
    )
    assert len(table) == 2 + 4  # heading, alignment, one row per job
    assert table[2] == (
        "| 1 | ok | dcn |  | **0.4800** (chosen) | 0.7501 | 9,000 | 1,200 | 1,342,849 "
        "| 1_+experiment=ctr,train.steps=5,model=dcn |  |"
    )
    assert table[3].startswith("| 0 | ok | dlrm |  | 0.5200 | ")
    assert table[4].startswith("| 2 | failed | dcn | sgd |  |  |  |  |  | 2_") and "world_size=3 ranks |" in table[4]
    assert table[5].startswith("| 10 | unfinished | deepfm |")
    # the test split: for the chosen job only, below the table, never a column to sort on
    assert "test" not in table[0] and lines[-1] == (
        "Chosen on validation: job 1 (valid.logloss 0.4800 at step 5). Its test metrics, scored once at the end: "
        "auc 0.7601  ne 0.8900  logloss 0.5000"
    )


def test_a_maximized_objective_sorts_the_other_way(tmp_path):
    for num, auc in ((0, 0.71), (1, 0.74), (2, 0.69)):
        summary = _summary(0.7, 0.9, 1.0, [1.0], 1)
        summary["objective"] |= {"name": "valid.auc", "direction": "maximize", "value": auc}
        _job(tmp_path, num, [f"optimizer.dense.lr={0.0123456789 * (num + 1)}"], summary)
    jobs = read_jobs(str(tmp_path))
    rows = list(csv.DictReader(io.StringIO(to_csv(jobs))))
    assert [(r["job"], r["chosen"]) for r in rows] == [("1", "yes"), ("0", ""), ("2", "")]
    assert rows[0]["optimizer.dense.lr"] == "0.0246913578"  # every digit in the CSV, 4 in the table
    assert "| 1 | ok | 0.02469 | **0.7400** (chosen) |" in to_markdown(jobs)


def test_ranking_metrics_as_present(tmp_path):
    ranking = {
        "eval": {
            "auc": 0.8,
            "ndcg@10": 0.55,
            "map": 0.5,
            "recall@10": 0.48,
            "n": 900,
            "queries": 90,
            "queries_with_relevant": 88,
        },
        "samples_per_second": 1.0,
        "peak_rss_mb": [1.0],
    }
    ranking["valid"] = ranking["eval"]
    _job(tmp_path, 0, ["loss=pairwise"], ranking)
    _job(tmp_path, 1, ["loss=listwise"], ranking)
    header = to_csv(read_jobs(str(tmp_path))).splitlines()[0].split(",")
    assert header[:12] == [
        "job",
        "status",
        "loss",
        "objective",
        "chosen",
        "objective_name",
        "direction",
        "valid_auc",
        "valid_ndcg@10",
        "valid_map",
        "valid_recall@10",
        "samples_per_second",
    ]


def test_write_summary_writes_both_files(sweep):
    markdown = write_summary(str(sweep))
    assert (sweep / "summary.md").read_text() == markdown
    assert len((sweep / "summary.csv").read_text().splitlines()) == 1 + 4
    assert not [f for f in os.listdir(sweep) if f.endswith(".tmp")]


def _job_config(sweep, job_dir, mode=RunMode.MULTIRUN):
    return OmegaConf.create(
        {
            "hydra": {
                "mode": mode,
                "runtime": {"output_dir": str(job_dir)},
                "job": {"num": 0},
                "sweep": {"dir": str(sweep), "subdir": job_dir.name},
            }
        }
    )


def test_callback_records_a_failed_job_and_rewrites_the_summary(tmp_path, capsys):
    job = _job(tmp_path, 0, ["optimizer=sgd"])
    error = RuntimeError("a bug")  # a user error is recorded by the job itself (hybridrec.train)
    SweepSummary().on_job_end(_job_config(tmp_path, job), JobReturn(status=JobStatus.FAILED, _return_value=error))
    assert json.loads((job / FAILED_FILE).read_text()) == {"error": "RuntimeError: a bug"}
    assert "| 0 | failed |" in (tmp_path / "summary.md").read_text()
    assert capsys.readouterr().err == (
        f"hybridrec: job 0 failed; the sweep goes on, and its rows so far are in {tmp_path}/summary.md\n"
    )
    # a single run (no -m) has no sweep: nothing is written
    single = _job(tmp_path / "run", 0, ["optimizer=sgd"])
    SweepSummary().on_job_end(
        _job_config(tmp_path / "run", single, RunMode.RUN), JobReturn(status=JobStatus.FAILED, _return_value=error)
    )
    assert not (single / FAILED_FILE).exists() and not (tmp_path / "run" / "summary.md").exists()


def test_multirun_end_prints_the_table(sweep, capsys):
    SweepSummary().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}}))
    out = capsys.readouterr().out
    assert f"hybridrec: sweep summary in {sweep}/summary.md (and summary.csv)" in out
    assert out.strip().endswith((sweep / "summary.md").read_text().strip())


def test_callback_finds_the_sweep_dir_of_a_nested_subdir(tmp_path):
    # a '/' in an override's value (not excluded from override_dirname) nests the job directory
    subdir = "0_data.path=/tmp/x"
    job = tmp_path / "0_data.path=" / "tmp" / "x"
    (job / ".hydra").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(["data.path=/tmp/x"]), job / ".hydra" / "overrides.yaml")
    config = OmegaConf.create(
        {
            "hydra": {
                "mode": RunMode.MULTIRUN,
                "runtime": {"output_dir": str(job)},
                "sweep": {"dir": "unused", "subdir": subdir},
            }
        }
    )
    SweepSummary().on_job_end(config, JobReturn(status=JobStatus.COMPLETED, _return_value=0.5))
    assert (tmp_path / "summary.csv").exists()


def test_one_line_error():
    report = "\n============\nhybridrec.run.rank.run FAILED\n------------\nFailures:\n  <NO_OTHER_FAILURES>"
    assert one_line(RuntimeError(report)) == "RuntimeError: hybridrec.run.rank.run FAILED"
