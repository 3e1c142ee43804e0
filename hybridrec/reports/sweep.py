"""The summary of a multirun: one row per job, in ``summary.csv`` and ``summary.md`` of the
sweep directory, and the table on the terminal.

``SweepSummary`` is a Hydra callback (``hydra.callbacks`` in conf/config.yaml), so it works
with every launcher: the basic one, joblib, submitit (local or Slurm). A row comes from the
job's own directory: its overrides (``.hydra/overrides.yaml``, written by Hydra for every
job it starts) and the trainer's ``summary.json`` (the validation objective and metrics,
samples/s, peak memory, dense parameters, and the test metrics, which are reported but never
chosen on). A job that failed is a row too, with its status and error: Hydra's
sweepers stop at a failed job's exception before ``on_multirun_end``, so the files are also
rewritten as each job ends, and the failure is recorded then.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.utils import JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from hybridrec.base.compat import failed_job_error

FAILED_FILE = "failed.json"
"""Written into a job's directory when its job function raised: the one-line error."""

# Columns after the swept keys, the objective and the validation metrics; (csv name, markdown heading).
RUN_COLUMNS = [
    ("samples_per_second", "samples/s"),
    ("peak_rss_mb", "peak RSS MB (max rank)"),
    ("dense_parameters", "dense params"),
]
# In summary.csv only: what is the same for most sweeps, for scripts that compare them.
CSV_ONLY = ["train_loss", "steps", "global_batch_size", "world_size", "wall_time_s"]
# Counts, and the data's own click rate: not a model's quality.
_NOT_METRICS = ("n", "ctr", "queries", "queries_with_relevant")


def record_failure(job_dir: str, message: str) -> None:
    """A job that stopped on a user error and returned the worst objective value: its row
    in the summary says failed, with the one line."""
    with open(os.path.join(job_dir, FAILED_FILE), "w") as f:
        json.dump({"error": message}, f)


@dataclass
class Job:
    """One job of a sweep, as its directory records it."""

    dir: str
    """Relative to the sweep directory."""
    num: Optional[int]
    overrides: list[str]
    status: str
    """ok (summary.json written), failed (the job raised), or unfinished (neither: still
    running, killed, or timed out)."""
    summary: dict[str, Any] = field(default_factory=dict)
    error: str = ""


def read_jobs(sweep_dir: str) -> list[Job]:
    """Every job directory under ``sweep_dir`` (the ones holding ``.hydra/overrides.yaml``),
    in job order."""
    jobs = []
    for root, dirs, _files in os.walk(sweep_dir):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))  # .submitit: logs and pickles
        if not os.path.isfile(os.path.join(root, ".hydra", "overrides.yaml")):
            continue
        dirs[:] = []  # a job's own folders (tensorboard, profile) hold no jobs
        jobs.append(_read_job(sweep_dir, root))
    return sorted(jobs, key=lambda j: (j.num is None, j.num or 0, j.dir))


def _read_job(sweep_dir: str, job_dir: str) -> Job:
    overrides = [str(o) for o in OmegaConf.load(os.path.join(job_dir, ".hydra", "overrides.yaml"))]
    hydra_yaml = os.path.join(job_dir, ".hydra", "hydra.yaml")
    num = OmegaConf.load(hydra_yaml).hydra.job.get("num") if os.path.isfile(hydra_yaml) else None
    job = Job(os.path.relpath(job_dir, sweep_dir), num, overrides, "unfinished")
    if os.path.isfile(path := os.path.join(job_dir, "summary.json")):
        with open(path) as f:
            job.summary, job.status = json.load(f), "ok"
    elif os.path.isfile(path := os.path.join(job_dir, FAILED_FILE)):
        with open(path) as f:
            job.error, job.status = json.load(f)["error"], "failed"
    return job


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _override_values(overrides: list[str]) -> dict[str, str]:
    """Each override's key as written (``+``/``~`` kept) and its value ("" for a bare key)."""
    return {key: value for key, _, value in (o.partition("=") for o in overrides)}


def swept_keys(jobs: list[Job]) -> list[str]:
    """The override keys whose value is not the same in every job, in first-seen order."""
    per_job = [_override_values(j.overrides) for j in jobs]
    keys = list(dict.fromkeys(k for d in per_job for k in d))
    return [k for k in keys if len({d.get(k) for d in per_job}) > 1]


def metric_names(jobs: list[Job], split: str = "valid") -> list[str]:
    """The metrics of ``split`` (``valid``, or ``eval``: the test split) any job reports (AUC,
    NE, log loss, ranking metrics...), in the order the trainer writes them."""
    names = [
        k
        for j in jobs
        for k, v in j.summary.get(split, {}).items()
        if isinstance(v, (int, float)) and k not in _NOT_METRICS
    ]
    return list(dict.fromkeys(names))


