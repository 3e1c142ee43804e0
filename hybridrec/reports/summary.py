"""The run summary: the schema of ``summary.json`` (and of the blocks ``python -m
hybridrec.evaluate``'s ``metrics.json`` shares with it), the function that builds it from
what a run measured, and the final table rank 0 prints from it.

The schema is written once, here, as TypedDicts: what it describes is a JSON file, and its
readers (hybridrec.reports.sweep, benchmarks/, the tests, a user's scripts) get it back from
``json.load`` as plain dicts. A TypedDict is the type of that very dict, so the writer, the
table and the readers share one declaration with no to_dict/from_dict step that could drift
from the file, and an optional key is what it is in the file: absent (``NotRequired``).

It assembles numbers computed elsewhere (the metric formulas of ``hybridrec.reports.metrics``, the
step-time percentiles, memory peaks and profiler split of ``hybridrec.reports.profiling``). It has no collectives (the trainer gathers each rank's measurement), so
``run_summary`` is a pure function, tested without a process group.
"""

import hashlib
import platform
from dataclasses import dataclass
from typing import Any, Mapping, NotRequired, Optional, Sequence, TypedDict

import torch
from omegaconf import DictConfig, OmegaConf

from hybridrec.reports.metrics import format_eval
from hybridrec.reports.profiling import percentiles_ms

Metrics = dict[str, Any]
"""An evaluation's metrics block (``hybridrec.training.scoring.split_metrics``): ``auc`` and ``ctr``
always; ``ne``, ``logloss``, ``calibration``, ``accuracy`` for calibrated losses; ``ndcg@k``,
``map``, ``recall@k``, ``queries``, ``queries_with_relevant`` for list sources; ``n``, the
rows scored. Its keys depend on the model and the source, hence a plain dict."""

EvalRecord = dict[str, Any]
"""One evaluation during training: ``step``, ``split``, then that split's Metrics."""


class Throughput(TypedDict):
    """How fast a run went: summary.json's ``train`` block and metrics.json's ``scoring``."""

    steps: int
    """Global batches done (training: all of them, a resumed run's earlier ones included)."""
    samples: int
    """Samples of those batches (training: steps x global batch; scoring: real rows, no padding)."""
    wall_time_s: float
    """This process's time for them, in seconds, rounded to ms (training: evaluation excluded)."""
    samples_per_second: float
    """The samples this process timed over wall_time_s (a resumed run: its own steps only)."""


class TrainBlock(Throughput):
    """summary.json's ``train``: the training's throughput, where it resumed, its step times."""

    resumed_from_step: int
    """Steps done before this process started, restored from a checkpoint (0: a fresh run)."""
    step_time_p50_ms: NotRequired[float]
    """Median host wall time of this process's steps; absent when it ran none."""
    step_time_p95_ms: NotRequired[float]
    """95th percentile of the same; absent when it ran none."""
    first_steps_s: NotRequired[float]
    """Host wall time of this process's first ``WARMUP_STEPS`` steps (tracing, lazy
    initialization, first all-gathers and pipeline fill); absent when it ran no more."""
    steady_samples_per_second: NotRequired[float]
    """Global batch over the mean host time of the steps after those: the rate the run
    settles at. ``samples_per_second`` is the whole run's (first steps, logging and saves
    included): what a short run or a sweep job sees."""


class ResumedFrom(TypedDict):
    path: str
    """The checkpoint directory the run resumed from (absolute)."""
    step: int
    """The step that checkpoint was saved at."""


class Versions(TypedDict):
    python: str
    """The interpreter's version."""
    torch: str
    """torch.__version__ (its build suffix included: +cpu, +cu128)."""
    torchrec: str
    """torchrec.__version__."""
    fbgemm_gpu: Optional[str]
    """fbgemm-gpu-cpu's or fbgemm-gpu's version; None when neither is installed."""
    hydra: str
    """hydra.__version__."""
    hybridrec: Optional[str]
    """None when the package runs from a tree that was not installed."""


