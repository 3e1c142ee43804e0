"""The summary of a multirun: one row per job, in ``summary.csv`` and ``summary.md`` of the
sweep directory, and the table on the terminal.

``SweepSummary`` is a Hydra callback (``hydra.callbacks`` in conf/config.yaml), so it works
with every launcher: the basic one, joblib, submitit (local or Slurm). A row comes from the
job's own directory: its overrides (``.hydra/overrides.yaml``, written by Hydra for every
job it starts) and the trainer's ``summary.json`` (test metrics, samples/s, peak memory,
dense parameters). A job that failed is a row too, with its status and error: Hydra's
sweepers stop at a failed job's exception before ``on_multirun_end``, so the files are also
rewritten as each job ends, and the failure is recorded then.
"""

from __future__ import annotations

import csv
import io
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.utils import JobStatus
from hydra.errors import CompactHydraException
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from hybridrec.compat import failed_job_error

FAILED_FILE = "failed.json"
"""Written into a job's directory when its job function raised: the one-line error."""

# Columns after the swept keys and the test metrics; (csv name, markdown heading).
RUN_COLUMNS = [
    ("samples_per_second", "samples/s"),
    ("peak_rss_mb", "peak RSS MB (max rank)"),
    ("dense_parameters", "dense params"),
]
# In summary.csv only: what is the same for most sweeps, for scripts that compare them.
CSV_ONLY = ["train_loss", "steps", "global_batch_size", "world_size", "wall_time_s"]
# Counts, and the data's own click rate: not a model's quality.
_NOT_METRICS = ("n", "ctr", "queries", "queries_with_relevant")


class JobFailed(CompactHydraException):
    """A job of a multirun stopped by a user error (a bad config, bad input, a checkpoint it
    refuses): Hydra records the job as failed and runs the others, and reports the message in
    one line, without a traceback (a CompactHydraException)."""


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
    for root, dirs, files in os.walk(sweep_dir):
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


def swept_keys(jobs: list[Job]) -> list[str]:
    """The override keys whose value is not the same in every job, in first-seen order."""
    per_job = [dict(o.split("=", 1) if "=" in o else (o, "") for o in j.overrides) for j in jobs]
    keys = list(dict.fromkeys(k for d in per_job for k in d))
    return [k for k in keys if len({d.get(k) for d in per_job}) > 1]


def metric_names(jobs: list[Job]) -> list[str]:
    """The test-split metrics any job reports (AUC, NE, log loss, ranking metrics...), in the
    order the trainer writes them."""
    names = [k for j in jobs for k, v in j.summary.get("eval", {}).items()
             if isinstance(v, (int, float)) and k not in _NOT_METRICS]
    return list(dict.fromkeys(names))


def rows(jobs: list[Job]) -> tuple[list[str], list[dict[str, Any]]]:
    """The swept keys and one dict per job: job, status, each swept key, the metrics, the
    run columns, the CSV-only columns, the overrides, the directory and the error."""
    swept, metrics = swept_keys(jobs), metric_names(jobs)
    out = []
    for j in jobs:
        s = j.summary
        values = dict(o.split("=", 1) if "=" in o else (o, "") for o in j.overrides)
        row: dict[str, Any] = {"job": j.num, "status": j.status}
        row |= {_key(k): values.get(k, "") for k in swept}
        row |= {m: s.get("eval", {}).get(m) for m in metrics}
        row |= {
            "samples_per_second": s.get("samples_per_second"),
            "peak_rss_mb": max(s["peak_rss_mb"]) if s.get("peak_rss_mb") else None,
            "dense_parameters": s.get("dense_parameters"),
        }
        row |= {k: s.get(k) for k in CSV_ONLY}
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
    """A markdown table (written by hand: tabulate is not a dependency, and the format is
    ten lines), preceded by the overrides every job shares."""
    swept, table = rows(jobs)
    if not table:
        return "No job directories (with .hydra/overrides.yaml) in this sweep.\n"
    common = [o for o in jobs[0].overrides if all(o in j.overrides for j in jobs) and _key(o) not in swept]
    metrics = metric_names(jobs)
    heads = ["job", "status", *swept, *metrics, *(h for _, h in RUN_COLUMNS), "dir"]
    keys = ["job", "status", *swept, *metrics, *(k for k, _ in RUN_COLUMNS), "dir"]
    if any(r["error"] for r in table):
        heads.append("error")
        keys.append("error")
    lines = [f"Every job: `{' '.join(common)}`" if common else "Every job: the config's defaults", ""]
    lines.append("| " + " | ".join(heads) + " |")
    lines.append("|" + "|".join("---:" if k in metrics or k in dict(RUN_COLUMNS) else "---" for k in keys) + "|")
    for r in table:
        lines.append("| " + " | ".join(_cell(k, r[k]) for k in keys) + " |")
    return "\n".join(lines) + "\n"


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
    spreads its report over many), after the exception's class name for anything but a
    JobFailed, whose message is already the user's line."""
    text = next((line.strip() for line in str(error).splitlines() if line.strip("=- ")), "")
    return text if isinstance(error, JobFailed) else f"{type(error).__name__}: {text}"


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
            print(f"hybridrec: job {config.hydra.job.num} failed; the sweep goes on, and its rows so far are in "
                  f"{sweep_dir}/summary.md", file=sys.stderr, flush=True)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = os.path.abspath(config.hydra.sweep.dir)
        if not os.path.isdir(sweep_dir):  # no job was started
            return
        markdown = write_summary(sweep_dir)
        print(f"\nhybridrec: sweep summary in {sweep_dir}/summary.md (and summary.csv)\n{markdown}", flush=True)
