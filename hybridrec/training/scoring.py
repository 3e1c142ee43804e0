"""Scoring a split: the one evaluation that training (``Trainer.evaluate``, during and after
the run) and ``python -m hybridrec.evaluate`` (a saved model) both call; the rank job of the
latter (``ScoreCheckpoint``) and the files it writes (``metrics.json``,
``predictions.parquet``).

What is computed follows the declarations: the loss's ``calibrated`` decides whether the
scores are click probabilities (NE, log loss, calibration, accuracy), the source's
``ranking_k`` whether rows are per-query lists (NDCG, MAP, recall), its ``extra_fields``
whether batches carry relevance, query and weights.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence, cast

import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn

from hybridrec import checkpoint
from hybridrec.config.tasks import Task
from hybridrec.data.loader import EvalBatch, padding_batch
from hybridrec.data.source import Source
from hybridrec.models.losses import Loss
from hybridrec.reports.metrics import (
    binary_metrics,
    format_eval,
    gather_to_first,
    next_item_metrics,
    ranking_metrics,
    task_metrics,
)
from hybridrec.reports.runlog import write_json
from hybridrec.reports.summary import ScoreSummary, provenance, throughput
from hybridrec.training.build import build, rank_batches

# Metrics of sigmoid(score) that only mean something when the scores are click logits.
CALIBRATED_ONLY = ("ne", "logloss", "calibration", "accuracy")


@dataclass
class Evaluation:
    metrics: dict[str, Any]
    """The metrics block (summary.json's ``eval``), the same on every rank."""
    predictions: Optional[dict[str, torch.Tensor]]
    """On rank 0 when asked for: one CPU column per field, every real row of the split once,
    ordered by ``row``. None elsewhere."""
    batches: int
    """Global batches scored (each rank scored its share of each)."""
    finite: bool = True
    """Every score was finite: a model that diverged scores NaN or inf (training commits its
    last checkpoint only when this holds)."""


@torch.no_grad()
def evaluate(
    model: nn.Module,
    source: Source,
    loss: Loss,
    batches: Iterator[EvalBatch],
    device: torch.device,
    predictions: bool = False,
) -> Evaluation:
    """Score every row of ``batches`` (this rank's share of one split) with ``model`` (a
    Ranker, sharded or not: forward gives ``(loss, (loss, logits, labels))``) and compute
    the split's metrics over all ranks. Collective: every rank calls it with its own batches.

    The columns are gathered to rank 0 only (a rank holds its own share, rank 0 the whole
    split, which AUC needs); rank 0 computes the metrics and broadcasts them."""
    world = dist.get_world_size()
    was_training = model.training
    model.eval()
    lists = "relevance" in source.extra_fields  # relevance, query, and padding inside lists (weight 0)
    # A next-item model's "score" is the rank of the row's held-out item among the catalogue.
    names = ["score", "label", "real"] + (["relevance", "query"] if lists else []) + (["row"] if predictions else [])
    columns: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    count = 0
    while True:
        item = next(batches, None)
        # Ranks can run out at different batches (a sharded source): one all-reduce per
        # batch agrees on the end, and a rank that ran out feeds padding meanwhile (the
        # sharded embedding lookups are collectives every rank must join).
        more = torch.tensor([item is not None], dtype=torch.int32, device=device)
        dist.all_reduce(more, op=dist.ReduceOp.MAX)
        if not more.item():
            break
        count += 1
        item = item or padding_batch(source, world)
        _, (_, logits, labels) = model(item.batch.to(device))
        columns["score"].append(logits)
        columns["label"].append(labels)
        real = item.real
        if lists:
            # list sources set every ranking field (RANKING_FIELDS), their padding batches too
            assert item.batch.weights is not None and item.batch.relevance is not None and item.batch.query is not None
            real = real & (item.batch.weights > 0)
            columns["relevance"].append(item.batch.relevance)
            columns["query"].append(item.batch.query)
        if predictions:
            columns["row"].append(item.rows)
        columns["real"].append(real)
    model.train(was_training)
    real = torch.cat(columns.pop("real"))
    # Padding rows (the last batch of a split, short lists) are dropped before gathering.
    mine = {name: torch.cat(parts).to(device)[real.to(device)] for name, parts in columns.items()}
    # a multi-task split's columns are [n, T]: gathered flat, shaped again on rank 0
    gathered = {name: gather_to_first(t.reshape(-1)) for name, t in mine.items()}
    metrics: list[Any] = [None, None]
    if dist.get_rank() == 0:
        # rank 0: gathered, not None
        c = {name: cast(torch.Tensor, t).cpu().view(-1, *mine[name].shape[1:]) for name, t in gathered.items()}
        if source.next_item:
            metrics[0] = next_item_metrics(c["score"])
        elif source.tasks:
            metrics[0] = task_metrics(c["score"], c["label"], source.tasks)
        else:
            metrics[0] = split_metrics(c["score"], c["label"], loss, source, c.get("relevance"), c.get("query"))
        if source.next_item and getattr(getattr(model, "module", model), "mask_history", False):
            # the ranks with the user's history masked, in the labels' slot (SequenceRanker)
            masked = next_item_metrics(c["label"])
            metrics[0] |= {f"masked_{k}": v for k, v in masked.items() if k != "n"}
        metrics[1] = bool(torch.isfinite(c["score"]).all())
    dist.broadcast_object_list(metrics, src=0)  # a few numbers: every rank reports the same
    table = None
    if predictions and dist.get_rank() == 0:
        order = torch.argsort(c["row"])  # rank order -> row order: the same file for any world size
        table = {name: t[order] for name, t in c.items()}
    return Evaluation(metrics[0], table, count, metrics[1])


def split_metrics(
    scores: torch.Tensor,
    labels: torch.Tensor,
    loss: Loss,
    source: Source,
    relevance: Optional[torch.Tensor] = None,
    query: Optional[torch.Tensor] = None,
) -> dict[str, Any]:
    """The metrics block of a whole split (every real row once): AUC and the label's rate
    always; NE, log loss, calibration and accuracy when ``loss.calibrated``; per-query NDCG,
    MAP and recall when ``source.ranking_k`` is set."""
    result = binary_metrics(torch.sigmoid(scores), labels)
    if not loss.calibrated:
        # Scores trained by a ranking or regression objective are not click probabilities:
        # NE, log loss, calibration and accuracy of sigmoid(score) would mean nothing.
        result = {k: v for k, v in result.items() if k not in CALIBRATED_ONLY}
    if source.ranking_k is not None:  # lists per user: NDCG, MAP, recall
        # list sources have a threshold and batches with relevance and query (the caller's)
        assert relevance is not None and query is not None and source.threshold is not None
        result |= ranking_metrics(
            scores.double().numpy(), relevance.numpy(), query.numpy(), source.threshold, source.ranking_k
        )
    return result


def write_predictions(
    path: str, predictions: dict[str, torch.Tensor], calibrated: bool, tasks: Sequence[Task] = ()
) -> int:
    """``predictions.parquet``: ``row`` (the row's index in the split, see
    ``EvalBatch.rows``), ``label``, ``score`` (the model's logit), ``probability``
    (sigmoid(score), calibrated losses only) and, for list sources, ``query`` and
    ``relevance``. With ``tasks`` (a multi-task model), ``label_<task>`` and ``score_<task>``
    per task, and ``probability_<task>`` per binary task. Written through a temporary file;
    returns the number of rows."""
    cols = {"row": predictions["row"]}
    if tasks:
        n = len(predictions["row"])
        label, score = predictions["label"].view(n, -1), predictions["score"].view(n, -1)  # one task: [n]
        for t, task in enumerate(tasks):
            cols[f"label_{task.name}"], cols[f"score_{task.name}"] = label[:, t], score[:, t]
            if task.kind == "binary":
                cols[f"probability_{task.name}"] = torch.sigmoid(score[:, t])
    else:
        cols |= {"label": predictions["label"], "score": predictions["score"]}
        if calibrated:
            cols["probability"] = torch.sigmoid(predictions["score"])
    for name in ("query", "relevance"):
        if name in predictions:
            cols[name] = predictions[name]
    table = pa.table({name: t.numpy() for name, t in cols.items()})
    meaning = (
        "a logit: sigmoid(score) is the click probability (column probability)"
        if calibrated
        else "a ranking score: it orders rows, it is not a probability"
    )
    table = table.replace_schema_metadata({"hybridrec.score": f"score is the model's raw output, {meaning}"})
    tmp = f"{path}.tmp"
    pq.write_table(table, tmp)
    os.replace(tmp, path)
    return table.num_rows


@dataclass(frozen=True)
class ScoreCheckpoint:
    """The rank job of ``python -m hybridrec.evaluate``: the model of a saved checkpoint,
    sharded as training shards it (any world size: DCP reshards), scored on one split by
    the evaluation training uses. Rank 0 writes ``metrics.json`` and, with ``predictions``,
    ``predictions.parquet`` into the run directory. A dataclass of plain fields, so that the
    elastic launcher can pickle it to the ranks it spawns."""

    checkpoint: str
    """A committed checkpoint directory (``<checkpoint.dir>/step_<N>``), checked before launch."""
    split: str
    predictions: bool
    allow_unverified: bool = False
    """Load it even without checksums (``allow_unverified=true``: written before they existed)."""

    def __call__(self, cfg: DictConfig, run_dir: str, device: torch.device) -> ScoreSummary:
        data, loss, parallel = build(cfg, run_dir, device)
        step = checkpoint.load_weights(parallel.model, self.checkpoint, self.allow_unverified)
        tick = time.perf_counter()
        result = evaluate(
            parallel.model, data, loss, rank_batches(cfg.data, data, self.split, device), device, self.predictions
        )
        wall = time.perf_counter() - tick
        out: ScoreSummary = {
            "checkpoint": {"path": os.path.abspath(self.checkpoint), "step": step},
            "split": self.split,
            "eval": result.metrics,  # the block training reports, same keys
            "world_size": dist.get_world_size(),
            "device": str(device),
            # steps: global batches scored; samples: real rows (padding excluded)
            "scoring": throughput(result.batches, result.metrics["n"], wall),
            "provenance": provenance(cfg, None),
        }
        if dist.get_rank() == 0:
            files = ["metrics.json"]
            if result.predictions is not None:
                write_predictions(
                    os.path.join(run_dir, "predictions.parquet"), result.predictions, loss.calibrated, data.tasks
                )
                files.append("predictions.parquet")
            write_json(os.path.join(run_dir, "metrics.json"), out)
            print(f"{self.split} @ step {step} ({self.checkpoint}): {format_eval(result.metrics)}", flush=True)
            print(f"hybridrec: outputs in {os.path.abspath(run_dir)} ({', '.join(files)})", flush=True)
        return out
