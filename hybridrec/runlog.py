"""A run's output files as it goes: ``metrics.jsonl`` (and TensorBoard events), JSON files
written whole, and ``report.png``, the loss and evaluation curves. (summary.json's schema is
``hybridrec.summary``.)"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

def write_json(path: str, obj: Any) -> None:
    """Write through a temporary file and rename, so a reader never sees half a file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, path)


class MetricsLog:
    """``metrics.jsonl``: one JSON object per logged step and per eval, for scripts; the same
    scalars as TensorBoard events when ``tensorboard_dir`` is given. Rank 0 only."""

    def __init__(self, path: Optional[str], tensorboard_dir: Optional[str] = None) -> None:
        self._f = open(path, "a") if path else None
        self._tb = None
        if path and tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter  # optional dependency

            self._tb = SummaryWriter(tensorboard_dir)
        self.records: list[dict[str, Any]] = []

    def log(self, **record: Any) -> None:
        if not self._f:
            return
        self.records.append(record)
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()
        if self._tb:
            # an evaluation's metrics go under its split's tag (valid/auc, test/auc,
            # progressive/auc): one tag for every split would hold two values at one step
            split = {"eval": "test"}.get(record.get("split"), record.get("split"))
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


def plot_report(records: list[dict[str, Any]], path: str) -> None:
    """report.png: training loss, eval AUC and NE, and samples/s over steps."""
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
    panels = 4 if progressive else 3
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4))
    ax_loss, ax_eval, ax_rate = axes[:3]
    if progressive:
        _plot_freshness(axes[3], progressive)
    ax_loss.plot([r["step"] for r in train], [r["loss_mean"] for r in train], color="tab:blue")
    ax_loss.set(title="training loss (global, mean per log window)", xlabel="step", ylabel="loss")
    if evals:
        steps = [r["step"] for r in evals]
        # AUC where the scores are per row; a next-item run's is NDCG@10 over the catalogue
        head = "auc" if "auc" in evals[0]["eval"] else "ndcg@10"
        label = head.upper() if head == "auc" else "NDCG@10"
        ax_eval.plot(steps, [r["eval"][head] for r in evals], "o-", color="tab:green", label=f"{curve} {label}")
        for r in test:
            ax_eval.plot([r["step"]], [r["eval"][head]], "*", markersize=12, color="black", label=f"test {label}")
        ax_eval.set(title="validation" if curve == "valid" else "eval", xlabel="step", ylabel=label)
        extra = []
        if "ne" in evals[0]["eval"]:  # calibrated (BCE) runs; no second axis for the others
            ax_ne = ax_eval.twinx()
            ax_ne.plot(steps, [r["eval"]["ne"] for r in evals], "s--", color="tab:red", label="NE")
            ax_ne.set_ylabel("NE (lower is better)")
            extra = ax_ne.lines
        ndcg = next((k for k in evals[0]["eval"] if k.startswith("ndcg")), None)
        if ndcg and head == "auc":  # ranking sources
            ax_eval.plot(steps, [r["eval"][ndcg] for r in evals], "^-", color="tab:purple", label=ndcg.upper())
            ax_eval.set_ylabel("AUC / NDCG")
        ax_eval.legend(handles=ax_eval.lines + extra, loc="center right")
    ax_rate.plot([r["step"] for r in train], [r["samples_per_second"] for r in train], color="tab:purple")
    ax_rate.set(title="throughput (cumulative)", xlabel="step", ylabel="samples/s")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


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
    ax.plot([i for i, t in zip(x, trained) if t], [a for a, t in zip(auc, trained) if t], "o", color="tab:green",
            label="progressive AUC (then trained on)")
    if not all(trained):
        ax.plot([i for i, t in zip(x, trained) if not t], [a for a, t in zip(auc, trained) if not t], "s",
                color="tab:orange", label="scored only (after train_until)")
    ax.set(title=f"freshness (first partition, untrained model: AUC {first['eval']['auc']:.3f})", ylabel="AUC")
    step = max(1, len(records) // 7)
    ax.set_xticks(range(len(records))[::step], [r["partition"].split("=")[-1] for r in records][::step], rotation=30, fontsize=8)
    new = [sum(r.get("new_ids", {}).values()) for r in records]
    if any(new):
        ax_new = ax.twinx()
        ax_new.bar(range(len(records)), new, color="tab:gray", alpha=0.25, label="new ids (all features)")
        ax_new.set_ylabel("new ids")
        ax.set_zorder(ax_new.get_zorder() + 1)
        ax.patch.set_visible(False)
    ax.legend(loc="lower right", fontsize=8)
