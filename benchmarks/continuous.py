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

Managed ids: the item table (the shown item and the history share it, ``id_mapping:
managed``) sized for every item the log shows, then for a quarter of them (evictions: by
``lfu`` and by ``lru``; a reused row started over, and inherited with
``data.managed_ids.reset=false``), and, for reference, a quarter-size table that hashes the
ids: the mean progressive AUC over days 2 to 14 (the objective) of each, day by day.

The whole report is printed at the end: the README's table is its first.

    python benchmarks/continuous.py [--seeds 0 1 2] [--out DIR] [--docs]

Writes CONTINUOUS.md, continuous.json and the first seed's continuous report.png
(continuous_report.png) into --out (benchmarks/results/); --docs also copies that figure
over docs/continuous_report.png, the guides' (refreshing the docs is a step of its own).
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
            subprocess.run(
                [sys.executable, "-m", "hybridrec.data.example", "--layout", "days", "--out", log, "--seed", str(seed)],
                check=True,
                capture_output=True,
                cwd=ROOT,
            )
            paths = [f"data.train_path={log}/train", f"data.valid_path={log}/valid", f"data.eval_path={log}/eval"]
            row: dict = {"seed": seed}
            for name, extra in (("continuous", []), ("once", [f"data.partitions.train_until={UNTIL}"])):
                run_dir = os.path.join(tmp, f"{name}{seed}")
                tick = time.perf_counter()
                s = train_summary(["+experiment=continuous", *paths, *extra], run_dir)
                row[name] = {
                    **_later(s),
                    "steps": s["steps"],
                    "wall_s": round(time.perf_counter() - tick, 1),
                    "objective": s["objective"]["value"],
                    "days": [
                        {
                            "partition": d["partition"],
                            "auc": d["eval"]["auc"],
                            "trained": d["trained"],
                            "new_ids": d["new_ids"],
                            "managed_ids": d.get("managed_ids", {}),
                        }
                        for d in s["freshness"]["partitions"]
                    ],
                }
                if seed == seeds[0] and name == "continuous":
                    os.makedirs(out, exist_ok=True)
                    shutil.copy(os.path.join(run_dir, "report.png"), os.path.join(out, "continuous_report.png"))
            # every item id the log shows (the day-by-day run's last version): the full table
            distinct = row["continuous"]["days"][-1]["managed_ids"]["item_table"]["rows_used"]
            quarter = -(-distinct // 4) + 1  # + row 0, the row of ids without one
            row["distinct_items"] = distinct
            for name, extra in (
                ("managed_full", [f"data.sparse.1.num_embeddings={distinct + 1}"]),
                ("managed_quarter", [f"data.sparse.1.num_embeddings={quarter}"]),
                ("managed_quarter_lru", [f"data.sparse.1.num_embeddings={quarter}", "data.managed_ids.eviction=lru"]),
                (
                    "managed_quarter_inherit",
                    [f"data.sparse.1.num_embeddings={quarter}", "data.managed_ids.reset=false"],
                ),
                (
                    "hash_quarter",
                    [
                        f"data.sparse.1.num_embeddings={quarter}",
                        "data.sparse.1.id_mapping=hash",
                        "data.sparse.2.id_mapping=hash",
                    ],
                ),
            ):
                sizes = [extra[0], extra[0].replace("sparse.1", "sparse.2"), *extra[1:]]
                s = train_summary(["+experiment=continuous", *paths, *sizes], os.path.join(tmp, f"{name}{seed}"))
                last = s["freshness"]["partitions"][-1].get("managed_ids", {}).get("item_table", {})
                row[name] = {
                    "auc": s["objective"]["value"],
                    "rows": int(extra[0].split("=")[1]),
                    "evicted": sum(
                        d.get("managed_ids", {}).get("item_table", {}).get("evicted", 0)
                        for d in s["freshness"]["partitions"]
                    ),
                    "last_day_misses": last.get("misses"),
                    "last_day_hits": last.get("hits"),
                }
            res["seeds"].append(row)
            print(
                f"seed {seed}: continuous AUC {row['continuous']['auc']:.4f}, once {row['once']['auc']:.4f}", flush=True
            )
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
        *[
            f"| {label} | {med(key, 'auc'):.4f} | {med(key, 'ne'):.4f} | {med(key, 'logloss'):.4f} |"
            for key, label in (("continuous", "trained day by day"), ("once", "trained once, on days 1-7"))
        ],
        "",
        f"Continuous training is ahead by {gain:+.4f} AUC (median over seeds; per seed: "
        + ", ".join(f"{r['continuous']['auc'] - r['once']['auc']:+.4f}" for r in rows)
        + ").",
        "",
        "## Per seed",
        "",
        "| seed | trained day by day | trained once | difference |",
        "|---:|---:|---:|---:|",
        *[
            f"| {r['seed']} | {r['continuous']['auc']:.4f} | {r['once']['auc']:.4f} | "
            f"{r['continuous']['auc'] - r['once']['auc']:+.4f} |"
            for r in rows
        ],
        "",
        "Seed 0 is the log `make data-example` writes: `python -m hybridrec.train +experiment=continuous` prints "
        "each of its days' progressive AUC (the Per day table below); the mean of days 8-14 is the first column.",
        "",
        "## Managed ids: a quarter of the table",
        "",
        "The item table (`id_mapping: managed`, shared by the shown item and the history), sized for every item "
        "id the log shows, for a quarter of them (evicting by `lfu`, the default, or `lru`; a row an evicted id "
        "held starts over for its new id, or with `data.managed_ids.reset=false` the new id inherits it), and a "
        "quarter-size table that hashes the ids instead. Mean progressive AUC over days 2-14 (the run's "
        "objective: the partitions are scored before they are trained on, so it is the validation that "
        "chooses), median over seeds.",
        "",
        "| item table | rows | progressive AUC | vs every id | evictions (14 days) | misses, last day |",
        "|---|---:|---:|---:|---:|---:|",
        *[
            f"| {label} | {statistics.median(r[key]['rows'] for r in rows):,.0f} | {med(key, 'auc'):.4f} | "
            f"{statistics.median(r[key]['auc'] - r['managed_full']['auc'] for r in rows):+.4f} | "
            f"{statistics.median(r[key]['evicted'] for r in rows):,.0f} | "
            + (
                f"{statistics.median(r[key]['last_day_misses'] / (r[key]['last_day_hits'] + r[key]['last_day_misses']) for r in rows):.1%} |"
                if rows[0][key]["last_day_misses"] is not None
                else "- |"
            )
            for key, label in (
                ("managed_full", "managed, every id"),
                ("managed_quarter", "managed, a quarter (lfu; a reused row starts over)"),
                ("managed_quarter_lru", "managed, a quarter, `eviction=lru`"),
                ("managed_quarter_inherit", "managed, a quarter, `reset=false` (a reused row inherits)"),
                ("hash_quarter", "hashed, a quarter"),
            )
        ],
        "",
        "## Per day (first seed)",
        "",
        "| day | trained day by day | trained once | new item ids |",
        "|---|---:|---:|---:|",
    ]
    first = rows[0]
    for c, o in zip(first["continuous"]["days"], first["once"]["days"]):
        lines.append(
            f"| {c['partition']} | {c['auc']:.4f} | {o['auc']:.4f}{'' if o['trained'] else ' (scored only)'} "
            f"| {c['new_ids'].get('item', 0):,} |"
        )
    lines += [
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}. The first day is scored by an "
        f"untrained model. Each run: about {statistics.fmean(r['continuous']['wall_s'] for r in rows):.0f} s "
        f"(process start, 14 days, 15 progressive evaluations, final validation and test).",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--docs", action="store_true", help="also copy the figure to docs/continuous_report.png")
    args = parser.parse_args()
    run(args.seeds, args.out)
    if args.docs:
        shutil.copy(
            os.path.join(args.out, "continuous_report.png"), os.path.join(ROOT, "docs", "continuous_report.png")
        )


if __name__ == "__main__":
    main()