def objective_of(job: Job) -> tuple[str, str, Optional[float]]:
    """(name, direction, value) of a job's objective (``summary.json``'s ``objective``; the
    train loss, minimized, for a summary without one); value None unless the job is ok."""
    o = job.summary.get("objective") or {
        "name": "train_loss",
        "direction": "minimize",
        "value": job.summary.get("train_loss"),
    }
    return o["name"], o["direction"], o["value"] if job.status == "ok" else None


def _objective_value(job: Job) -> float:
    """The objective value of a finished job (one of ``done`` below: not None)."""
    value = objective_of(job)[2]
    assert value is not None
    return value


def chosen(jobs: list[Job]) -> Optional[Job]:
    """The job whose validation objective is best, the one a sweeper reports (None: no job
    finished). Ties go to the lower job number, as Optuna's best trial."""
    done = [j for j in jobs if (v := objective_of(j)[2]) is not None and not math.isnan(v)]
    if not done:
        return None
    sign = -1.0 if objective_of(done[0])[1] == "maximize" else 1.0
    return min(done, key=lambda j: (sign * _objective_value(j), j.num or 0))


def ranked(jobs: list[Job]) -> list[Job]:
    """Finished jobs best first by the objective, then the failed and unfinished ones, in
    job order."""
    done = [j for j in jobs if (v := objective_of(j)[2]) is not None and not math.isnan(v)]
    rest = [j for j in jobs if j not in done]
    if done:
        sign = -1.0 if objective_of(done[0])[1] == "maximize" else 1.0
        done.sort(key=lambda j: (sign * _objective_value(j), j.num or 0))
    return done + rest


def rows(jobs: list[Job]) -> tuple[list[str], list[dict[str, Any]]]:
    """The swept keys and one dict per job, best first: job, status, each swept key, the
    objective and whether it is the chosen job, the validation metrics, the run columns, the
    test metrics (``test_`` columns: for reading, never for choosing), the CSV-only columns,
    the overrides, the directory and the error."""
    swept, valid, test = swept_keys(jobs), metric_names(jobs, "valid"), metric_names(jobs, "eval")
    best = chosen(jobs)
    out = []
    for j in ranked(jobs):
        s = j.summary
        values = _override_values(j.overrides)
        name, direction, value = objective_of(j)
        row: dict[str, Any] = {"job": j.num, "status": j.status}
        row |= {_key(k): values.get(k, "") for k in swept}
        row |= {
            "objective": value,
            "chosen": "yes" if j is best else "",
            "objective_name": name,
            "direction": direction,
        }
        row |= {f"valid_{m}": s.get("valid", {}).get(m) for m in valid}
        row |= {
            "samples_per_second": s.get("samples_per_second"),
            "peak_rss_mb": max(s["peak_rss_mb"]) if s.get("peak_rss_mb") else None,
            "dense_parameters": s.get("dense_parameters"),
        }
        row |= {f"test_{m}": s.get("eval", {}).get(m) for m in test}
        row |= {k: s.get(k) for k in CSV_ONLY}
        row |= {"best_step": (s.get("objective") or {}).get("best_step")}
        row |= {"overrides": " ".join(j.overrides), "dir": j.dir, "error": j.error}
        out.append(row)
    return [_key(k) for k in swept], out


