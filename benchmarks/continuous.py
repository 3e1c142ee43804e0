"""Continuous training against a model trained once, on the drifting example log.

For each seed, the 14-day log of ``python -m hybridrec.data.example --layout days --seed S``
(new items every day, popularity and click biases that drift) is trained two ways with
``+experiment=continuous`` (DLRM, one pass over each day, each day scored before it is
trained on):

- **continuous**: every day trained on, in order;
- **trained once**: ``data.partitions.train_until`` = the 7th day: the first 7 days trained
  on, the 7 later ones scored by that model, never updated.

Both are judged on the same rows: the progressive AUC, NE and log loss of days 8 to 14, each
scored by a model that has not seen it. The ratio of the means is per seed, then the median.

    python benchmarks/continuous.py [--seeds 0 1 2]

Writes benchmarks/results/CONTINUOUS.md and continuous.json, and copies the first seed's
continuous report.png to docs/continuous_report.png.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from common import ROOT, machine, train_summary, write_markdown

HERE = os.path.dirname(os.path.abspath(__file__))
UNTIL = "2023-11-20"  # the 7th day of the example log
LATER = 7  # the days after it


def _later(summary: dict) -> dict[str, float]:
    """The mean progressive metrics of the last LATER days."""
    days = summary["freshness"]["partitions"][-LATER:]
    return {k: statistics.fmean(d["eval"][k] for d in days) for k in ("auc", "ne", "logloss")}


def run(seeds: list[int], out: str) -> dict:
    res: dict = {"seeds": [], "machine": machine(), "until": UNTIL}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            log = os.path.join(tmp, f"log{seed}")
            subprocess.run([sys.executable, "-m", "hybridrec.data.example", "--layout", "days", "--out", log,
                            "--seed", str(seed)], check=True, capture_output=True, cwd=ROOT)
            paths = [f"data.train_path={log}/train", f"data.valid_path={log}/valid", f"data.eval_path={log}/eval"]
            row: dict = {"seed": seed}
            for name, extra in (("continuous", []), ("once", [f"data.partitions.train_until={UNTIL}"])):
                run_dir = os.path.join(tmp, f"{name}{seed}")
                tick = time.perf_counter()
                s = train_summary(["+experiment=continuous", *paths, *extra], run_dir)
                row[name] = {**_later(s), "steps": s["steps"], "wall_s": round(time.perf_counter() - tick, 1),
                             "days": [{"partition": d["partition"], "auc": d["eval"]["auc"], "trained": d["trained"],
                                       "new_ids": d["new_ids"]} for d in s["freshness"]["partitions"]]}
                if seed == seeds[0] and name == "continuous":
                    os.makedirs(os.path.join(ROOT, "docs"), exist_ok=True)
                    shutil.copy(os.path.join(run_dir, "report.png"), os.path.join(ROOT, "docs", "continuous_report.png"))
            res["seeds"].append(row)
            print(f"seed {seed}: continuous AUC {row['continuous']['auc']:.4f}, once {row['once']['auc']:.4f}",
                  flush=True)
    with open(os.path.join(out, "continuous.json"), "w") as f:
        json.dump(res, f, indent=1)
    write_markdown(os.path.join(out, "CONTINUOUS.md"), report(res), "continuous")
    return res


def report(res: dict) -> list[str]:
    m = res["machine"]
    rows = res["seeds"]
    med = lambda key, metric: statistics.median(r[key][metric] for r in rows)
    gain = statistics.median(r["continuous"]["auc"] - r["once"]["auc"] for r in rows)
    lines = [
        "# Continuous training on a drifting log",
        "",
        f"The example's 14 daily partitions (`--layout days`: new items every day, drifting popularity and click "
        f"biases), {len(rows)} seeds of the log. Days 8 to 14, each scored before the model trains on it "
        f"(progressive validation), mean over the 7 days; median over seeds. `+experiment=continuous` (DLRM, "
        f"one pass over each day); trained once = `data.partitions.train_until={res['until']}`: the first 7 days, "
        f"then scored only.",
        "",
        "| model | progressive AUC, days 8-14 | NE | log loss |",
        "|---|---:|---:|---:|",
        *[f"| {label} | {med(key, 'auc'):.4f} | {med(key, 'ne'):.4f} | {med(key, 'logloss'):.4f} |"
          for key, label in (("continuous", "trained day by day"), ("once", "trained once, on days 1-7"))],
        "",
        f"Continuous training is ahead by {gain:+.4f} AUC (median over seeds; per seed: "
        + ", ".join(f"{r['continuous']['auc'] - r['once']['auc']:+.4f}" for r in rows) + ").",
        "",
        "## Per day (first seed)",
        "",
        "| day | trained day by day | trained once | new item ids |",
        "|---|---:|---:|---:|",
    ]
    first = rows[0]
    for c, o in zip(first["continuous"]["days"], first["once"]["days"]):
        lines.append(f"| {c['partition']} | {c['auc']:.4f} | {o['auc']:.4f}{'' if o['trained'] else ' (scored only)'} "
                     f"| {c['new_ids'].get('item', 0):,} |")
    lines += ["", f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}. The first day is scored by an "
                  f"untrained model. Each run: about {statistics.fmean(r['continuous']['wall_s'] for r in rows):.0f} s "
                  f"(process start, 14 days, 15 progressive evaluations, final validation and test)."]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    run(args.seeds, args.out)


if __name__ == "__main__":
    main()
