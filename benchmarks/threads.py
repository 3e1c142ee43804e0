"""Intra-op threads and OpenMP's waiting policy on a quiet and on a busy machine: the
quick start's training (``+experiment=ctr``, one rank) under each candidate setting, the
settings alternating within a repetition, then the same with one other process spinning on
a core (a laptop with a browser, a shared server). Each run is ``python -m hybridrec.train``
in a process of its own, so OpenMP reads its environment at start-up as a user's run does.

    .venv/bin/python benchmarks/threads.py            # -> benchmarks/results/THREADS.md, threads.json

What decides the default: its worst case (busy) and its cost on a quiet machine beside the
best setting there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from common import ROOT, busy_machine, machine, train_summary, write_markdown

RESULTS = os.path.join(ROOT, "benchmarks", "results")

CORES = os.cpu_count() or 1
# name -> (overrides, environment: a value, or None to leave the variable unset)
SETTINGS: dict[str, tuple[list[str], dict[str, str | None]]] = {
    "hybridrec's default": ([], {"OMP_WAIT_POLICY": None, "OMP_NUM_THREADS": None}),
    f"{CORES} threads, OpenMP's own wait": (
        [f"launcher.threads_per_rank={CORES}"],
        {"OMP_WAIT_POLICY": "", "OMP_NUM_THREADS": None},
    ),
    f"{CORES} threads, passive wait": (
        [f"launcher.threads_per_rank={CORES}"],
        {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": None},
    ),
    "1 thread": (["launcher.threads_per_rank=1"], {"OMP_WAIT_POLICY": None, "OMP_NUM_THREADS": None}),
}
BASE = ["+experiment=ctr", "train.eval_every=0", "train.log_every=1000", "data.eval_batches=1"]


def run(overrides: list[str], env_changes: dict[str, str | None], out: str) -> dict:
    """Training samples/s of one run (summary.json's ``train`` block) and its wall seconds."""
    env = {k: v for k, v in os.environ.items() if env_changes.get(k, v) is not None}
    env |= {k: v for k, v in env_changes.items() if v is not None}
    start = time.monotonic()
    train = train_summary([*BASE, *overrides], out, env)["train"]
    # the rate the run settles at (its first steps aside), as the README's numbers are
    rate = train.get("steady_samples_per_second", train["samples_per_second"])
    return {"samples_per_s": rate, "wall_s": round(time.monotonic() - start, 1)}


def measure(steps: int, reps: int, names: list[str]) -> dict:
    results: dict = {}
    for busy in (False, True):
        rows: dict[str, list] = {n: [] for n in names}
        with busy_machine(busy), tempfile.TemporaryDirectory() as tmp:
            for rep in range(reps):
                order = names if rep % 2 == 0 else names[::-1]
                for name in order:
                    overrides, env = SETTINGS[name]
                    out = os.path.join(tmp, f"{len(rows[name])}-{rep}-{names.index(name)}")
                    rows[name].append(run([*overrides, f"train.steps={steps}"], env, out))
                    print(f"{'busy' if busy else 'quiet'} rep {rep}: {name}: {rows[name][-1]}", flush=True)
        results["busy" if busy else "quiet"] = rows
    return results


def table(res: dict) -> list[str]:
    names = list(res["raw"]["quiet"])
    med = {
        (m, n): statistics.median(r["samples_per_s"] for r in res["raw"][m][n])
        for m in ("quiet", "busy")
        for n in names
    }
    best_quiet = max(med["quiet", n] for n in names)
    lines = [
        "| setting | quiet: samples/s (median) | min - max | busy: samples/s (median) | min - max | busy / quiet | "
        "quiet vs the best quiet |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for n in names:
        q, b = res["raw"]["quiet"][n], res["raw"]["busy"][n]
        lines.append(
            f"| {n} | {med['quiet', n]:,.0f} | {min(r['samples_per_s'] for r in q):,.0f} - "
            f"{max(r['samples_per_s'] for r in q):,.0f} | {med['busy', n]:,.0f} | "
            f"{min(r['samples_per_s'] for r in b):,.0f} - {max(r['samples_per_s'] for r in b):,.0f} | "
            f"{med['busy', n] / med['quiet', n]:.2f} | {med['quiet', n] / best_quiet:.2f} |"
        )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--settings", nargs="*", default=list(SETTINGS), help="names from SETTINGS")
    p.add_argument("--out", default=RESULTS, help="where THREADS.md and threads.json go")
    args = p.parse_args()
    raw = measure(args.steps, args.reps, args.settings)
    res = {"machine": machine(), "steps": args.steps, "reps": args.reps, "date": time.strftime("%Y-%m-%d"), "raw": raw}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "threads.json"), "w") as f:
        json.dump(res, f, indent=1)
    m = res["machine"]
    lines = [
        "# Threads and OpenMP's waiting policy, quiet and busy",
        "",
        f"`benchmarks/threads.py` on {res['date']} ({m.get('cpu', '?')}, {CORES} cores): `+experiment=ctr` on one "
        f"rank, {args.steps} steps per run, {args.reps} repetitions per setting, the settings alternating; busy: one "
        "other process spinning on a core for the whole measurement.",
        "",
        *table(res),
    ]
    write_markdown(os.path.join(args.out, "THREADS.md"), lines, "threads")


if __name__ == "__main__":
    main()