class Provenance(TypedDict):
    """What a result came from (summary.json and metrics.json alike)."""

    resumed_from: Optional[ResumedFrom]
    """The checkpoint this run resumed, or None (a fresh run, or an evaluation)."""
    config_sha256: str
    """Hash of the resolved config, keys sorted: equal hashes, equal settings."""
    versions: Versions
    """The libraries' versions."""


class MemoryRow(TypedDict):
    """One rank's memory: the planner's estimate beside what the rank measured."""

    rank: int
    """The rank, as the plan numbers it."""
    est_device_mb: float
    """The planner's device (HBM) estimate for the rank's tables, MiB (0 on CPU)."""
    est_host_mb: float
    """The planner's host (DDR) estimate for the rank's tables, MiB."""
    peak_rss_mb: float
    """The rank's peak resident memory, MiB."""
    peak_device_allocated_mb: NotRequired[float]
    """On GPU: torch's peak allocated device memory (tensors), MiB."""
    peak_device_reserved_mb: NotRequired[float]
    """On GPU: torch's peak reserved device memory (held from the driver), MiB."""


class Profile(TypedDict):
    """One rank's profiled steps (``hybridrec.reports.profiling.comm_compute_split`` and ``step_breakdown``)."""

    rank: int
    """The rank that measured it."""
    profiled_steps: int
    """Steps in the window (profile.steps)."""
    profiled_ms: float
    """The profiled steps' wall time (union of their spans)."""
    comm_ms: float
    """Time during which a collective ran, overlapped or not."""
    compute_ms: float
    """profiled_ms - comm_ms."""
    comm_share: float
    """comm_ms / profiled_ms."""
    comm_ms_by_kind: dict[str, float]
    """comm_ms per kind of collective (embedding all-to-all, FSDP2 all-gather, ...)."""
    breakdown_ms: dict[str, float]
    """Milliseconds per step in each phase of ``hybridrec.reports.profiling.BREAKDOWN_PHASES``."""


class ObjectiveBlock(TypedDict):
    """The run judged by its objective (``train.objective``): what a sweep job returns."""

    name: str
    """``valid.<metric>``, or ``train_loss`` when the source has no validation split."""
    direction: str
    """minimize or maximize."""
    value: float
    """The returned value: the best validation value with ``checkpoint.keep_best`` (the model
    the test split was scored with), else the final model's."""
    best_step: Optional[int]
    """The step of the best validation evaluation (None: no validation)."""
    best_value: Optional[float]
    """Its value."""
    best_checkpoint: Optional[str]
    """With ``checkpoint.keep_best``: the checkpoint kept for it, whose weights the final
    evaluation scored."""
    stopped_early_at: Optional[int]
    """The step early stopping ended the run at (``train.early_stop_patience``), else None."""
    early_stop_patience: int
    """``train.early_stop_patience``: evaluations without improvement that stop the run (0: off)."""


class ReferenceResult(TypedDict):
    """A known score of the experiment (``train.references``) beside the run's own: how far
    the run is from what it should reach."""

    name: str
    """What scored it: ``planted model`` (the synthetic generator's own probabilities),
    ``logistic regression``, ..."""
    metric: str
    """``valid.<metric>`` or ``eval.<metric>`` (the test split)."""
    value: float
    """The reference's score."""
    source: str
    """Where the value was measured (a benchmark script or results file)."""
    run_value: Optional[float]
    """The run's final score on the same split and metric (None: the run does not report it)."""
    difference: Optional[float]
    """run_value - value (None with run_value)."""


