"""World-size consistency of the shipped defaults: the same experiment, seed and global
batches on 1 and on 2 ranks, as a user would run them.

    python benchmarks/consistency.py [--experiments ctr movielens] [--out benchmarks/results]

Runs ``python -m hybridrec.train +experiment=NAME launcher.nproc_per_node=N`` for N = 1, 2
and compares the final train loss (mean of the last 10% of steps) and the eval (test) AUC.
The equivalence tests prove the math on small models at 1e-5; this shows what a user sees on
the real experiments, where the only difference left is the order in which the ranks'
gradients are summed. Writes CONSISTENCY.md and the same table into REPORT.md between the
``<!-- consistency -->`` markers (appended when the report has none).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

from common import machine

HERE = os.path.dirname(os.path.abspath(__file__))

BEGIN, END = "<!-- consistency:begin -->", "<!-- consistency:end -->"


def run(experiment: str, ranks: int, tmp: str) -> dict:
    out = os.path.join(tmp, f"{experiment}-{ranks}")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "hybridrec.train",
            f"+experiment={experiment}",
            f"launcher.nproc_per_node={ranks}",
            f"hydra.run.dir={out}",
        ],
        check=True,
        capture_output=True,
        cwd=os.path.dirname(HERE),
    )
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


def table(results: dict[str, dict[int, dict]]) -> str:
    rows = [
        "| experiment | steps | train loss, 1 rank | 2 ranks | rel. diff | test AUC, 1 rank | 2 ranks | rel. diff |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, by_world in results.items():
        one, two = by_world[1], by_world[2]
        rel = lambda a, b: abs(a - b) / abs(a)
        rows.append(
            f"| `{name}` | {one['steps']} | {one['train_loss']:.5f} | {two['train_loss']:.5f} | "
            f"{rel(one['train_loss'], two['train_loss']):.1e} | {one['eval']['auc']:.5f} | {two['eval']['auc']:.5f} | "
            f"{rel(one['eval']['auc'], two['eval']['auc']):.1e} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experiments", nargs="+", default=["ctr", "movielens"])
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: {n: run(name, n, tmp) for n in (1, 2)} for name in args.experiments}
    m = machine()
    section = (
        f"## World-size consistency\n\n"
        f"The shipped experiments with their defaults (same seed, same global batches) on 1 and 2 ranks "
        f"(`python benchmarks/consistency.py`; {m['cpu']}, {m['cores']} cores, torch {m['torch']}). "
        f"The equivalence tests check the math at 1e-5 on small models; here the only difference left is "
        f"the order in which the ranks' partial gradients are summed.\n\n{table(results)}\n"
    )
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "CONSISTENCY.md"), "w") as f:
        f.write(section)
    report = os.path.join(args.out, "REPORT.md")
    if os.path.isfile(report):
        text = open(report).read()
        block = f"{BEGIN}\n{section}{END}"
        if BEGIN in text:
            text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, text, flags=re.S)
        else:
            text = text.rstrip("\n") + "\n\n" + block + "\n"
        with open(report, "w") as f:
            f.write(text)
    print(section)


if __name__ == "__main__":
    main()
