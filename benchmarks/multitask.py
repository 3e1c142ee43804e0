"""Multi-task models against single-task ones on ``+experiment=multitask`` (the synthetic log
with its planted conversion task), and both against the planted model.

Per seed (the seed draws the log, its planted models and the weights' initialization), each
configuration trains as a user runs it, keeps its best checkpoint by the validation objective
(checkpoint.keep_best) and scores the test split once with those weights:

- shared-bottom, MMoE and PLE on both tasks (the experiment's data.labels);
- the single-task DLRM-DCNv2 (the multi-task models' interaction) on the conversion alone and
  on the click alone, and the single-task DLRM on the click alone: the same rows, one label.

The planted model's test AUC of each task is computed on the same rows
(``planted_model.score``). benchmarks/results/MULTITASK.md gets the medians over the seeds,
their spread, and the per-seed differences the targets are about.

    python benchmarks/multitask.py                   # make bench-multitask
    python benchmarks/multitask.py --seeds 0 train.steps=100 --out /tmp/mt.md   # a quick check
    python benchmarks/multitask.py --report          # MULTITASK.md again from multitask.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

from common import ROOT, machine, write_markdown
from hybridrec.data import build_source
from planted_model import experiment_config, score

BEST = ["checkpoint.keep_best=true", "checkpoint.keep_last=1"]
CONFIGS = {
    "MMoE": ["model=mmoe"],
    "PLE": ["model=ple"],
    "shared-bottom": ["model=shared_bottom"],
    "DCNv2, conversion only": ["model=dcn", "data.labels=[{name:conversion}]"],
    "DCNv2, click only": ["model=dcn", "data.labels=[{name:click}]"],
    "DLRM, click only": ["model=dlrm", "data.labels=[{name:click}]"],
}
TASKS = ("click", "conversion")


def train(name: str, seed: int, overrides: list[str], runs: str) -> dict:
    out = os.path.join(runs, f"{name.replace(' ', '_').replace(',', '')}_seed{seed}")
    cmd = [
        sys.executable,
        "-m",
        "hybridrec.train",
        "+experiment=multitask",
        f"seed={seed}",
        *CONFIGS[name],
        *BEST,
        f"checkpoint.dir={out}/checkpoints",
        *overrides,
        f"hydra.run.dir={out}",
    ]
    tick = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)
    summary = json.load(open(os.path.join(out, "summary.json")))
    test = summary["eval"]
    return {
        "config": name,
        "seed": seed,
        "test": {t: test[f"{t}.auc"] for t in TASKS if f"{t}.auc" in test},
        "best_step": summary.get("objective", {}).get("best_step"),
        "wall_s": round(time.perf_counter() - tick, 1),
    }


def planted(seed: int, overrides: list[str]) -> dict[str, float]:
    cfg = experiment_config([f"seed={seed}", *overrides], "multitask")
    source = build_source(cfg.data, cfg.seed)
    return {t: score(source, "eval", t)["auc"] for t in TASKS}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "MULTITASK.md"))
    p.add_argument("--runs", default="/tmp/hybridrec_multitask")
    p.add_argument("--report", action="store_true", help="write the markdown again from the stored JSON")
    args, overrides = p.parse_known_args()
    folder, name = os.path.split(args.out)
    json_path = os.path.join(folder, os.path.splitext(name)[0].lower() + ".json")
    if args.report:
        result = json.load(open(json_path))
        result["planted"] = {int(k): v for k, v in result["planted"].items()}  # JSON keys are strings
        write_markdown(args.out, report(result), "multitask")
        return
    rows, refs = [], {}
    for seed in args.seeds:
        refs[seed] = planted(seed, overrides)
        for name in CONFIGS:  # every configuration of a seed before the next seed: drift spreads evenly
            rows.append(train(name, seed, overrides, args.runs))
            print(json.dumps(rows[-1]), flush=True)
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip(),
        "overrides": overrides,
        "seeds": args.seeds,
        "planted": refs,
        "runs": rows,
    }
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1)
    write_markdown(args.out, report(result), "multitask")


def _median(values: list[float]) -> str:
    if not values:
        return "–"
    spread = f" ({min(values):.4f}–{max(values):.4f})" if len(values) > 1 else ""
    return f"{statistics.median(values):.4f}{spread}"


def report(result: dict) -> list[str]:
    runs, seeds = result["runs"], result["seeds"]
    by = {(r["config"], r["seed"]): r["test"] for r in runs}
    m = result["machine"]
    lines = [
        "# Multi-task ranking against single-task models",
        "",
        f"`python benchmarks/multitask.py {' '.join(result['overrides'])}`".replace(" `", "`"),
        f"({result['date']}, hybridrec {result.get('commit', '?')}, {m['cpu']}, {m['cores']} cores, torch {m['torch']}, "
        f"torchrec {m['torchrec']}); "
        f"`+experiment=multitask`, seeds {', '.join(map(str, seeds))} (a seed draws the log, its planted "
        "models and the initialization). Each run keeps its best checkpoint by the validation objective and "
        "scores the test split once with it. Test AUC, median over the seeds (min–max):",
        "",
        "| model | click AUC | conversion AUC |",
        "|---|---|---|",
    ]
    for name in CONFIGS:
        cells = [_median([by[(name, s)][t] for s in seeds if t in by.get((name, s), {})]) for t in TASKS]
        lines.append(f"| {name} | {cells[0]} | {cells[1]} |")
    planted = result["planted"]
    lines.append(
        f"| planted model (the best possible) | {_median([planted[s]['click'] for s in planted])} | "
        f"{_median([planted[s]['conversion'] for s in planted])} |"
    )
    lines += [
        "",
        "## Against the single-task models and the planted model",
        "",
        "Per seed, the differences (test AUC), median over the seeds (min–max):",
        "",
    ]
    lines.append(
        "| model | conversion − single-task conversion | planted conversion − conversion | click − DLRM click |"
    )
    lines.append("|---|---|---|---|")
    for name in ("MMoE", "PLE", "shared-bottom"):
        diffs = [
            (
                by[(name, s)]["conversion"] - by[("DCNv2, conversion only", s)]["conversion"],
                planted[s]["conversion"] - by[(name, s)]["conversion"],
                by[(name, s)]["click"] - by[("DLRM, click only", s)]["click"],
            )
            for s in seeds
        ]
        cells = [_median([d[i] for d in diffs]) for i in range(3)]
        lines.append(f"| {name} | {cells[0]} | {cells[1]} | {cells[2]} |")
    return lines


if __name__ == "__main__":
    main()
