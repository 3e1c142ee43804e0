"""hybridrec against both hand-written TorchRec loops on ctr's shapes, side by side:

- ``reference, hybridrec input``: benchmarks/reference_torchrec.py reading the synthetic click
  log each step, as hybridrec does (the suite's reference, make bench);
- ``reference, pre-generated``: the same loop on TorchRec's RandomRecDataset, 10 batches
  generated up front and cycled, as TorchRec's own examples feed it: no input cost at all.

    python benchmarks/references.py [--reps 3] [--steps 150] [--warmup 30] [--ranks 2]

Each repetition runs the three in turn (alternating). Rates are steady state, from the end of
step ``--warmup`` to the last step, measured the same way for all three (hybridrec: its
metrics.jsonl log windows, logged every ``warmup`` steps, as make bench reads them; the
references: a barrier at both ends). hybridrec runs ``mesh=ddp``, the references' dense
wrapper. Writes benchmarks/results/REFERENCES.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

from common import ROOT, machine, steady_rate, write_markdown

HERE = os.path.dirname(os.path.abspath(__file__))


def hybridrec(ranks: int, steps: int, warmup: int, tmp: str) -> float:
    out = os.path.join(tmp, "hybridrec")
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "hybridrec.train", "+experiment=ctr", "mesh=ddp",
                    f"launcher.nproc_per_node={ranks}", f"train.steps={steps}", f"train.log_every={warmup}",
                    "train.eval_every=0", f"hydra.run.dir={out}"], check=True, capture_output=True, cwd=ROOT)
    with open(os.path.join(out, "summary.json")) as f:
        batch = json.load(f)["global_batch_size"]
    return steady_rate(out, batch, warmup)


def reference(ranks: int, steps: int, warmup: int, tmp: str, input_: str) -> float:
    out = os.path.join(tmp, f"ref-{input_}.json")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    subprocess.run([torchrun, "--standalone", "--nproc_per_node", str(ranks), os.path.join(HERE, "reference_torchrec.py"),
                    "--steps", str(steps), "--warmup", str(warmup), "--out", out, "--input", input_, "--device", "cpu"],
                   check=True, capture_output=True, cwd=ROOT)
    with open(out) as f:
        return json.load(f)["samples_per_second"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "REFERENCES.md"))
    args = parser.parse_args()
    runs = {
        "hybridrec (`+experiment=ctr mesh=ddp`)": lambda tmp: hybridrec(args.ranks, args.steps, args.warmup, tmp),
        "reference, hybridrec input": lambda tmp: reference(args.ranks, args.steps, args.warmup, tmp, "hybridrec"),
        "reference, pre-generated (RandomRecDataset)": lambda tmp: reference(args.ranks, args.steps, args.warmup, tmp,
                                                                            "pregenerated"),
    }
    rates: dict[str, list[float]] = {name: [] for name in runs}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.reps):
            for name, go in runs.items():
                rates[name].append(go(tmp))
    med = {name: statistics.median(r) for name, r in rates.items()}
    ours = med[next(iter(runs))]
    m = machine()
    lines = ["# hybridrec against both TorchRec references", "",
             f"`python benchmarks/references.py` ({datetime.date.today().isoformat()}; {m['cpu']}, {m['cores']} cores; "
             f"torch {m['torch']}, torchrec {m['torchrec']}): ctr's shapes, {args.ranks} ranks, {args.steps} steps, "
             f"steady state after step {args.warmup}, {args.reps} alternating repetitions, medians.", "",
             "| loop | samples/s (median) | min - max | hybridrec / this |", "|---|---:|---:|---:|"]
    for name, r in rates.items():
        lines.append(f"| {name} | {med[name]:,.0f} | {min(r):,.0f} - {max(r):,.0f} | {ours / med[name]:.3f} |")
    write_markdown(args.out, lines, "references")


if __name__ == "__main__":
    main()
