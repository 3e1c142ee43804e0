"""Evaluation metrics (TorchRec's own formulas), peak memory, and the run's output files."""

from __future__ import annotations

import json
import math
import os
import resource
from typing import Any

import torch
import torch.distributed as dist
from torchrec.metrics.auc import compute_auc
from torchrec.metrics.ne import compute_cross_entropy, compute_logloss, compute_ne

_ETA = 1e-12  # TorchRec's clamp for probabilities in NE


def binary_metrics(probs: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """AUC, normalized entropy and log loss of click probabilities, via torchrec.metrics.

    Called on the predictions of the whole eval set (gathered from every rank), so the
    result is the same for any world size.
    """
    probs, labels = probs.double().view(1, -1), labels.double().view(1, -1)
    weights = torch.ones_like(labels)
    ce_sum = compute_cross_entropy(labels, probs, weights, _ETA).sum()
    pos, neg = labels.sum(), (1 - labels).sum()
    return {
        "auc": float(compute_auc(1, [probs], [labels], [weights])[0]),
        "ne": float(compute_ne(ce_sum, weights.sum(), pos, neg, _ETA)),
        # TorchRec's cross entropy is in bits; log loss is conventionally in nats.
        "logloss": float(compute_logloss(ce_sum, pos, neg, _ETA)) * math.log(2),
        "n": int(labels.numel()),
    }


def all_gather_cat(t: torch.Tensor) -> torch.Tensor:
    """Concatenate equal-sized tensors from every rank, in rank order."""
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return torch.cat(out)


def peak_rss_mb() -> float:
    """This process's peak resident memory (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def write_json(path: str, obj: Any) -> None:
    """Write through a temporary file and rename, so a reader never sees half a file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, path)


class MetricsLog:
    """``metrics.jsonl``: one JSON object per logged step, for scripts."""

    def __init__(self, path: str | None) -> None:
        self._f = open(path, "a") if path else None

    def log(self, **record: Any) -> None:
        if self._f:
            self._f.write(json.dumps(record) + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f:
            self._f.close()
