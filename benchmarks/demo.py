"""The README's quick start, run and timed: `make demo` trains the ctr experiment, scores its
newest checkpoint on the test split and exports it, all under outputs/demo/.

    python benchmarks/demo.py             # what `make demo` runs: outputs/demo/DEMO.md
    python benchmarks/demo.py --results   # also benchmarks/results/DEMO.md (the README's table)

Each command is printed before it runs, with its output streamed as it comes; the table at
the end gives each step's wall time, the machine and its load average while it ran (the
times depend on what else shares the cores). The README's quick-start block shows exactly
``COMMANDS`` (tests/test_docs.py compares them).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time

from common import ROOT, LoadAverage, machine, write_markdown

DEMO = "outputs/demo"
# (step, command, what it leaves). The commands are run from the repository root.
COMMANDS = [
    (
        "train",
        f"python -m hybridrec.train +experiment=ctr checkpoint.dir={DEMO}/checkpoints",
        f"`{DEMO}/train/`: `train.log`, `metrics.jsonl`, `report.png`, `summary.json`; checkpoints",
    ),
    (
        "evaluate",
        f"python -m hybridrec.evaluate checkpoint={DEMO}/checkpoints",
        f"`{DEMO}/evaluate/`: `metrics.json`, `predictions.parquet`",
    ),
    (
        "export",
        f"python -m hybridrec.export checkpoint={DEMO}/checkpoints out={DEMO}/export",
        f"`{DEMO}/export/`: `model.pt2`, `model.json`, `preprocessing.json`",
    ),
]
# Where each step's run directory goes (Hydra's default is a dated folder under outputs/):
# fixed names, so the table can point at them.
RUN_DIRS = {"train": f"hydra.run.dir={DEMO}/train", "evaluate": f"hydra.run.dir={DEMO}/evaluate"}


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {seconds % 60:.0f} s" if seconds >= 60 else f"{seconds:.0f} s"


def run(step: str, command: str) -> float:
    args = shlex.split(command) + ([RUN_DIRS[step]] if step in RUN_DIRS else [])
    print(f"\n$ {command}", flush=True)
    start = time.perf_counter()
    # the virtualenv's interpreter for `python`, as the README's activated shell has it
    proc = subprocess.run([sys.executable, *args[1:]], cwd=ROOT)
    if proc.returncode:
        sys.exit(f"demo: the {step} step failed (exit {proc.returncode}); its output is above")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", action="store_true", help="also write benchmarks/results/DEMO.md")
    args = parser.parse_args()
    folder = os.path.join(ROOT, DEMO)
    if os.path.exists(folder):  # its own folder from an earlier demo: a new run would resume it
        print(f"demo: starting over, removing {DEMO}/ (an earlier demo's)")
        shutil.rmtree(folder)
    times = {}
    with LoadAverage() as load:
        for step, command, _ in COMMANDS:
            times[step] = run(step, command)
    with open(os.path.join(folder, "train", "summary.json")) as f:
        summary = json.load(f)
    m = machine()
    loads = load.samples or [os.getloadavg()[0]]
    test = summary["eval"]
    # what the data allows: the experiment's reference on the test split (the planted model)
    ref = next((r for r in summary.get("references", []) if r["metric"] == "eval.auc"), None)
    lines = [
        "# The quick start, timed",
        "",
        "`make demo` (`benchmarks/demo.py`): the README's three commands, one after the other.",
        "",
        "| step | wall time | what it leaves |",
        "|---|---:|---|",
    ]
    lines += [f"| {step} | {minutes(times[step])} | {leaves} |" for step, _, leaves in COMMANDS]
    lines += [
        f"| all three | {minutes(sum(times.values()))} | test AUC {test['auc']:.4f}"
        + (f" ({ref['name']}: {ref['value']:.4f})" if ref else "")
        + " |",
        "",
        f"- {m['cpu']}, {m['cores']} cores; torch {m['torch']}, torchrec {m['torchrec']}; "
        f"{datetime.date.today().isoformat()}.",
        f"- The machine's 1-minute load average meanwhile: median {statistics.median(loads):.1f}, max "
        f"{max(loads):.1f} (one training process on all {m['cores']} cores accounts for about {m['cores']}).",
        "- Not included: `make install`, which the first `make demo` runs first (pip, a few minutes).",
    ]
    write_markdown(os.path.join(folder, "DEMO.md"), lines, "demo")
    if args.results:
        write_markdown(os.path.join(ROOT, "benchmarks", "results", "DEMO.md"), lines, "results")


if __name__ == "__main__":
    main()
