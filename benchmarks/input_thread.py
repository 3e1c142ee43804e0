"""Building batches on a background thread (data.input_thread=true, the default) against on
the training thread (false), with no DataLoader workers: the same experiment, alternating
repetitions, on a quiet machine and with one other busy process sharing the cores.

    python benchmarks/input_thread.py [--reps 3] [--steps 150] [--ranks 1 2] [overrides ...]

Writes benchmarks/results/INPUT_THREAD.md: median samples/s (the whole training run) and p50
step time per setting, and the ratio thread / no thread, from the runs' summary.json.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics

from common import machine, measure_alternating, write_markdown

HERE = os.path.dirname(os.path.abspath(__file__))
SETTINGS = {"thread": "data.input_thread=true", "no thread": "data.input_thread=false"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", default=os.path.join(HERE, "results", "INPUT_THREAD.md"))
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    base = ["+experiment=ctr", f"train.steps={args.steps}", "train.eval_every=0", "data.num_workers=0", *args.overrides]
    m = machine()
    lines = [
        "# Input on a background thread",
        "",
        f"`python benchmarks/input_thread.py` ({datetime.date.today().isoformat()}; {m['cpu']}, {m['cores']} cores; "
        f"torch {m['torch']}): `python -m hybridrec.train {' '.join(base)} launcher.nproc_per_node=N` with "
        f"`data.input_thread=true` and "
        f'`false`, {args.reps} alternating repetitions each; "busy": one other process spinning on a core '
        "for the whole measurement. samples/s: the whole training run (summary.json `train`); "
        "step p50: the median step time. Medians over the repetitions.",
        "",
        "| machine | ranks | setting | samples/s | step p50 ms | samples/s ratio thread / no thread |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for busy, ranks in ((b, r) for b in (False, True) for r in args.ranks):
        results = measure_alternating([*base, f"launcher.nproc_per_node={ranks}"], args.reps, busy, SETTINGS)
        rate = {k: statistics.median(r["samples_per_second"] for r in v) for k, v in results.items()}
        p50 = {k: statistics.median(r["step_time_p50_ms"] for r in v) for k, v in results.items()}
        for name in SETTINGS:
            ratio = f"{rate['thread'] / rate['no thread']:.3f}" if name == "thread" else ""
            lines.append(
                f"| {'busy' if busy else 'quiet'} | {ranks} | `{SETTINGS[name]}` | {rate[name]:,.0f} | {p50[name]:.1f} | {ratio} |"
            )
        print("\n".join(lines[-2:]), flush=True)
    write_markdown(args.out, lines, "input_thread")


if __name__ == "__main__":
    main()
