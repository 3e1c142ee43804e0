"""The synthetic click log's planted model, scored on an experiment's validation and test
splits: the best any model can do on that log, and the reference its experiment config
quotes (``train.references``).

The generator draws each label as Bernoulli(sigmoid(planted logit)); scoring every row with
that very probability gives the Bayes-optimal AUC and log loss of the split's rows. The logit
is recomputed here from the generator's own pieces (its uniforms, Zipf ids, planted weights
and dense weights), and every label is checked against it: a generator whose planted model
changed fails here instead of quoting a stale number.

    python benchmarks/planted_model.py              # +experiment=ctr
    python benchmarks/planted_model.py data.seed=1  # any override of the experiment
    python benchmarks/planted_model.py --experiment multitask   # each task of data.labels
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch

from hybridrec.data import build_source, portable
from hybridrec.data.synthetic import SyntheticClickLog
from hybridrec.reports.metrics import binary_metrics

HERE = os.path.dirname(os.path.abspath(__file__))


def experiment_config(overrides: list[str], experiment: str = "ctr"):
    from hydra import compose, initialize_config_dir

    from hybridrec.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=os.path.join(HERE, "..", "hybridrec", "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=[f"+experiment={experiment}", *overrides])


def planted_probabilities(
    source: SyntheticClickLog, split: str, index: int, task: str = "click"
) -> tuple[np.ndarray, np.ndarray]:
    """The planted probability of ``task`` (the click, or the conversion after a click) and
    its label for every row of global batch ``index``. Raises RuntimeError if a label is not
    the generator's draw from that probability."""
    n = source.batch_size
    u = source._uniforms(split, index, 0, n)
    dense, ids, labels = source._arrays(split, index, 0, n)
    if source.dense_distribution.value == "normal":
        signal = dense
    elif source.dense_distribution.value == "lognormal":
        signal = (dense - 1.0) / 0.8
    else:
        signal = (dense - 0.5) * 3.4
    weights = source._planted_weights(ids)
    logit = np.full(n, -1.0)
    for j, w in enumerate(source._dense_w):  # in the generator's order: the sum is rounded as it is there
        logit += 1.5 * (signal[:, j] * w)
    for first, k in zip(source._offsets, source._sizes):
        total = weights[first].copy()
        for j in range(1, k):
            total += weights[first + j]
        logit += 3.0 / np.sqrt(len(source._sizes)) * (total / np.float32(k))
    probs = portable.sigmoid(logit)
    clicks = labels if not source.tasks else _task_column(source, labels, "click")
    if not np.array_equal(u[-1] < probs, clicks):
        raise RuntimeError(
            f"{split} batch {index}: the labels are not draws from the recomputed planted model: "
            f"update planted_probabilities to hybridrec.data.synthetic's planted logit"
        )
    if task == "click":
        return probs, clicks
    # the conversion after a click: P(click) * P(conversion | click), its labels the generator's draws
    given = portable.sigmoid(source._conversion_logit(np.ascontiguousarray(signal.T), weights))
    drawn = (u[-1] < probs) & (source._task_uniforms(split, index, 0, n) < given)
    if not np.array_equal(drawn, _task_column(source, labels, "conversion")):
        raise RuntimeError(f"{split} batch {index}: the conversions are not draws from the planted model")
    return probs * given, drawn


def _task_column(source: SyntheticClickLog, labels: np.ndarray, column: str) -> np.ndarray:
    """The labels of the task reading ``column`` (labels ``[n, T]``, or ``[n]`` for one task)."""
    at = [t.column for t in source.tasks].index(column)
    return labels[:, at] if labels.ndim == 2 else labels


def score(source: SyntheticClickLog, split: str, task: str = "click") -> dict[str, float]:
    parts = [planted_probabilities(source, split, i, task) for i in range(source.num_batches(split))]
    probs = torch.from_numpy(np.concatenate([p for p, _ in parts]))
    labels = torch.from_numpy(np.concatenate([y for _, y in parts]).astype(np.float64))
    return {k: round(v, 4) for k, v in binary_metrics(probs, labels).items()}


def main() -> None:
    args = sys.argv[1:]
    experiment = "ctr"
    if args[:1] == ["--experiment"]:
        experiment, args = args[1], args[2:]
    cfg = experiment_config(args, experiment)
    source = build_source(cfg.data, cfg.seed)
    if not isinstance(source, SyntheticClickLog):
        raise SystemExit(f"data={cfg.data._target_}: only the synthetic click log has a planted model")
    splits = [split for split in source.splits if split != "train"]
    if not source.tasks:
        print(json.dumps({split: score(source, split) for split in splits}, indent=1))
        return
    print(
        json.dumps(
            {t.name: {split: score(source, split, t.column) for split in splits} for t in source.tasks}, indent=1
        )
    )


if __name__ == "__main__":
    main()
