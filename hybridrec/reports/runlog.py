"""A run's output files as it goes: ``metrics.jsonl`` (and TensorBoard events), JSON files
written whole, and ``report.png``, the loss and evaluation curves. (summary.json's schema is
``hybridrec.reports.summary``.)

A resumed run's outputs hold the whole training: every checkpoint carries the records of
metrics.jsonl up to its step (``TrainState.history``), and a run resumed from it writes
them first, then a ``{"event": "resume", "step": N, "path": <checkpoint>}`` record, then its
own. The checkpoint is the source, not an earlier run directory: that may be gone, and it
may hold steps after the checkpoint, which the resumed run trains again."""

from __future__ import annotations

import json
import os
from typing import Any, Optional

from hybridrec.reports.summary import ObjectiveBlock, ReferenceResult, ResumedFrom, RunSummary


def write_json(path: str, obj: Any) -> None:
    """Write through a temporary file and rename, so a reader never sees half a file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, path)


RESUME = "resume"
"""The ``event`` of the record a resumed run writes after the history it continues."""


def resume_record(step: int, path: str) -> dict[str, Any]:
    """metrics.jsonl's mark of a resume: training went on after ``step`` from checkpoint ``path``."""
    return {"event": RESUME, "step": step, "path": path}


def resumes(records: list[dict[str, Any]]) -> list[ResumedFrom]:
    """The resumes of a history, oldest first: ``{"step", "path"}`` each."""
    return [{"step": r["step"], "path": r["path"]} for r in records if r.get("event") == RESUME]


def evaluations(records: list[dict[str, Any]], split: str) -> list[dict[str, Any]]:
    """The evaluations of ``split`` in a history, as summary.json's ``eval_history`` lists them."""
    return [
        {"step": r["step"], "split": split, **r["eval"]} for r in records if r.get("split") == split and "eval" in r
    ]


class MetricsLog:
    """``metrics.jsonl``: one JSON object per logged step, per eval and per resume, for
    scripts; the same scalars as TensorBoard events when ``tensorboard_dir`` is given. Rank 0
    only. The file is written anew: a run's history is what it trained, its resumed part
    included (``replay``), so a restart in the same run directory leaves no step twice."""

    def __init__(self, path: Optional[str], tensorboard_dir: Optional[str] = None) -> None:
        self._f = open(path, "w") if path else None
        self._tb = None
        if path and tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter  # optional dependency

            # purge_step=0: TensorBoard hides the events of earlier writers in this directory
            # from step 0 on (a restart in the same run directory), as the file above forgets them
            self._tb = SummaryWriter(tensorboard_dir, purge_step=0)
        self.records: list[dict[str, Any]] = []

    def replay(self, history: list[dict[str, Any]], step: int, path: str) -> None:
        """Write the ``history`` a checkpoint carries (its records up to ``step``), then the mark
        of this resume from it (at ``path``)."""
        for record in history:
            self.log(**record)
        self.log(**resume_record(step, path))

    def log(self, **record: Any) -> None:
        if not self._f:
            return
        self.records.append(record)
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()
        if self._tb and record.get("event") == RESUME:
            self._tb.add_text("events", f"resumed from {record['path']}", record["step"])
        elif self._tb:
            # an evaluation's metrics go under its split's tag (valid/auc, test/auc,
            # progressive/auc): one tag for every split would hold two values at one step
            split = "test" if record.get("split") == "eval" else record.get("split")
            for key, value in _flatten({k: v for k, v in record.items() if k != "split"}).items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    if split and key.startswith("eval/"):
                        key = f"{split}/{key[5:]}"
                    self._tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        if self._f:
            self._f.close()
        if self._tb:
            self._tb.close()


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = v
    return out


