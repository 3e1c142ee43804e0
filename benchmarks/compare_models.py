"""DLRM, DLRM-DCNv2 and DeepFM on the two click-prediction experiments, one Hydra multirun
per experiment, as a user runs them:

    python -m hybridrec.train -m +experiment=ctr model=dlrm,dcn,deepfm
    python -m hybridrec.train -m +experiment=movielens model=dlrm,dcn,deepfm

Each experiment keeps its own settings (steps, batch, learning rates, validation every
train.eval_every steps, early stopping where it has it, one rank) and each model its sizes
for the experiment (conf/experiment_model/). Every job keeps its best checkpoint by the
validation objective (checkpoint.keep_best, in the job's directory) and scores the test split
with those weights: the best-checkpoint rule a sweep chooses by. The numbers are read from each
sweep's summary.csv (written by hybridrec/reports/sweep.py, the sweep-summary callback), and
benchmarks/results/MODELS.md gets one table per experiment and the settings, which README's
"Model comparison" section quotes (benchmarks/readme_numbers.py).

    python benchmarks/compare_models.py                       # make compare-models
    python benchmarks/compare_models.py --out /tmp/m.md train.steps=20   # a quick check

Arguments after the options are Hydra overrides added to both sweeps. MovieLens-100k must be
in data/ml-100k (`make data-movielens`).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import shutil
import statistics
import sys
import time

from common import ROOT, LoadAverage, machine, run_logged

HERE = os.path.dirname(os.path.abspath(__file__))

# The best-checkpoint rule: each job's checkpoints in its own directory, the best one kept.
BEST = ["checkpoint.keep_best=true", "checkpoint.keep_last=1", "checkpoint.dir=${hydra:runtime.output_dir}/checkpoints"]
MODELS = {"dlrm": "DLRM", "dcn": "DLRM-DCNv2", "deepfm": "DeepFM"}
EXPERIMENTS = {
    "ctr": "synthetic click log shaped like Criteo Kaggle (13 dense features, 26 tables of up to 1 M rows, "
    "64-dim embeddings), labels from a planted model",
    "movielens": "MovieLens-100k ratings (label: rating >= 4), user, item and side features, 16-dim "
    "embeddings, the experiment's fixed random split",
}


def sweep(experiment: str, runs: str, overrides: list[str]) -> list[dict[str, str]]:
    """One multirun over the models; the rows of its summary.csv, one per model, in order."""
    sweep_dir = os.path.join(runs, experiment)
    if os.path.exists(sweep_dir):  # an earlier comparison's jobs: Hydra would add to them
        shutil.rmtree(sweep_dir)
    os.makedirs(runs, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "hybridrec.train",
        "-m",
        f"+experiment={experiment}",
        f"model={','.join(MODELS)}",
        *BEST,
        *overrides,
        f"hydra.sweep.dir={sweep_dir}",
    ]
    run_logged(cmd, os.path.join(runs, f"{experiment}.log"))
    with open(os.path.join(sweep_dir, "summary.csv")) as f:
        rows = sorted(csv.DictReader(f), key=lambda r: int(r["job"]))  # the CSV ranks them by the objective
    if [(r["model"], r["status"]) for r in rows] != [(m, "ok") for m in MODELS]:
        raise RuntimeError(
            f"{sweep_dir}/summary.csv: expected one finished job per model, got "
            f"{[(r.get('model'), r['status'], r['error']) for r in rows]}"
        )
    for row in rows:
        with open(os.path.join(sweep_dir, row["dir"], "summary.json")) as f:
            summary = json.load(f)
        row["torch"] = summary["provenance"]["versions"]["torch"]
        row["objective"] = summary["objective"]
        row["stopped"] = summary["objective"]["stopped_early_at"]
        # the checkpoints served the final evaluation; the table keeps what they showed
        shutil.rmtree(os.path.join(sweep_dir, row["dir"], "checkpoints"), ignore_errors=True)
    return rows


def table(rows: list[dict[str, str]]) -> str:
    o = rows[0]["objective"]
    lines = [
        f"| model | test AUC | NE | {o['name']} (best) | at step | samples/s | dense parameters |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        o = r["objective"]
        at = f"{o['best_step']}" + (f" (stopped at {r['stopped']})" if r["stopped"] else "")
        lines.append(
            f"| {MODELS[r['model']]} (`model={r['model']}`) | {float(r['test_auc']):.4f} | {float(r['test_ne']):.4f} "
            f"| {o['best_value']:.4f} | {at} | {float(r['samples_per_second']):,.0f} "
            f"| {int(r['dense_parameters']):,} |"
        )
    return "\n".join(lines)


def setting(experiment: str, rows: list[dict[str, str]], key: str) -> str:
    values = {r[key] for r in rows}
    if len(values) != 1:
        raise RuntimeError(f"{experiment}: the models ran with different {key}: {sorted(values)}")
    return values.pop()


def report(results: dict[str, list[dict[str, str]]], overrides: list[str], wall_s: float, load: list[float]) -> str:
    m = machine()
    torch_version = {setting(e, rows, "torch") for e, rows in results.items()}
    out = [
        "# Model comparison",
        "",
        "`make compare-models` (`benchmarks/compare_models.py`): one Hydra multirun per experiment, "
        "`python -m hybridrec.train -m +experiment=<experiment> model=dlrm,dcn,deepfm"
        + "".join(f" {o}" for o in overrides)
        + "`. The numbers are each sweep's `summary.csv`.",
        "",
    ]
    for experiment, rows in results.items():
        out += [f"## {experiment}", "", f"`+experiment={experiment}`: {EXPERIMENTS[experiment]}.", "", table(rows), ""]
    ranks = lambda n: f"{n} rank" + ("" if n == "1" else "s")
    run = "; ".join(
        f"`{e}`: up to {max(int(r['steps']) for r in rows)} steps of global batch "
        f"{setting(e, rows, 'global_batch_size')} on {ranks(setting(e, rows, 'world_size'))}"
        for e, rows in results.items()
    )
    out += [
        "## Settings",
        "",
        f"- {run}; one seed, one run per model.",
        "- Each experiment's learning rates are its own, chosen for its default model (`ctr`: DLRM; "
        "`movielens`: DeepFM, with its embedding penalty); each model's sizes for the experiment, and "
        "`movielens`' penalty for DeepFM, are in `conf/experiment_model/<experiment>/<model>.yaml`. The other "
        "models are not tuned further.",
        f"- Every job ran with `{' '.join(BEST)}`: the best validation evaluation's checkpoint is kept, and the "
        "test split is scored once, at the end, with its weights (the step in the table; early stopping, where "
        "the experiment has it, ended the run at the step in brackets).",
        "- Test AUC and NE: the test split, scored once at the end. samples/s: the whole training run (its keep_best checkpoint saves included), "
        "evaluation excluded, from a single run on a shared machine (not the benchmark suite's method: "
        "see Performance). Dense parameters: every parameter outside the embedding tables.",
        f"- CPU: {m['cpu']} ({m['cores']} cores); torch {', '.join(sorted(torch_version))}, "
        f"torchrec {m['torchrec']}; {datetime.date.today().isoformat()}; wall time of both sweeps "
        f"{wall_s / 60:.1f} min.",
        f"- The machine's 1-minute load average during the sweeps: median {statistics.median(load):.1f}, max "
        f"{max(load):.1f} (one training rank on all {m['cores']} cores accounts for about {m['cores']}; more means "
        f"other work shared the cores and slowed the samples/s column).",
        "",
    ]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "MODELS.md"))
    parser.add_argument(
        "--runs", default=os.path.join(ROOT, "outputs", "compare-models"), help="where the sweeps' job directories go"
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both sweeps")
    args = parser.parse_args()
    start = time.perf_counter()
    with LoadAverage() as load:
        results = {e: sweep(e, args.runs, args.overrides) for e in EXPERIMENTS}
    text = report(results, args.overrides, time.perf_counter() - start, load.samples or [os.getloadavg()[0]])
    with open(args.out, "w") as f:
        f.write(text)
    print(text)
    print(f"compare_models: {args.out}")


if __name__ == "__main__":
    main()