class RunSummary(TypedDict):
    """``summary.json``, in the order its keys are written; the same on every rank except
    ``plan`` and ``memory_per_rank``, which only rank 0 (holding the plan report) fills."""

    world_size: int
    """Ranks in the job."""
    device: str
    """This rank's device (rank 0's in the file): ``cpu``, ``cuda:0``."""
    dense_parallel: str
    """How the dense layers were parallelized (mesh.dense: fsdp, ddp, hsdp; single on one rank
    unless FSDP2's mixed precision or offload is asked for: parallelize.dense_mode)."""
    steps: int
    """The headline numbers, at the top for scripts: ``train``'s own steps, ..."""
    wall_time_s: float
    """... its wall_time_s ..."""
    samples_per_second: float
    """... and its samples_per_second."""
    global_batch_size: int
    """Samples per step over all ranks (data.batch_size)."""
    train_loss: float
    """Mean global training loss over the last 10% of steps (at least the last one)."""
    objective: ObjectiveBlock
    """The validation objective and where its best was found."""
    references: list[ReferenceResult]
    """The experiment's references (``train.references``) beside the run's scores; empty
    when it declares none."""
    resumes: list[ResumedFrom]
    """Every resume of the training, oldest first: the step and the checkpoint it went on
    from (metrics.jsonl's ``resume`` records); empty for a training never interrupted."""
    dense_parameters: int
    """Parameters outside the embedding tables, the whole model's on any world size."""
    train: TrainBlock
    """The training's throughput, resume point and step times."""
    eval: Metrics
    """The test split, scored once, at the end (with checkpoint.keep_best: the best checkpoint's weights)."""
    valid: NotRequired[Metrics]
    """The validation split at the end, when the source has one (of the same weights)."""
    eval_history: list[EvalRecord]
    """Every evaluation during training and at the end, on validation when the source has it."""
    provenance: Provenance
    """The checkpoint resumed, the config's hash, the libraries' versions."""
    plan: dict[str, dict[str, Any]]
    """Per table, its placement and estimates (the ``tables`` of plan.json,
    ``hybridrec.parallel.sharding.plan_report``); empty on ranks other than 0."""
    peak_rss_mb: list[float]
    """Peak resident memory of every rank, MiB, in rank order."""
    memory_per_rank: list[MemoryRow]
    """The planner's estimate beside the measurement, per rank; empty on ranks other than 0."""
    profile: NotRequired[list[Optional[Profile]]]
    """With profile.enabled: every rank's profile, in rank order (None: the window was never reached)."""
    data: NotRequired[dict[str, Any]]
    """File sources: what was read (``hybridrec.data.ReadReport.to_dict``: rows, bad_rows,
    unreadable, files, dropped_tail_rows, collisions), summed over ranks."""
    freshness: NotRequired[dict[str, Any]]
    """train.schedule=continuous: each partition's progressive evaluation and counts, and
    their means (``hybridrec.training.continuous.freshness_summary``)."""


class _Valid(TypedDict, total=False):
    """RunSummary's ``valid`` alone: spread into the summary where the key belongs, when it is there."""

    valid: Metrics


class ScoreSummary(TypedDict):
    """``metrics.json`` of ``python -m hybridrec.evaluate``."""

    checkpoint: ResumedFrom
    """The checkpoint scored: its directory and step."""
    split: str
    """The split scored: eval (test) or valid."""
    eval: Metrics
    """The metrics block training reports, same keys."""
    world_size: int
    """Ranks that scored it."""
    device: str
    """This rank's device."""
    scoring: Throughput
    """steps: global batches scored; samples: real rows (padding excluded)."""
    provenance: Provenance
    """The config's hash and the libraries' versions (resumed_from: None)."""


@dataclass(frozen=True)
class RankMeasurement:
    """What one rank measured of itself, gathered to every rank for the summary."""

    peak_rss_mb: float
    """``hybridrec.reports.profiling.peak_rss_mb``, rounded to 0.1 MiB."""
    device_memory: dict[str, float]
    """``hybridrec.reports.profiling.peak_device_mb``: the GPU peaks, empty on CPU."""
    profile: Optional[Profile]
    """The rank's profile, None when profiling was off or its window never came."""


