"""What each shipped experiment leaves on disk: its run directory, the checkpoints a run with
``checkpoint.dir`` keeps (``checkpoint.keep_last`` newest, plus the best), and an export of
its newest checkpoint. Every experiment runs with its defaults, as the guides run it.

    python benchmarks/disk_use.py [--out DIR] [--experiments ctr movielens ...]

Writes DISK.md and disk.json into --out (benchmarks/results/). ``dcnv2_criteo1tb`` needs
the Criteo 1TB copy: its checkpoint is estimated from its tables instead (the weights in
float32 plus the row-wise optimizer's one float per row), not measured.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import subprocess
import sys
import tempfile

from common import ROOT, compose_config, machine, train_summary, write_markdown

HERE = os.path.dirname(os.path.abspath(__file__))
EXPERIMENTS = [
    "ctr",
    "movielens",
    "movielens_rank",
    "movielens_retrieval",
    "sequences",
    "feature_log",
    "continuous",
]


def disk_bytes(path: str) -> int:
    """The blocks ``path`` takes (what ``du`` counts), every file under it included."""
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            total += os.lstat(os.path.join(folder, name)).st_blocks * 512
    return total


def human(n: float) -> str:
    """Binary units, as ``du -h`` counts (its M is a MiB)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit in ("B", "KiB") else f"{n:,.1f} {unit}"
        n /= 1024
    raise AssertionError


def measure(experiment: str, tmp: str) -> dict:
    run_dir, ckpt = os.path.join(tmp, f"{experiment}_run"), os.path.join(tmp, f"{experiment}_ckpt")
    train_summary([f"+experiment={experiment}", f"checkpoint.dir={ckpt}"], run_dir)
    kept = sorted(glob.glob(os.path.join(ckpt, "step_*")))
    export = os.path.join(tmp, f"{experiment}_export")
    subprocess.run(
        [sys.executable, "-m", "hybridrec.export", f"checkpoint={ckpt}", f"out={export}"],
        check=True,
        capture_output=True,
        cwd=ROOT,
    )
    # a continuous run also keeps its serving export and deltas under <checkpoint.dir>/serving
    serving = os.path.join(ckpt, "serving")
    return {
        "experiment": experiment,
        "run_dir": disk_bytes(run_dir),
        "checkpoints": len(kept),
        "checkpoint": max(disk_bytes(k) for k in kept),
        "checkpoint_dir": disk_bytes(ckpt),
        "serving": disk_bytes(serving) if os.path.isdir(serving) else 0,
        "export": disk_bytes(export),
    }


def estimate(experiment: str) -> dict:
    """A checkpoint's size from the tables alone: rows x dim x 4 bytes, plus 4 bytes a row."""
    cfg = compose_config([f"+experiment={experiment}"])
    dim = cfg.model.embedding_dim
    rows = sum(cfg.data.num_embeddings_per_feature)  # the synthetic-shaped sources' tables
    return {"experiment": experiment, "rows": rows, "checkpoint": rows * (dim * 4 + 4), "dim": dim}


def report(res: dict) -> list[str]:
    m = res["machine"]
    lines = [
        "# Disk use per experiment",
        "",
        "Each shipped experiment with its defaults and `checkpoint.dir` set, then `python -m hybridrec.export` of "
        "its newest checkpoint. Without `checkpoint.dir` a run writes only its run directory.",
        "",
        "| experiment | run directory | checkpoints kept | checkpoint directory | export | total |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in res["measured"]:
        total = r["run_dir"] + r["checkpoint_dir"] + r["export"]
        kept = f"{r['checkpoints']} x {human(r['checkpoint'])}"
        lines.append(
            f"| `{r['experiment']}` | {human(r['run_dir'])} | {kept} | {human(r['checkpoint_dir'])}"
            + (f" (serving exports {human(r['serving'])})" if r["serving"] else "")
            + f" | {human(r['export'])} | {human(total)} |"
        )
    for r in res["estimated"]:
        lines.append(
            f"| `{r['experiment']}` (estimated) | - | about {human(r['checkpoint'])} each | - | about "
            f"{human(r['rows'] * r['dim'] * 4)} | - |"
        )
    lines += [
        "",
        f"- {m['cpu']}, {m['cores']} cores; torch {m['torch']}; {res['date']}. Sizes are blocks on disk (`du`).",
        "- A checkpoint holds the tables (rows x `model.embedding_dim` x 4 bytes), the row-wise optimizer's "
        "state and the dense part; an export holds the weights without the optimizer. `checkpoint.keep_last` "
        "sets how many are kept (the best one is kept beside them).",
        "- `make clean` removes `outputs/` and `multirun/`; a `checkpoint.dir` outside `outputs/` is the user's "
        "to remove.",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--experiments", nargs="+", default=EXPERIMENTS)
    args = parser.parse_args()
    res: dict = {"machine": machine(), "date": datetime.date.today().isoformat(), "measured": []}
    with tempfile.TemporaryDirectory() as tmp:
        for experiment in args.experiments:
            print(f"{experiment} ...", flush=True)
            res["measured"].append(measure(experiment, tmp))
    res["estimated"] = [estimate("dcnv2_criteo1tb")]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "disk.json"), "w") as f:
        json.dump(res, f, indent=1)
    write_markdown(os.path.join(args.out, "DISK.md"), report(res), "disk")


if __name__ == "__main__":
    main()
