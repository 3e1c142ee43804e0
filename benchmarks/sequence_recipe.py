"""The training recipe of the sequence rankers, measured: each choice of the field's public
recipes against ``+experiment=sequences`` as it ships, on MovieLens-100k, several seeds.

    python benchmarks/sequence_recipe.py [--models sasrec,hstu] [--seeds 0,1,2] [--steps 1000]

Every run is ``python -m hybridrec.train +experiment=sequences model=<m> seed=<s>
checkpoint.keep_best=true train.eval_every=50 train.early_stop_patience=5 <choice>``: it stops
once the validation NDCG@10 has not improved for 5 evaluations, and the test split is scored
once, with the best validation checkpoint. The configurations alternate within each seed.
Reported per configuration: the median over seeds of the best validation NDCG@10 (what
chooses) and of the test HR@10 and NDCG@10, with their spread (min - max), the best step and
the training time. Writes benchmarks/results/SEQUENCE_RECIPE.md and sequence_recipe.json
(``--report NAME``: NAME.md and name.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from common import machine, train_summary, write_markdown

HERE = os.path.dirname(os.path.abspath(__file__))
# name -> overrides on top of +experiment=sequences (and the early stopping above)
CHOICES = {
    "shipped": [],
    "item table lr 0.05": ["optimizer.sparse.lr=0.05"],
    "loss by position": ["loss.average=position"],
    "cosine, temperature 0.05, item lr 0.05": [
        "model.l2_normalize=true",
        "loss.temperature=0.05",
        "optimizer.sparse.lr=0.05",
    ],
    "dropout 0.2": ["model.dropout=0.2"],
    "histories of 200": ["data.max_length=200", "model.max_length=200"],
    "4 blocks": ["model.num_blocks=4"],
    "every item a target": ["data.train_windows=all"],
    "every item a target, loss by position": ["data.train_windows=all", "loss.average=position"],
    "overlapping windows": ["data.train_windows=overlap"],
    "embedding dim 128": ["model.embedding_dim=128"],
    "AdamW betas (0.9, 0.98)": [
        "optimizer/dense=adamw",
        "optimizer.dense.lr=0.001",
        "optimizer.dense.betas=[0.9,0.98]",
    ],
}


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.4f} ({min(values):.4f} - {max(values):.4f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="sasrec,hstu")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--choices", default=";".join(CHOICES), help="names of CHOICES, separated by ;")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--report", default="SEQUENCE_RECIPE", help="the report's name: <out>/<report>.md and .json")
    a = ap.parse_args()
    models, seeds = a.models.split(","), [int(s) for s in a.seeds.split(",")]
    choices = [c for c in CHOICES if c in a.choices.split(";")]
    runs: list[dict] = []
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"{a.report.lower()}.json")
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            for model in models:
                for choice in choices:
                    run = os.path.join(tmp, f"{model}_{seed}_{len(runs)}")
                    base = ["+experiment=sequences", f"model={model}", f"seed={seed}", f"train.steps={a.steps}"]
                    stop = ["checkpoint.keep_best=true", f"checkpoint.dir={run}/ckpt", "train.eval_every=50"]
                    t0 = time.time()
                    s = train_summary([*base, *stop, "train.early_stop_patience=5", *CHOICES[choice]], run)
                    r = {
                        "model": model,
                        "choice": choice,
                        "seed": seed,
                        "valid_ndcg@10": s["objective"]["best_value"],
                        "best_step": s["objective"]["best_step"],
                        "test": s["eval"],
                        "train_s": s["train"]["wall_time_s"],
                        "run_s": time.time() - t0,
                    }
                    runs.append(r)
                    print(
                        f"{model} seed {seed} {choice:42s} valid {r['valid_ndcg@10']:.4f} test HR@10 "
                        f"{r['test']['hr@10']:.4f} NDCG@10 {r['test']['ndcg@10']:.4f} step {r['best_step']} "
                        f"{r['train_s']:.0f} s",
                        flush=True,
                    )
                    with open(path, "w") as f:
                        json.dump({"machine": machine(), "steps": a.steps, "runs": runs}, f, indent=1)
    m = machine()
    lines = [
        "# Sequence rankers: the training recipe, measured",
        "",
        f"`python benchmarks/sequence_recipe.py --models {a.models} --seeds {a.seeds} --steps {a.steps}"
        + (f" --choices '{a.choices}' --report {a.report}" if a.report != "SEQUENCE_RECIPE" else "")
        + "` on "
        f"{m.get('cpu', 'this CPU')}, torch {m.get('torch', '')}. MovieLens-100k, each user's last item held out, "
        "the whole catalogue ranked, nothing masked. Each run: `+experiment=sequences` plus the choice, early "
        "stopping on the validation NDCG@10 (every 50 steps, patience 5), the test split scored once with the best "
        "validation checkpoint. Median over seeds (min - max).",
        "",
        "| model | choice | valid NDCG@10 | test HR@10 | test NDCG@10 | best step | training s |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for model in models:
        for choice in choices:
            rs = [r for r in runs if r["model"] == model and r["choice"] == choice]
            lines.append(
                f"| {model} | {choice} | {_spread([r['valid_ndcg@10'] for r in rs])} | "
                f"{_spread([r['test']['hr@10'] for r in rs])} | {_spread([r['test']['ndcg@10'] for r in rs])} | "
                f"{statistics.median(r['best_step'] for r in rs):.0f} | {statistics.median(r['train_s'] for r in rs):.0f} |"
            )
    write_markdown(os.path.join(a.out, f"{a.report}.md"), lines, "sequence recipe")


if __name__ == "__main__":
    main()