def throughput(steps: int, samples: int, wall_s: float, timed_samples: Optional[int] = None) -> Throughput:
    """The block a run reports about its own speed, training's ``summary.json`` and
    evaluation's ``metrics.json`` alike: steps, samples, wall time and samples per second.
    ``timed_samples``: the samples ``wall_s`` measured when fewer than ``samples`` (a resumed
    run counts the steps before it, but timed only its own)."""
    timed = samples if timed_samples is None else timed_samples
    return {
        "steps": steps,
        "samples": samples,
        "wall_time_s": round(wall_s, 3),
        "samples_per_second": timed / wall_s if wall_s > 0 else 0.0,
    }


def provenance(cfg: DictConfig, resumed_from: Optional[ResumedFrom]) -> Provenance:
    """What a result came from: the checkpoint it resumed (path, step), the library versions,
    and a hash of the resolved config (equal hashes, same settings)."""
    from importlib.metadata import PackageNotFoundError, version

    import hydra
    import torchrec

    def installed(name: str) -> Optional[str]:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    resolved = OmegaConf.to_yaml(cfg, resolve=True, sort_keys=True)
    return {
        "resumed_from": resumed_from,
        "config_sha256": hashlib.sha256(resolved.encode()).hexdigest(),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torchrec": torchrec.__version__,
            "fbgemm_gpu": installed("fbgemm-gpu-cpu") or installed("fbgemm-gpu"),
            "hydra": hydra.__version__,
            "hybridrec": installed("hybridrec"),
        },
    }


WARMUP_STEPS = 10
"""Steps a process takes before its rate settles (``steady_samples_per_second``)."""


