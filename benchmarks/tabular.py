"""The tabular benchmark: hybridrec's models, with each numeric encoding, against logistic
regression and gradient-boosted trees on the census income table (`make data-adult`).

    python benchmarks/tabular.py [--models dlrm,dcn,deepfm] [--seeds 0,1,2] [--steps N]

One split (data/adult: train 70%, valid 15%, eval 15%, cut once). Every model is chosen on
the validation AUC and the test split is scored once per configuration:

- logistic regression (scikit-learn): categories one-hot, numbers as data=adult transforms
  them, C from a grid;
- gradient-boosted trees (scikit-learn's HistGradientBoostingClassifier, categories native):
  learning rate and leaves from a grid, the number of trees by validation (every 10);
- hybridrec: ``+experiment=tabular model=<m> data.numeric_encoding=<e> seed=<s>``, early
  stopping on the validation AUC (every 100 steps, patience 5, at most the experiment's
  4,000 steps) with the best checkpoint
  scored on test; per encoding, the model with the best median validation AUC is its entry.

scikit-learn is the benchmark's own extra (``pip install -e '.[bench]'``), not hybridrec's
dependency. Writes benchmarks/results/TABULAR.md and tabular.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import numpy as np
import pyarrow.parquet as pq

from common import ROOT, machine, train_summary, write_markdown

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(ROOT, "data", "adult")
NUMERIC = ("age", "fnlwgt", "educational_num", "capital_gain", "capital_loss", "hours_per_week")
CATEGORICAL = ("workclass", "education", "marital_status", "occupation", "relationship", "race", "gender")
CATEGORICAL += ("native_country",)
LABEL = "income_over_50k"
ENCODINGS = ("scalar", "bucketized", "piecewise_linear")


def _split(name: str) -> dict:
    return pq.read_table(os.path.join(DATA, name)).to_pydict()


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.4f} ({min(values):.4f} - {max(values):.4f})"


def baselines() -> dict[str, dict]:
    """Logistic regression and gradient-boosted trees, each chosen on validation."""
    from sklearn.ensemble import HistGradientBoostingClassifier
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import roc_auc_score
    from sklearn.preprocessing import OneHotEncoder, OrdinalEncoder

    splits = {s: _split(s) for s in ("train", "valid", "eval")}
    y = {s: np.asarray(t[LABEL]) for s, t in splits.items()}
    numbers = {s: np.column_stack([np.asarray(t[c], np.float64) for c in NUMERIC]) for s, t in splits.items()}
    cats = {s: np.column_stack([np.asarray(t[c], object) for c in CATEGORICAL]) for s, t in splits.items()}
    out: dict[str, dict] = {}

    # logistic regression: numbers as data=adult gives them (log1p for the capital columns, standardized)
    def scaled(x: np.ndarray) -> np.ndarray:
        x = x.copy()
        x[:, 3:5] = np.log1p(np.maximum(x[:, 3:5], 0))
        return x

    mean, std = scaled(numbers["train"]).mean(0), scaled(numbers["train"]).std(0)
    onehot = OneHotEncoder(handle_unknown="ignore", sparse_output=False).fit(cats["train"])
    x = {s: np.hstack([(scaled(numbers[s]) - mean) / std, onehot.transform(cats[s])]) for s in splits}
    best = None
    for c in (0.01, 0.1, 1.0, 10.0):
        lr = LogisticRegression(C=c, max_iter=2000).fit(x["train"], y["train"])
        valid = roc_auc_score(y["valid"], lr.predict_proba(x["valid"])[:, 1])
        if best is None or valid > best[0]:
            best = (valid, c, lr)
    valid, c, lr = best
    out["logistic regression"] = {
        "valid_auc": valid,
        "test_auc": roc_auc_score(y["eval"], lr.predict_proba(x["eval"])[:, 1]),
        "chosen": f"C={c}",
    }

    # gradient-boosted trees: categories as ordinal codes, split on natively
    ordinal = OrdinalEncoder(handle_unknown="use_encoded_value", unknown_value=-1).fit(cats["train"])
    x = {s: np.hstack([numbers[s], ordinal.transform(cats[s])]) for s in splits}
    categorical = [False] * len(NUMERIC) + [True] * len(CATEGORICAL)
    best = None
    t0 = time.time()
    for rate in (0.05, 0.1):
        for leaves in (15, 31, 63):
            trees = HistGradientBoostingClassifier(
                learning_rate=rate,
                max_leaf_nodes=leaves,
                max_iter=1000,
                early_stopping=False,
                categorical_features=categorical,
                random_state=0,
            ).fit(x["train"], y["train"])
            for n, p in enumerate(trees.staged_predict_proba(x["valid"]), 1):
                if n % 10 == 0:
                    valid = roc_auc_score(y["valid"], p[:, 1])
                    if best is None or valid > best[0]:
                        best = (valid, (rate, leaves, n), trees)
    valid, (rate, leaves, n), trees = best
    test = next(p for k, p in enumerate(trees.staged_predict_proba(x["eval"]), 1) if k == n)
    out["gradient-boosted trees"] = {
        "valid_auc": valid,
        "test_auc": roc_auc_score(y["eval"], test[:, 1]),
        "chosen": f"learning rate {rate}, {leaves} leaves, {n} trees",
        "grid_s": time.time() - t0,
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="dlrm,dcn,deepfm")
    ap.add_argument("--encodings", default=",".join(ENCODINGS))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=None, help="unset: the experiment's (early stopping ends most runs)")
    ap.add_argument("--extra", default="", help="overrides added to every hybridrec run, separated by spaces")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    a = ap.parse_args()
    if not os.path.isfile(os.path.join(DATA, "vocab", "native_country.parquet")):
        raise SystemExit("benchmarks/tabular.py: data/adult is missing: run `make data-adult` first")
    models, encodings = a.models.split(","), a.encodings.split(",")
    seeds = [int(s) for s in a.seeds.split(",")]
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "tabular.json")
    result: dict = {"machine": machine(), "steps": a.steps, "extra": a.extra, "baselines": baselines(), "runs": []}
    for name, b in result["baselines"].items():
        print(f"{name:24s} valid {b['valid_auc']:.4f} test {b['test_auc']:.4f} ({b['chosen']})", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:  # the configurations alternate within each seed
            for model in models:
                for encoding in encodings:
                    run = os.path.join(tmp, f"{model}_{encoding}_{seed}")
                    overrides = [
                        "+experiment=tabular",
                        f"model={model}",
                        f"data.numeric_encoding={encoding}",
                        f"seed={seed}",
                        *([f"train.steps={a.steps}"] if a.steps else []),
                        "train.eval_every=100",
                        "train.early_stop_patience=5",
                        "checkpoint.keep_best=true",
                        f"checkpoint.dir={run}/ckpt",
                        *a.extra.split(),
                    ]
                    s = train_summary(overrides, run)
                    r = {
                        "model": model,
                        "encoding": encoding,
                        "seed": seed,
                        "valid_auc": s["objective"]["best_value"],
                        "best_step": s["objective"]["best_step"],
                        "test_auc": s["eval"]["auc"],
                        "train_s": s["train"]["wall_time_s"],
                    }
                    result["runs"].append(r)
                    print(
                        f"{model:7s} {encoding:17s} seed {seed} valid {r['valid_auc']:.4f} test {r['test_auc']:.4f} "
                        f"step {r['best_step']} {r['train_s']:.0f} s",
                        flush=True,
                    )
                    with open(path, "w") as f:
                        json.dump(result, f, indent=1)
    write_report(result, a, models, encodings)


def write_report(result: dict, a: argparse.Namespace, models: list[str], encodings: list[str]) -> None:
    m, runs = result["machine"], result["runs"]

    def cell(model: str, enc: str) -> list[dict]:
        return [r for r in runs if r["model"] == model and r["encoding"] == enc]

    lines = [
        "# Tabular benchmark: the census income table",
        "",
        f"`python benchmarks/tabular.py --models {a.models} --encodings {a.encodings} --seeds {a.seeds}"
        f"{f' --steps {a.steps}' if a.steps else ''}{' --extra ' + repr(a.extra) if a.extra else ''}` on "
        f"{m.get('cpu', 'this CPU')} "
        f"({m.get('cores')} cores), torch {m.get('torch', '')}. data/adult (`make data-adult`): 34,189 training, "
        "7,326 validation and 7,327 test rows, cut once. Everything is chosen on the validation AUC; the test "
        "split is scored once per configuration, hybridrec's with the best validation checkpoint "
        "(`+experiment=tabular`, early stopping: validation every 100 steps, patience 5). Median over seeds "
        "(min - max).",
        "",
        "| model | chosen on validation | valid AUC | test AUC |",
        "|---|---|---:|---:|",
    ]
    for name, b in result["baselines"].items():
        lines.append(f"| {name} (scikit-learn) | {b['chosen']} | {b['valid_auc']:.4f} | {b['test_auc']:.4f} |")
    best: dict[str, tuple[float, str]] = {}
    for enc in encodings:
        chosen = max(models, key=lambda model: statistics.median(r["valid_auc"] for r in cell(model, enc)))
        best[enc] = (statistics.median(r["test_auc"] for r in cell(chosen, enc)), chosen)
        rs = cell(chosen, enc)
        lines.append(
            f"| hybridrec, numbers {enc} | {chosen} | {_spread([r['valid_auc'] for r in rs])} | "
            f"{_spread([r['test_auc'] for r in rs])} |"
        )
    trees = result["baselines"]["gradient-boosted trees"]["test_auc"]
    top = max(best.values())
    lines += [
        "",
        f"Best hybridrec entry ({top[1]}, numbers {max(best, key=lambda e: best[e])}): test AUC {top[0]:.4f}, "
        f"{top[0] - trees:+.4f} against gradient-boosted trees.",
        "",
        "Every configuration:",
        "",
        "| model | numbers | valid AUC | test AUC | best step | training s |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for model in models:
        for enc in encodings:
            rs = cell(model, enc)
            lines.append(
                f"| {model} | {enc} | {_spread([r['valid_auc'] for r in rs])} | {_spread([r['test_auc'] for r in rs])} "
                f"| {statistics.median(r['best_step'] for r in rs):.0f} | "
                f"{statistics.median(r['train_s'] for r in rs):.0f} |"
            )
    write_markdown(os.path.join(a.out, "TABULAR.md"), lines, "tabular benchmark")


if __name__ == "__main__":
    main()
