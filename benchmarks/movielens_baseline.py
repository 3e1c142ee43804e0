"""MovieLens-100k: hybridrec's DLRM beside a plain logistic regression on the same features
and split.

The baseline is logistic regression over one-hot user, item, age bucket, gender,
occupation and zip prefix, multi-hot genres and the two dense inputs: exactly the features
and the fixed random 80/20 split the `movielens` experiment uses (the same reader builds
them). Its L2 strength is chosen on a holdout carved out of the training rows (never the eval
set), then it is refit on all training rows with full-batch L-BFGS. The DLRM number comes from
running `python -m hybridrec.train +experiment=movielens` in the same invocation.

    make data-movielens && python benchmarks/movielens_baseline.py
Writes benchmarks/results/MOVIELENS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

from hybridrec.data.movielens import MovieLens  # noqa: E402
from hybridrec.metrics import binary_metrics  # noqa: E402


def design(data: MovieLens, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse one-/multi-hot indices (with offsets per feature), dense inputs, labels."""
    offsets, start = {}, 0
    for f in data.features:
        offsets[f.name], start = start, start + f.num_embeddings
    batch = data._batch(rows)  # the exact batches the DLRM sees
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", default="data/ml-100k")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    data = MovieLens(batch_size=1024, path=args.path, label_threshold=4.0, split="random", eval_fraction=0.2,
                     side_features=True, bad_rows="skip", eval_batches=None, seed=0)
    train, test = data.split_rows["train"], data.split_rows["eval"]
    holdout = np.random.default_rng(1).permutation(train)
    fit_rows, val_rows = holdout[: int(0.9 * len(train))], holdout[int(0.9 * len(train)) :]
    scores = {}
    for l2 in (1e-5, 1e-4, 1e-3):
        idx, width, dense, labels = design(data, fit_rows)
        params = fit(idx, width, dense, labels, l2)
        v_idx, _, v_dense, v_labels = design(data, val_rows)
        scores[l2] = binary_metrics(predict(params, v_idx, width, v_dense, len(val_rows)), v_labels)["auc"]
    best = max(scores, key=scores.get)
    idx, width, dense, labels = design(data, train)
    params = fit(idx, width, dense, labels, best)
    t_idx, _, t_dense, t_labels = design(data, test)
    baseline = binary_metrics(predict(params, t_idx, width, t_dense, len(test)), t_labels)

    with tempfile.TemporaryDirectory() as run:
        subprocess.run([sys.executable, "-m", "hybridrec.train", "+experiment=movielens", f"data.path={args.path}",
                        f"hydra.run.dir={run}"], check=True, capture_output=True)
        dlrm = json.load(open(os.path.join(run, "summary.json")))["eval"]
    lines = [
        "# MovieLens-100k: DLRM vs logistic regression",
        "",
        "`python benchmarks/movielens_baseline.py`: same features (user, item, age bucket, gender, occupation, "
        "zip prefix, genres, age, release year), label rating >= 4, same fixed random 80/20 split "
        f"({len(train):,} train / {len(test):,} eval ratings). The baseline's L2 ({best:g}) was chosen on a "
        "holdout of the training rows. DLRM: `+experiment=movielens` (eval on the full batches: "
        f"{dlrm['n']:,} of {len(test):,} eval ratings).",
        "",
        "| model | eval AUC | NE | logloss | calibration |",
        "|---|---:|---:|---:|---:|",
        f"| logistic regression | {baseline['auc']:.4f} | {baseline['ne']:.4f} | {baseline['logloss']:.4f} | {baseline['calibration']:.3f} |",
        f"| DLRM (hybridrec) | {dlrm['auc']:.4f} | {dlrm['ne']:.4f} | {dlrm['logloss']:.4f} | {dlrm['calibration']:.3f} |",
    ]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "MOVIELENS.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