def run_summary(
    *,
    losses: Sequence[float],
    start_step: int,
    step_times: Sequence[float],
    global_batch_size: int,
    wall_s: float,
    final: Mapping[str, Metrics],
    eval_history: list[EvalRecord],
    world_size: int,
    device: str,
    dense_parallel: str,
    dense_parameters: int,
    provenance: Provenance,
    plan: Optional[dict[str, Any]],
    ranks: Sequence[RankMeasurement],
    profiled: bool,
    objective: Optional[ObjectiveBlock] = None,
    references: Sequence[Mapping[str, Any]] = (),
    resumes: Sequence[ResumedFrom] = (),
    data: Optional[dict[str, Any]] = None,
    freshness: Optional[dict[str, Any]] = None,
) -> RunSummary:
    """summary.json from what a run measured.

    ``losses``: the global mean loss of every step, a resumed run's earlier steps included;
    ``start_step``: the steps done before this process (their samples are not in its
    ``wall_s``); ``step_times``: this process's steps, seconds; ``wall_s``: this process's
    training time, evaluation excluded; ``final``: the metrics of the splits scored at the
    end (``eval``, and ``valid`` when the source has it); ``plan``: the plan report (rank
    0's; None on the other ranks); ``ranks``: every rank's measurement, in rank order;
    ``profiled``: profiling was on (the summary then has every rank's profile);
    ``objective``: the run's objective block (None: the train loss, minimized);
    ``references``: the experiment's ``train.references`` (name, metric, value, source),
    each compared with ``final``; ``resumes``: the training's resumes, oldest first; ``data``:
    the source's read report (file sources), or None; ``freshness``: a continuous run's
    progressive evaluations (``hybridrec.training.continuous.freshness_summary``), or None."""
    steps = len(losses)
    tail = losses[-max(1, steps // 10) :]
    train_loss = sum(tail) / len(tail)  # mean of the last 10% of steps
    objective = objective or {
        "name": "train_loss",
        "direction": "minimize",
        "value": train_loss,
        "best_step": None,
        "best_value": None,
        "best_checkpoint": None,
        "stopped_early_at": None,
        "early_stop_patience": 0,
    }
    run_samples = (steps - start_step) * global_batch_size  # timed by this process
    train: TrainBlock = {
        **throughput(steps, steps * global_batch_size, wall_s, run_samples),
        "resumed_from_step": start_step,
        **percentiles_ms(list(step_times)),
    }
    if len(step_times) > WARMUP_STEPS:
        rest = step_times[WARMUP_STEPS:]
        train["first_steps_s"] = float(sum(step_times[:WARMUP_STEPS]))
        train["steady_samples_per_second"] = global_batch_size * len(rest) / sum(rest)
    rss = [m.peak_rss_mb for m in ranks]
    plan = plan or {"tables": {}, "ranks": []}  # the report lives on rank 0
    valid: _Valid = {"valid": final["valid"]} if "valid" in final else {}
    summary: RunSummary = {
        "world_size": world_size,
        "device": device,
        "dense_parallel": dense_parallel,
        # the headline numbers, at the top for scripts: the train block's own values
        "steps": train["steps"],
        "wall_time_s": train["wall_time_s"],
        "samples_per_second": train["samples_per_second"],
        "global_batch_size": global_batch_size,
        "train_loss": train_loss,
        "objective": objective,
        "references": [compare(ref, final) for ref in references],
        "resumes": list(resumes),
        "dense_parameters": dense_parameters,
        "train": train,
        "eval": final["eval"],  # the test split: scored once, at the end
        **valid,
        "eval_history": eval_history,  # on validation when the source has it
        "provenance": provenance,
        "plan": plan["tables"],
        "peak_rss_mb": rss,
        # the planner's estimate beside the measurement, per rank
        "memory_per_rank": [
            {
                "rank": r["rank"],
                "est_device_mb": round(r["est_device_bytes"] / 2**20, 1),
                "est_host_mb": round(r["est_host_bytes"] / 2**20, 1),
                "peak_rss_mb": rss[r["rank"]],
                **ranks[r["rank"]].device_memory,  # on GPU: torch's peak allocated / reserved
            }
            for r in plan["ranks"]
        ],
    }
    if profiled:
        summary["profile"] = [m.profile for m in ranks]
    if data is not None:
        summary["data"] = data
    if freshness is not None:
        summary["freshness"] = freshness
    return summary


def compare(reference: Mapping[str, Any], final: Mapping[str, Metrics]) -> ReferenceResult:
    """A reference (``train.references``) beside the run's final score on its split and metric."""
    split, metric = reference["metric"].split(".", 1)
    score = final.get(split, {}).get(metric)
    run_value = None if score is None else float(score)
    return {
        "name": reference["name"],
        "metric": reference["metric"],
        "value": float(reference["value"]),
        "source": reference["source"],
        "run_value": run_value,
        "difference": None if run_value is None else run_value - float(reference["value"]),
    }


def format_summary(s: RunSummary) -> str:
    """The final table rank 0 prints."""
    e, t = s["eval"], s["train"]
    rows = [
        ("world size / device", f"{s['world_size']} / {s['device']}, dense {s['dense_parallel']}"),
        ("steps / samples", f"{t['steps']:,} / {t['samples']:,}"),
        # a resumed run timed only its own steps: its wall time and rate say which
        (
            "wall time",
            f"{t['wall_time_s']:.1f} s"
            + (f" (this run's steps {t['resumed_from_step'] + 1}-{t['steps']})" if t["resumed_from_step"] else ""),
        ),
        (
            "samples/s",
            f"{t['samples_per_second']:,.0f}"
            + (
                f" (after the first {WARMUP_STEPS} steps: {t['steady_samples_per_second']:,.0f})"
                if "steady_samples_per_second" in t
                else ""
            ),
        ),
        ("step time p50 / p95", f"{t.get('step_time_p50_ms', 0):.1f} / {t.get('step_time_p95_ms', 0):.1f} ms"),
        ("train loss (last 10%)", f"{s['train_loss']:.4f}"),
        ("objective", _format_objective(s["objective"])),
        *((f"vs {r['name']}", _format_reference(r)) for r in s["references"]),
        *(
            [("resumed", ", ".join(f"at step {r['step']} from {r['path']}" for r in s["resumes"]))]
            if s["resumes"]
            else []
        ),
        *([("progressive (after day 1)", _format_freshness(s["freshness"]))] if "freshness" in s else []),
        *([("valid", format_eval(s["valid"]))] if "valid" in s else []),
        ("eval (test)" if "valid" in s else "eval", format_eval(e)),
        ("peak RSS per rank", ", ".join(f"{m:,.0f} MB" for m in s["peak_rss_mb"])),
    ]
    gpu = [r for r in s.get("memory_per_rank", []) if "peak_device_allocated_mb" in r]
    if gpu:  # the planner's device estimate beside what the ranks used
        rows.append(
            (
                "GPU peak allocated / planned",
                ", ".join(f"{r['peak_device_allocated_mb']:,.0f} / {r['est_device_mb']:,.0f} MB" for r in gpu),
            )
        )
    if "profile" in s:
        # None: a resumed run that ended before its profiling window came
        shares = ", ".join(f"{p['comm_share']:.0%}" if p else "not reached" for p in s["profile"])
        rows.append(("comm share of step time per rank", shares))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def _format_freshness(f: dict[str, Any]) -> str:
    """A continuous run's progressive scores: trained partitions and scored-only ones apart."""
    parts = []
    for key, what in (("mean_trained", "trained"), ("mean_scored_only", "scored only")):
        m = f[key]
        if m.get("auc") is not None:
            n = sum(1 for r in f["partitions"][1:] if "eval" in r and r["trained"] == (key == "mean_trained"))
            parts.append(
                f"{what} ({n}): AUC {m['auc']:.4f}" + (f", NE {m['ne']:.4f}" if m.get("ne") is not None else "")
            )
    return "; ".join(parts) or "no partition scored after the first"


def _format_objective(o: ObjectiveBlock) -> str:
    line = f"{o['name']} {o['value']:.4f} ({o['direction']})"
    if o["best_step"] is not None:
        line += f", best {o['best_value']:.4f} at step {o['best_step']}"
    if o["best_checkpoint"]:
        line += f", kept in {o['best_checkpoint']} (the final evaluation's weights)"
    if o["stopped_early_at"] is not None:
        line += f", stopped early at step {o['stopped_early_at']} (patience {o['early_stop_patience']})"
    return line


def _format_reference(r: ReferenceResult) -> str:
    split = "test" if r["metric"].startswith("eval.") else "valid"
    ours = (
        "not reported by this run"
        if r["run_value"] is None
        else f"this run {r['run_value']:.4f} ({r['difference']:+.4f})"
    )
    return f"{r['metric']} {r['value']:.4f} on {split} ({r['source']}); {ours}"


def headline(s: RunSummary) -> str:
    """The run in one line: steps, speed, train loss, the objective and where it was best,
    an early stop, the references, the test score."""
    o = s["objective"]
    start = s["train"]["resumed_from_step"]
    line = (
        f"{s['steps']} steps"
        + (f" (resumed at {start})" if start else "")
        + f", {s['samples_per_second']:,.0f} samples/s, train loss {s['train_loss']:.4f}, "
        f"{o['name']} {o['value']:.4f}"
    )
    if o["best_step"] is not None:
        line += f" (best at step {o['best_step']})"
    if o["stopped_early_at"] is not None:
        line += f", stopped early at step {o['stopped_early_at']}"
    for r in s["references"]:  # the ones on the objective's own metric; the table has them all
        if r["difference"] is not None and r["metric"] == o["name"]:
            line += f", {r['metric']} {r['difference']:+.4f} vs {r['name']}"
    return line + f", eval {format_eval(s['eval'])}"
