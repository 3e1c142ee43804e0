"""Evaluation metrics: TorchRec's formulas for the binary ones (AUC, NE, log loss,
calibration, CTR, accuracy), NDCG, MAP and recall for ranked lists, and the gather that puts
a split's scores on rank 0. (What a run logs and plots is ``hybridrec.reports.runlog``; what it
measures of itself, ``hybridrec.reports.profiling``.)"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torchrec.metrics.accuracy import compute_accuracy, get_accuracy_states
from torchrec.metrics.auc import compute_auc
from torchrec.metrics.calibration import compute_calibration
from torchrec.metrics.ctr import compute_ctr
from torchrec.metrics.ne import compute_cross_entropy, compute_logloss, compute_ne

from hybridrec.config.tasks import Task

_ETA = 1e-12  # TorchRec's clamp for probabilities in NE


def binary_metrics(probs: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """AUC, NE, log loss, calibration, CTR and accuracy of click probabilities, with
    TorchRec's metric functions (torchrec.metrics), over the whole eval set.

    Called on the predictions gathered from every rank, so the result does not depend on
    the world size: AUC needs every prediction (a sort), the others are sums.
    """
    probs, labels = probs.double().view(1, -1), labels.double().view(1, -1)
    weights = torch.ones_like(labels)
    ce_sum = compute_cross_entropy(labels, probs, weights, _ETA).sum()
    pos, neg = labels.sum(), (1 - labels).sum()
    accuracy = get_accuracy_states(labels, probs, weights, threshold=0.5)
    return {
        "auc": float(compute_auc(1, [probs], [labels], [weights])[0]),
        "ne": float(compute_ne(ce_sum, weights.sum(), pos, neg, _ETA)),
        # TorchRec's cross entropy is in bits; log loss is conventionally in nats.
        "logloss": float(compute_logloss(ce_sum, pos, neg, _ETA)) * math.log(2),
        # predicted clicks / actual clicks: 1.0 is calibrated
        "calibration": float(compute_calibration(probs.sum(), (labels * weights).sum())),
        "ctr": float(compute_ctr(pos, weights.sum())),
        "accuracy": float(compute_accuracy(accuracy["accuracy_sum"], accuracy["weighted_num_samples"])),
        "n": int(labels.numel()),
    }


def task_metrics(scores: torch.Tensor, labels: torch.Tensor, tasks: Sequence[Task]) -> dict[str, Any]:
    """The metrics block of a multi-task split (``[n, T]`` outputs and labels, every real row
    once): per task ``<task>.<metric>`` (a binary task's ``binary_metrics`` of sigmoid(output);
    a regression task's RMSE and MAE; an ordinal task's RMSE and MAE of the expected grade and
    the accuracy of the nearest grade), a dependent task's AUC of P(task | parent) on the
    parent's positive rows (``<task>.auc_given_<parent>``), and the binary tasks' ``auc`` and
    ``logloss`` averaged with the task weights: what ``valid.auc`` and ``valid.logloss`` judge."""
    out: dict[str, Any] = {}
    names = [t.name for t in tasks]
    scores, labels = scores.view(len(scores), -1), labels.view(len(labels), -1)  # one task: [n]
    weighted: dict[str, list[tuple[float, float]]] = {"auc": [], "logloss": []}
    for t, task in enumerate(tasks):
        s, y = scores[:, t].double(), labels[:, t].double()
        if task.kind != "binary":  # a regression task's value, an ordinal task's expected grade
            err = s - y
            out[f"{task.name}.rmse"] = float(err.square().mean().sqrt()) if len(err) else float("nan")
            out[f"{task.name}.mae"] = float(err.abs().mean()) if len(err) else float("nan")
            if task.kind == "ordinal":  # the nearest grade's
                out[f"{task.name}.accuracy"] = float((s.round() == y).double().mean()) if len(y) else float("nan")
            continue
        m = binary_metrics(torch.sigmoid(s), y)
        out |= {f"{task.name}.{k}": v for k, v in m.items() if k != "n"}
        for key in weighted:
            weighted[key].append((task.weight, m[key]))
        if task.after:
            parent = names.index(task.after)
            rows = labels[:, parent] > 0
            # P(task | parent) = P(task and parent) / P(parent): the conditional the ESMM head learns
            given = (torch.sigmoid(s) / torch.sigmoid(scores[:, parent].double())).clamp(0, 1)
            out[f"{task.name}.auc_given_{task.after}"] = (
                binary_metrics(given[rows], y[rows])["auc"] if bool(rows.any()) else float("nan")
            )
    for key, pairs in weighted.items():
        total = sum(w for w, _ in pairs)
        if total > 0:
            out[key] = sum(w * v for w, v in pairs) / total
    out["n"] = int(scores.shape[0])
    return out


def ranking_metrics(
    scores: np.ndarray, relevance: np.ndarray, query: np.ndarray, threshold: float, k: int
) -> dict[str, float]:
    """Per-query NDCG@k (gains 2^rel - 1), MAP and recall@k (relevant: relevance >=
    threshold), averaged over queries. A query without any relevant row has no recall or
    average precision, one with zero ideal DCG no NDCG: they are left out of those means and
    the counts say how many queries each mean covers. Ties in score keep row order.
    (torchrec.metrics has NDCG only for its windowed, per-session RecMetric, not over a
    gathered eval set, hence this.)"""
    order = np.lexsort((-scores, query))  # by query, then score descending (stable)
    q, rel = query[order], relevance[order].astype(np.float64)
    starts = np.flatnonzero(np.r_[True, q[1:] != q[:-1]])
    pos = np.arange(len(q)) - np.repeat(starts, np.diff(np.r_[starts, len(q)]))  # 0-based rank in query
    top = pos < k
    discount = 1.0 / np.log2(pos + 2.0)
    dcg = np.add.reduceat(np.where(top, (2.0**rel - 1) * discount, 0.0), starts)
    ideal_order = np.lexsort((-relevance, query))
    ideal_rel = relevance[ideal_order].astype(np.float64)
    idcg = np.add.reduceat(np.where(top, (2.0**ideal_rel - 1) * discount, 0.0), starts)
    hit = (rel >= threshold).astype(np.float64)
    n_rel = np.add.reduceat(hit, starts)
    hits_at_k = np.add.reduceat(hit * top, starts)
    hits_so_far = np.cumsum(hit) - np.repeat(np.r_[0.0, np.cumsum(hit)[starts[1:] - 1]], np.diff(np.r_[starts, len(q)]))
    ap = np.add.reduceat(hit * hits_so_far / (pos + 1.0), starts)
    has_rel, has_gain = n_rel > 0, idcg > 0
    return {
        f"ndcg@{k}": float(np.mean(dcg[has_gain] / idcg[has_gain])) if has_gain.any() else float("nan"),
        "map": float(np.mean(ap[has_rel] / n_rel[has_rel])) if has_rel.any() else float("nan"),
        f"recall@{k}": float(np.mean(hits_at_k[has_rel] / n_rel[has_rel])) if has_rel.any() else float("nan"),
        "queries": int(len(starts)),
        "queries_with_relevant": int(has_rel.sum()),
    }


def next_item_metrics(ranks: torch.Tensor, cutoffs: tuple[int, ...] = (10, 50, 200)) -> dict[str, float]:
    """Hit rate and NDCG at each cut-off, and MRR, of each user's held-out item ranked among
    the whole catalogue (``ranks``: 1 = first; one per user, every user once): one relevant
    item per user, so NDCG@k = 1 / log2(rank + 1) when rank <= k, else 0, and HR@k is the
    share of users whose item is in their top k. Means over users, in float64."""
    r = ranks.double()
    out: dict[str, float] = {}
    for k in cutoffs:
        hit = r <= k
        out[f"ndcg@{k}"] = float(torch.where(hit, 1.0 / torch.log2(r + 1.0), 0.0).mean())
        out[f"hr@{k}"] = float(hit.double().mean())
    out["mrr"] = float((1.0 / r).mean())
    out["n"] = int(r.numel())
    return out


def gather_to_first(t: torch.Tensor) -> Optional[torch.Tensor]:
    """Every rank's 1-D ``t`` (lengths may differ), concatenated in rank order on rank 0;
    None on the other ranks. Collective.

    An all-gather would hold the whole eval set on every rank, N times what rank 0 needs;
    here a rank holds only its own part, and rank 0 the whole (what AUC, a sort, needs).
    ``dist.gather`` takes equal shapes, hence the padding to the longest part."""
    world = dist.get_world_size()
    size = torch.tensor([t.numel()], dtype=torch.int64, device=t.device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)  # N integers: every rank needs the longest for its padding
    lengths = [int(s) for s in sizes]
    padded = torch.cat([t, t.new_zeros(max(lengths) - t.numel())])
    if dist.get_rank() != 0:
        dist.gather(padded, None, dst=0)
        return None
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.gather(padded, parts, dst=0)
    return torch.cat([part[:n] for part, n in zip(parts, lengths)])


def format_eval(e: dict[str, Any]) -> str:
    """One line of the eval metrics a run has (ranking objectives have no NE or calibration)."""
    names = {"auc": "AUC", "ne": "NE", "logloss": "logloss", "calibration": "calibration", "map": "MAP"}
    # a multi-task block: its weighted metrics and each task's headline (AUC, RMSE)
    shown = lambda k: "." not in k or k.endswith((".auc", ".rmse"))
    parts = [f"{names.get(k, k)} {v:.4f}" for k, v in e.items() if isinstance(v, float) and shown(k)]
    return "  ".join(parts + [f"n {e['n']:,}"])
