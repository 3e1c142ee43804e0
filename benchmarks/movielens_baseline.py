"""MovieLens-100k: hybridrec's `movielens` experiment beside a plain logistic regression on the
same features and the same three-way split.

The baseline is logistic regression over one-hot user, item, age bucket, gender,
occupation and zip prefix, multi-hot genres and the two dense inputs: exactly the features
and splits the `movielens` experiment uses (the same reader builds them, from the
experiment's own config). Both models are selected on the validation split only, by the
experiment's objective (validation log loss): the baseline's L2 strength here, the
experiment's model, embedding penalty and rates by the sweep recorded in MOVIELENS.md, its step
by early stopping and the best checkpoint. The test split is scored once per run, at the end.
hybridrec's numbers come from running `python -m hybridrec.train +experiment=movielens` with
the best-checkpoint rule (checkpoint.keep_best), three seeds, in the same invocation.

    make data-movielens && python benchmarks/movielens_baseline.py [--sweep]
Writes benchmarks/results/MOVIELENS.md. ``--sweep`` also runs the selection sweep (each model
with and without the embedding penalty, seed 0, early stopping on the validation split) and
tabulates each setting's best validation log loss and its step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

import numpy as np
import torch

from common import machine, train_summary
from hybridrec.data import build_source
from hybridrec.data.movielens import MovieLens
from hybridrec.reports.metrics import binary_metrics

HERE = os.path.dirname(os.path.abspath(__file__))


def experiment_config(path: str):
    """The `movielens` experiment's composed config: the same splits and seed as the run."""
    from hydra import compose, initialize_config_dir

    from hybridrec.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=os.path.join(HERE, "..", "hybridrec", "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=["+experiment=movielens", f"data.path={path}"])


def design(data: MovieLens, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse one-/multi-hot indices (with offsets per feature), dense inputs, labels."""
    offsets, start = {}, 0
    for f in data.features:
        offsets[f.name], start = start, start + f.num_embeddings
    batch = data._pairs_batch(
        data.user[rows], data.item[rows], data.rating[rows], np.ones(len(rows))
    )  # what the DLRM sees
    kjt = batch.sparse_features
    values = torch.cat([kjt[k].values() + offsets[k] for k in kjt.keys()])
    sample = torch.cat([torch.repeat_interleave(torch.arange(len(rows)), kjt[k].lengths().long()) for k in kjt.keys()])
    return torch.stack([sample, values]), torch.tensor(start), batch.dense_features, batch.labels


def fit(index, width, dense, labels, l2: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = labels.numel()
    x = torch.sparse_coo_tensor(index, torch.ones(index.shape[1]), (n, int(width))).coalesce()
    w = torch.zeros(int(width), requires_grad=True)
    v = torch.zeros(dense.shape[1], requires_grad=True)
    b = torch.zeros(1, requires_grad=True)
    opt = torch.optim.LBFGS([w, v, b], max_iter=200, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        logits = torch.sparse.mm(x, w[:, None]).squeeze(1) + dense @ v + b
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels) + l2 * (w @ w + v @ v)
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach(), v.detach(), b.detach()


def predict(params, index, width, dense, n) -> torch.Tensor:
    w, v, b = params
    x = torch.sparse_coo_tensor(index, torch.ones(index.shape[1]), (n, int(width))).coalesce()
    return torch.sigmoid(torch.sparse.mm(x, w[:, None]).squeeze(1) + dense @ v + b)


# The grid the experiment's settings were chosen from (validation split only): each model
# with and without the embedding penalty, at the sparse rate the penalty allows.
SWEEP_MODELS = ("dlrm", "dcn", "deepfm")
SWEEP_L2 = (0.0, 0.01, 0.03, 0.1)
SWEEP_STEPS = 5000
SEEDS = (0, 1, 2)


# The best-checkpoint rule: the run keeps its best validation checkpoint and scores the test
# split with it (the checkpoints go in the run's own directory).
BEST = ["checkpoint.keep_best=true", "checkpoint.keep_last=1", "checkpoint.dir=${hydra:runtime.output_dir}/checkpoints"]


def _run(path: str, overrides: list[str]) -> dict:
    """``+experiment=movielens <overrides>`` with the best-checkpoint rule: its summary.json."""
    with tempfile.TemporaryDirectory() as run:
        return train_summary(["+experiment=movielens", f"data.path={path}", *BEST, *overrides], run)


def sweep(path: str) -> list[str]:
    """Markdown rows: each setting's best validation log loss (the experiment's early
    stopping, up to SWEEP_STEPS steps) and its AUC, seed 0."""
    rows = []
    for model in SWEEP_MODELS:
        for l2 in SWEEP_L2:
            setting = [f"model={model}", f"model.embedding_l2={l2:g}", "optimizer.sparse.lr=0.05"]
            s = _run(path, [*setting, f"train.steps={SWEEP_STEPS}"])
            best = min(s["eval_history"], key=lambda e: e["logloss"])
            rows.append(f"| {' '.join(setting)} | {best['logloss']:.4f} | {best['auc']:.4f} | {best['step']} |")
            print(rows[-1], flush=True)
    return [
        "| setting | best validation log loss | its AUC | at step |",
        "|---|---:|---:|---:|",
        *rows,
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", default="data/ml-100k")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--sweep", action="store_true", help="also run the selection sweep on validation")
    args = parser.parse_args()
    cfg = experiment_config(args.path)
    data = build_source(cfg.data, cfg.seed)
    train, valid, test = (data.split_rows[s] for s in ("train", "valid", "eval"))
    idx, width, dense, labels = design(data, train)
    v_idx, _, v_dense, v_labels = design(data, valid)
    fits = {l2: fit(idx, width, dense, labels, l2) for l2 in (1e-6, 1e-5, 1e-4, 1e-3)}
    scores = {
        l2: binary_metrics(predict(p, v_idx, width, v_dense, len(valid)), v_labels)["logloss"] for l2, p in fits.items()
    }
    best = min(scores, key=scores.get)  # chosen on validation (the experiment's objective), scored once on test
    t_idx, _, t_dense, t_labels = design(data, test)
    baseline = binary_metrics(predict(fits[best], t_idx, width, t_dense, len(test)), t_labels)

    runs = [_run(args.path, [f"seed={seed}"]) for seed in SEEDS]
    auc = [r["eval"]["auc"] for r in runs]
    middle = runs[sorted(range(len(runs)), key=lambda i: auc[i])[len(runs) // 2]]  # the median seed's run
    model, chosen = middle["eval"], middle["objective"]
    name = {"DLRMRanker": "DLRM", "DCNRanker": "DCN", "DeepFMRanker": "DeepFM"}.get(
        cls := cfg.model._target_.rsplit(".", 1)[-1], cls
    )
    seeds = ", ".join(str(x) for x in SEEDS)
    spread = f"{statistics.median(auc):.4f} ({min(auc):.4f} - {max(auc):.4f})"
    lines = [
        "# MovieLens-100k: hybridrec vs logistic regression",
        "",
        "`python benchmarks/movielens_baseline.py"
        + (" --sweep" if args.sweep else "")
        + f"` on {machine().get('cpu', 'this CPU')}: same features (user, item, age bucket, gender, occupation, "
        "zip prefix, genres, age, release year), label rating >= 4, the experiment's fixed random split "
        f"({len(train):,} train / {len(valid):,} validation / {len(test):,} test ratings). Selection used the "
        f"validation split only, by validation log loss (the experiment's objective): the baseline's L2 "
        f"({best:g}, of {', '.join(f'{k:g}: {v:.4f}' for k, v in scores.items())}), the experiment's model, "
        "embedding penalty and rates (the sweep below), and its step: early stopping and the best checkpoint "
        f"(`{' '.join(BEST)}`; the median seed's best at step {chosen['best_step']}"
        + (f", stopped at step {chosen['stopped_early_at']}" if chosen["stopped_early_at"] else "")
        + f"). Test metrics are computed once per run. hybridrec: `+experiment=movielens` ({name}), seeds {seeds}: "
        f"test AUC median (min - max), the other columns the median seed's (scored on {model['n']:,} of "
        f"{len(test):,} test ratings).",
        "",
        "| model | test AUC | NE | logloss | calibration | validation log loss |",
        "|---|---:|---:|---:|---:|---:|",
        f"| logistic regression, L2 {best:g} | {baseline['auc']:.4f} | {baseline['ne']:.4f} | {baseline['logloss']:.4f} | "
        f"{baseline['calibration']:.3f} | {scores[best]:.4f} |",
        f"| {name} (hybridrec, `+experiment=movielens`) | {spread} | {model['ne']:.4f} | {model['logloss']:.4f} | "
        f"{model['calibration']:.3f} | {chosen['best_value']:.4f} |",
    ]
    if args.sweep:
        lines += [
            "",
            "## Selection sweep (validation split only)",
            "",
            f"`python -m hybridrec.train +experiment=movielens <setting> train.steps={SWEEP_STEPS}` (validation "
            "every 25 steps, the experiment's early stopping), seed 0; the experiment ships the setting of "
            "the lowest validation log loss, and early stopping with the best checkpoint finds its step.",
            "",
            *sweep(args.path),
        ]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "MOVIELENS.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
