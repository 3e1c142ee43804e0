"""hybridrec against both hand-written TorchRec loops, side by side, at 1 and 2 ranks, on a
quiet machine and with one other busy process sharing the cores:

- ``reference, pre-generated``: benchmarks/reference_torchrec.py on TorchRec's
  RandomRecDataset, 10 batches generated up front and cycled, as TorchRec's own examples feed
  it: no input cost in the timed steps;
- ``reference, hybridrec input``: the same loop reading the synthetic click log each step on
  its training thread, as hybridrec does (the suite's reference in make bench);
- hybridrec, ``mesh=ddp`` (the references' dense wrapper) and the default ``mesh=fsdp``.

Two shapes: ``ctr`` (the experiment: 26 tables of 1M rows down to 3, DLRM 512-256-64 /
512-256-1, 1,024 rows per rank, row-wise Adagrad) and ``torchrec_example`` (TorchRec's DLRM
example: 26 tables x 100k rows x 64, dense 512-256-64, over 1024-1024-512-256-1, 512 rows per
rank, element-wise Adagrad).

    python benchmarks/references.py [--reps 3] [--steps 150] [--warmup 30] [--ranks 1 2]
        [--shapes ctr torchrec_example] [--machine quiet busy]

Each repetition runs every loop in turn, the order reversed every other repetition. Rates are
steady state, from the end of step ``--warmup`` to the last step, measured the same way for
all (hybridrec: its metrics.jsonl log windows, logged every ``warmup`` steps, as make bench
reads them; the references: a barrier at both ends). Writes benchmarks/results/REFERENCES.md.
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

from common import ROOT, busy_machine, machine, steady_rate, write_markdown

HERE = os.path.dirname(os.path.abspath(__file__))

# Overrides of +experiment=ctr, per-rank batch: the same for hybridrec and the references
# (reference_torchrec.py composes hybridrec's config from the same overrides).
SHAPES = {
    "ctr": ([], 1024),
    "torchrec_example": (
        [
            "data.num_embeddings_per_feature=[" + ",".join(["100000"] * 26) + "]",
            "model.over_arch_layer_sizes=[1024,1024,512,256,1]",
            "optimizer/sparse=adagrad",
        ],
        512,
    ),
}
PREGENERATED = "reference, pre-generated (RandomRecDataset)"
LOOPS = {  # name -> (hybridrec's mesh, or the reference's --input)
    "hybridrec `mesh=ddp`": ("hybridrec", "mesh=ddp"),
    "hybridrec default (`mesh=fsdp`)": ("hybridrec", "mesh=fsdp"),
    PREGENERATED: ("reference", "pregenerated"),
    "reference, hybridrec input": ("reference", "hybridrec"),
}


def hybridrec(overrides: list[str], ranks: int, steps: int, warmup: int, tmp: str, threads: int | None) -> float:
    out = os.path.join(tmp, "hybridrec")
    shutil.rmtree(out, ignore_errors=True)
    threads_arg = [f"launcher.threads_per_rank={threads}"] if threads else []
    subprocess.run(
        [
            sys.executable,
            "-m",
            "hybridrec.train",
            "+experiment=ctr",
            *overrides,
            *threads_arg,
            f"launcher.nproc_per_node={ranks}",
            f"train.steps={steps}",
            f"train.log_every={warmup}",
            "train.eval_every=0",
            f"hydra.run.dir={out}",
        ],
        check=True,
        capture_output=True,
        cwd=ROOT,
    )
    with open(os.path.join(out, "summary.json")) as f:
        batch = json.load(f)["global_batch_size"]
    return steady_rate(out, batch, warmup)


def reference(
    overrides: list[str], ranks: int, steps: int, warmup: int, tmp: str, input_: str, threads: int | None
) -> float:
    out = os.path.join(tmp, f"ref-{input_}.json")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    subprocess.run(
        [
            torchrun,
            "--standalone",
            "--nproc_per_node",
            str(ranks),
            os.path.join(HERE, "reference_torchrec.py"),
            "--steps",
            str(steps),
            "--warmup",
            str(warmup),
            "--out",
            out,
            "--input",
            input_,
            "--device",
            "cpu",
            *overrides,
        ],
        check=True,
        capture_output=True,
        cwd=ROOT,
        env=env,
    )
    with open(out) as f:
        return json.load(f)["samples_per_second"]


def measure(shape: str, ranks: int, busy: bool, reps: int, steps: int, warmup: int) -> dict[str, list[float]]:
    """Each loop's steady rate per repetition, the loops alternating."""
    extra, per_rank = SHAPES[shape]
    overrides = [*extra, f"data.batch_size={per_rank * ranks}"]
    rates: dict[str, list[float]] = {name: [] for name in LOOPS}
    # Busy: every loop gets the cores the other process leaves, split over the ranks. Left at
    # the default (every core), one rank's OpenMP threads wait on the one that shares a core
    # with the other process at every parallel region: on 1 rank with 2 threads the TorchRec
    # loop ran about 34x slower and hybridrec about 2x, which measures the scheduler, not the
    # loops.
    threads = max(1, ((os.cpu_count() or 1) - 1) // ranks) if busy else None
    with busy_machine(busy), tempfile.TemporaryDirectory() as tmp:
        for rep in range(reps):
            for name in list(LOOPS)[:: -1 if rep % 2 else 1]:
                kind, arg = LOOPS[name]
                rate = (
                    hybridrec([*overrides, arg], ranks, steps, warmup, tmp, threads)
                    if kind == "hybridrec"
                    else reference(overrides, ranks, steps, warmup, tmp, arg, threads)
                )
                rates[name].append(rate)
                print(
                    f"{shape} {ranks} ranks {'busy' if busy else 'quiet'} rep {rep + 1}: {name} {rate:,.0f}", flush=True
                )
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--machine", nargs="+", choices=["quiet", "busy"], default=["quiet", "busy"])
    parser.add_argument("--out", default=os.path.join(HERE, "results", "REFERENCES.md"))
    args = parser.parse_args()
    m = machine()
    lines = [
        "# hybridrec against both TorchRec references",
        "",
        f"`python {' '.join(['benchmarks/references.py', *sys.argv[1:]])}` ({datetime.date.today().isoformat()}; "
        f"{m['cpu']}, {m['cores']} cores; torch {m['torch']}, torchrec {m['torchrec']}): {args.steps} steps, "
        f"steady state after step {args.warmup}, {args.reps} alternating repetitions, medians; ratios are "
        'per repetition (the loops ran back to back), then the median. "busy": one other process spinning '
        "on a core for the whole measurement, and every loop given the other cores' threads (intra-op threads "
        "per rank = (cores - 1) / ranks, at least 1). Shapes: see the script's docstring.",
        "",
        "| shapes | machine | ranks | loop | samples/s (median) | min - max | / pre-generated (median, min - max) |",
        "|---|---|---:|---|---:|---:|---:|",
    ]
    for shape in args.shapes:
        for state in args.machine:
            for ranks in args.ranks:
                rates = measure(shape, ranks, state == "busy", args.reps, args.steps, args.warmup)
                for name, r in rates.items():
                    ratios = [a / b for a, b in zip(r, rates[PREGENERATED])]
                    ratio = (
                        ""
                        if name == PREGENERATED
                        else f"{statistics.median(ratios):.3f} ({min(ratios):.3f} - {max(ratios):.3f})"
                    )
                    lines.append(
                        f"| {shape} | {state} | {ranks} | {name} | {statistics.median(r):,.0f} | "
                        f"{min(r):,.0f} - {max(r):,.0f} | {ratio} |"
                    )
                write_markdown(args.out, lines, "references")  # after each group: a long run keeps what it has


if __name__ == "__main__":
    main()