def to_csv(jobs: list[Job]) -> str:
    _, table = rows(jobs)
    buf = io.StringIO()
    if table:
        writer = csv.DictWriter(buf, fieldnames=list(table[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows({k: "" if v is None else v for k, v in r.items()} for r in table)
    return buf.getvalue()


def to_markdown(jobs: list[Job]) -> str:
    """A markdown table for choosing (written by hand: tabulate is not a dependency, and the
    format is ten lines), preceded by the overrides every job shares: the jobs best first by
    the validation objective, the chosen one marked, then the validation metrics. The test
    metrics are shown for the chosen job only, under the table (all of them are in the CSV,
    as test_ columns)."""
    swept, table = rows(jobs)
    if not table:
        return "No job directories (with .hydra/overrides.yaml) in this sweep.\n"
    common = [o for o in jobs[0].overrides if all(o in j.overrides for j in jobs) and _key(o) not in swept]
    name, direction = table[0]["objective_name"], table[0]["direction"]
    valid = [f"valid_{m}" for m in metric_names(jobs, "valid") if f"valid.{m}" != name]  # not twice
    objective = f"{name} ({'higher' if direction == 'maximize' else 'lower'} is better)"
    heads = [
        "job",
        "status",
        *swept,
        objective,
        *(k.replace("_", " ", 1) for k in valid),
        *(h for _, h in RUN_COLUMNS),
        "dir",
    ]
    keys = ["job", "status", *swept, "objective", *valid, *(k for k, _ in RUN_COLUMNS), "dir"]
    if any(r["error"] for r in table):
        heads.append("error")
        keys.append("error")
    numeric = {"objective", *valid, *dict(RUN_COLUMNS)}
    lines = [f"Every job: `{' '.join(common)}`" if common else "Every job: the config's defaults", ""]
    lines.append("| " + " | ".join(heads) + " |")
    lines.append("|" + "|".join("---:" if k in numeric else "---" for k in keys) + "|")
    for r in table:
        cells = [_swept(r[k]) if k in swept else _cell(k, r[k]) for k in keys]
        if r["chosen"]:
            cells[keys.index("objective")] = f"**{cells[keys.index('objective')]}** (chosen)"
        lines.append("| " + " | ".join(cells) + " |")
    best = chosen(jobs)
    if best is not None:
        o = best.summary.get("objective") or {}
        where = f" at step {o['best_step']}" if o.get("best_step") is not None else ""
        kept = f", checkpoint {o['best_checkpoint']}" if o.get("best_checkpoint") else ""
        test = best.summary.get("eval", {})
        scored = "  ".join(f"{m} {test[m]:.4f}" for m in metric_names([best], "eval") if m in test)
        lines += [
            "",
            f"Chosen on validation: job {best.num} ({name} {objective_of(best)[2]:.4f}{where}{kept}). "
            f"Its test metrics, scored once at the end: {scored}",
        ]
    return "\n".join(lines) + "\n"


def _swept(value: str) -> str:
    """A swept value as the table shows it: a search sweeper's float to 4 significant
    digits (the CSV keeps every digit)."""
    try:
        return f"{float(value):.4g}" if any(c in value for c in ".e") else _cell("", value)
    except ValueError:
        return _cell("", value)


def _cell(key: str, value: Any) -> str:
    if value is None or value == "":
        return ""
    if key in ("samples_per_second", "peak_rss_mb", "dense_parameters"):
        return f"{value:,.0f}"
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def write_summary(sweep_dir: str) -> str:
    """Write summary.csv and summary.md into ``sweep_dir``; return the markdown. Each file
    is written whole and renamed into place: jobs of a parallel launcher may rewrite them at
    the same time, and a reader never sees half a file."""
    jobs = read_jobs(sweep_dir)
    markdown = to_markdown(jobs)
    for name, text in (("summary.csv", to_csv(jobs)), ("summary.md", markdown)):
        tmp = os.path.join(sweep_dir, f".{name}.{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, os.path.join(sweep_dir, name))
    return markdown


def one_line(error: BaseException) -> str:
    """The first non-empty line of an error's message (torch elastic's ChildFailedError
    spreads its report over many), after the exception's class name. A user error never gets
    here: the job records its own line (``record_failure``) and returns the worst value."""
    text = next((line.strip() for line in str(error).splitlines() if line.strip("=- ")), "")
    return f"{type(error).__name__}: {text}"


def _sweep_dir(config: DictConfig) -> str:
    """The sweep directory of a job's config: its output directory minus the sweep's subdir
    (resolved by Hydra for this job; it may hold '/' from an override's value)."""
    out, subdir = config.hydra.runtime.output_dir, config.hydra.sweep.subdir
    depth = len([p for p in str(subdir).split("/") if p])
    return os.path.abspath(os.path.join(out, *[".."] * depth))


class SweepSummary(Callback):
    """Hydra callback (hydra.callbacks.sweep_summary in conf/config.yaml)."""

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        # Runs where the job ran (this process, a joblib worker or a submitit job), also for
        # single runs, which have no sweep.
        if config.hydra.mode != RunMode.MULTIRUN:
            return
        failed = job_return.status == JobStatus.FAILED
        if failed:
            with open(os.path.join(config.hydra.runtime.output_dir, FAILED_FILE), "w") as f:
                json.dump({"error": one_line(failed_job_error(job_return))}, f)
        sweep_dir = _sweep_dir(config)
        write_summary(sweep_dir)
        if failed:
            # Hydra reports the error itself once the sweep ends, and then skips
            # on_multirun_end: say now where the rows are.
            print(
                f"hybridrec: job {config.hydra.job.num} failed; the sweep goes on, and its rows so far are in "
                f"{sweep_dir}/summary.md",
                file=sys.stderr,
                flush=True,
            )

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = os.path.abspath(config.hydra.sweep.dir)
        if not os.path.isdir(sweep_dir):  # no job was started
            return
        markdown = write_summary(sweep_dir)
        print(f"\nhybridrec: sweep summary in {sweep_dir}/summary.md (and summary.csv)\n{markdown}", flush=True)