def plot_report(records: list[dict[str, Any]], path: str, summary: Optional[RunSummary] = None) -> None:
    """report.png: training loss, the objective (its best step, an early stop, the
    references on its metric), eval AUC and NE, and samples/s over the steps of the whole
    training; a resume is a dotted vertical line in each panel. ``summary``: the run's
    summary.json, whose objective and references the plot marks (None: curves only)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    train = [r for r in records if "loss" in r]
    # The curve is the split evaluated during training (validation when there is one); the
    # test split, scored once at the end, is its own marker.
    splits = {r.get("split", "eval") for r in records if "eval" in r}
    curve = "valid" if "valid" in splits else "eval"
    evals = [r for r in records if "eval" in r and r.get("split", "eval") == curve]
    test = [r for r in records if "eval" in r and r.get("split", "eval") == "eval"] if curve == "valid" else []
    progressive = [r for r in records if r.get("split") == "progressive" and "eval" in r]
    objective = summary["objective"] if summary else None
    references = summary.get("references", []) if summary else []
    # the objective's own panel: a validation metric (not the train loss, not a progressive mean)
    judged = (
        objective is not None
        and objective["name"].startswith("valid.")
        and bool(evals)
        and objective["name"][6:] in evals[0]["eval"]
    )
    panels = 3 + judged + bool(progressive)
    fig, all_axes = plt.subplots(1, panels, figsize=(5 * panels, 4.8))  # room for the legends below
    # a continuous run's headline, its progressive metric per day, comes first
    axes = list(all_axes[1:]) if progressive else list(all_axes)
    ax_loss, ax_eval, ax_rate = axes[0], axes[1 + judged], axes[2 + judged]
    if progressive:
        _plot_freshness(all_axes[0], progressive)
    ax_loss.plot([r["step"] for r in train], [r["loss_mean"] for r in train], color="tab:blue")
    ax_loss.set(title="training loss (global, mean per log window)", xlabel="step", ylabel="loss")
    if judged:
        assert objective is not None  # judged: there is an objective
        _plot_objective(axes[1], objective, evals, test, references)
    if evals:
        steps = [r["step"] for r in evals]
        # AUC where the scores are per row; a next-item run's is NDCG@10 over the catalogue
        head = "auc" if "auc" in evals[0]["eval"] else "ndcg@10"
        label = head.upper() if head == "auc" else "NDCG@10"
        weighted = " (tasks weighted)" if any(k.endswith(".auc") for k in evals[0]["eval"]) else ""
        ax_eval.plot(
            steps, [r["eval"][head] for r in evals], "o-", color="tab:green", label=f"{curve} {label}{weighted}"
        )
        for r in test:
            ax_eval.plot([r["step"]], [r["eval"][head]], "*", markersize=12, color="black", label=f"test {label}")
        # else drawn in the objective's panel (judged: objective is not None)
        if not (judged and objective is not None and objective["name"] == f"valid.{head}"):
            _plot_references(ax_eval, references, head)
        ax_eval.set(title="validation" if curve == "valid" else "eval", xlabel="step", ylabel=label)
        extra = []
        if "ne" in evals[0]["eval"]:  # calibrated (BCE) runs; no second axis for the others
            ax_ne = ax_eval.twinx()
            ax_ne.plot(steps, [r["eval"]["ne"] for r in evals], "s--", color="tab:red", label="NE")
            ax_ne.set_ylabel("NE (lower is better)")
            extra = ax_ne.lines
        # a multi-task run: each task's AUC beside the weighted one (the weighted NE has no meaning)
        tasks = [k for k in evals[0]["eval"] if k.endswith(".auc") and k.count(".") == 1]
        for key, style in zip(tasks, ("v-", "^-", "<-", ">-", "d-", "p-")):
            ax_eval.plot(steps, [r["eval"][key] for r in evals], style, alpha=0.8, label=f"{curve} {key[:-4]} AUC")
        ndcg = next((k for k in evals[0]["eval"] if k.startswith("ndcg")), None)
        if ndcg and head == "auc":  # ranking sources
            ax_eval.plot(steps, [r["eval"][ndcg] for r in evals], "^-", color="tab:purple", label=ndcg.upper())
            ax_eval.set_ylabel("AUC / NDCG")
        if len(evals) == 1:
            _one_evaluation(ax_eval, evals[0]["step"], evals[0]["eval"][head], label)
        _legend_below(ax_eval, ax_eval.lines + extra)
    else:  # a run stopped before its first validation (a continuous run scores it at the end)
        ax_eval.text(
            0.5,
            0.5,
            "no validation or test\nscored yet",
            ha="center",
            va="center",
            transform=ax_eval.transAxes,
            color="tab:gray",
        )
        ax_eval.set(title="validation", xticks=[], yticks=[])
    # samples/s is cumulative since the process started: each run of a resumed training is
    # its own segment, never one line across a restart
    bounds = [0] + [r["step"] for r in records if r.get("event") == RESUME] + [float("inf")]
    for lo, hi in zip(bounds, bounds[1:]):
        part = [r for r in train if lo < r["step"] <= hi]
        ax_rate.plot([r["step"] for r in part], [r["samples_per_second"] for r in part], color="tab:purple")
    ax_rate.set(title="throughput (cumulative, per run)", xlabel="step", ylabel="samples/s")
    for ax in axes:  # (not the freshness panel: its x axis is partitions, not steps)
        for i, step in enumerate(bounds[1:-1]):
            ax.axvline(step, color="gray", linestyle=":", label="resumed" if i == 0 and ax is ax_loss else None)
    if len(bounds) > 2:
        ax_loss.legend(loc="upper right", fontsize=8)
    for ax in all_axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_objective(
    ax: Any,
    objective: ObjectiveBlock,
    evals: list[dict[str, Any]],
    test: list[dict[str, Any]],
    references: list[ReferenceResult],
) -> None:
    """The objective's validation curve, its best step, an early stop, and the references on
    its metric: the panel that says whether the run is good."""
    metric = objective["name"][6:]
    ax.plot(
        [r["step"] for r in evals], [r["eval"][metric] for r in evals], "o-", color="tab:green", label=objective["name"]
    )
    for r in test:
        if metric in r["eval"]:
            ax.plot([r["step"]], [r["eval"][metric]], "*", markersize=12, color="black", label=f"test {metric}")
    if objective["best_step"] is not None:
        ax.plot(
            [objective["best_step"]],
            [objective["best_value"]],
            "o",
            markersize=12,
            markerfacecolor="none",
            markeredgecolor="tab:orange",
            markeredgewidth=2,
            label=f"best {objective['best_value']:.4f} at step {objective['best_step']}",
        )
    if objective["stopped_early_at"] is not None:
        ax.axvline(
            objective["stopped_early_at"],
            color="tab:red",
            linestyle="--",
            label=f"early stop (patience {objective['early_stop_patience']})",
        )
    _plot_references(ax, references, metric)
    ax.set(title=f"objective: {objective['name']} ({objective['direction']})", xlabel="step", ylabel=metric)
    _legend_below(ax, ax.get_legend_handles_labels()[0])


def _legend_below(ax: Any, handles: list[Any]) -> None:
    """The legend under the panel, not on it: inside, "best" place still covers a curve of
    the twin NE axis (matplotlib places it against this axis's artists only), and the
    reference lines crowd the top."""
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=8, frameon=False)


def _plot_references(ax: Any, references: list[ReferenceResult], metric: str) -> None:
    """The references measured on ``metric`` (of either split), as horizontal lines."""
    for i, ref in enumerate(r for r in references if r["metric"].split(".", 1)[1] == metric):
        split = "test" if ref["metric"].startswith("eval.") else "valid"
        ax.axhline(
            ref["value"],
            color="tab:gray",
            linestyle=("--", "-.", ":")[i % 3],
            label=f"{ref['name']} ({split}): {ref['value']:.4f}",
        )


def _one_evaluation(ax: Any, step: int, value: float, label: str) -> None:
    """A panel with one evaluation says so, on an axis of its own scale (matplotlib would
    magnify the point's neighbourhood to the fourth decimal)."""
    margin = max(0.05 * abs(value), 0.01)
    ax.set_ylim(value - margin, value + margin)
    ax.text(
        0.5, 0.9, f"one evaluation: {label} {value:.4f} at step {step}", ha="center", transform=ax.transAxes, fontsize=9
    )


def _plot_freshness(ax: Any, records: list[dict[str, Any]]) -> None:
    """A continuous run's freshness: each partition's progressive AUC (scored before it was
    trained on), trained partitions and scored-only ones apart, and its new ids."""
    x = list(range(len(records)))
    auc = [r["eval"]["auc"] for r in records]
    trained = [r.get("trained", True) for r in records]
    # The first partition is scored by an untrained model (AUC near 0.5): drawn, it would
    # flatten every later day's differences; it is named in the title instead.
    first = records[0]
    if len(records) > 1:
        x, auc, trained = x[1:], auc[1:], trained[1:]
    ax.plot(x, auc, "-", color="tab:green", alpha=0.5)
    ax.plot(
        [i for i, t in zip(x, trained) if t],
        [a for a, t in zip(auc, trained) if t],
        "o",
        color="tab:green",
        label="progressive AUC (then trained on)",
    )
    if not all(trained):
        ax.plot(
            [i for i, t in zip(x, trained) if not t],
            [a for a, t in zip(auc, trained) if not t],
            "s",
            color="tab:orange",
            label="scored only (after train_until)",
        )
    days = records[1:] or records
    mean = sum(r["eval"]["auc"] for r in days) / len(days)
    span = days[0]["partition"] if len(days) == 1 else f"{days[0]['partition']} to {days[-1]['partition']}"
    ax.set(
        # short lines: a title wider than the panel is cut at the figure's left edge
        title=f"progressive AUC per partition: mean {mean:.4f}\nover {len(days)}: {span}\n"
        f"(the first, by the untrained model: {first['eval']['auc']:.3f}, left out)",
        ylabel="AUC",
    )
    step = max(1, len(records) // 7)
    ax.set_xticks(
        range(len(records))[::step], [r["partition"].split("=")[-1] for r in records][::step], rotation=30, fontsize=8
    )
    new = [sum(r.get("new_ids", {}).values()) for r in records]
    if any(new):
        ax_new = ax.twinx()
        ax_new.bar(range(len(records)), new, color="tab:gray", alpha=0.25, label="new ids (all features)")
        ax_new.set_ylabel("new ids")
        ax.set_zorder(ax_new.get_zorder() + 1)
        ax.patch.set_visible(False)
    ax.legend(loc="lower right", fontsize=8)
