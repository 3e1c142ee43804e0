"""Throughput of the real training entry point, configurations measured side by side.

Runs ``python -m hybridrec.train +experiment=ctr`` for each configuration, alternating them
over several repetitions (so machine noise hits all alike), and reports the median steady-state
samples/s (from the end of the first log window to the end: tracing and pipeline fill
excluded), its spread (min-max), and the ratio to the first configuration.

    python benchmarks/bench.py                  # the default matrix, 3 repetitions
    python benchmarks/bench.py --reps 5 --steps 300
Results: benchmarks/results/REPORT.md and results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = {
    "1 rank": ["launcher.nproc_per_node=1"],
    "2 ranks, fsdp, auto": ["launcher.nproc_per_node=2", "mesh=fsdp", "sharding=auto"],
    "2 ranks, ddp, auto": ["launcher.nproc_per_node=2", "mesh=ddp", "sharding=auto"],
    "2 ranks, fsdp, row_wise": ["launcher.nproc_per_node=2", "mesh=fsdp", "sharding=row_wise"],
}


def steady_rate(run_dir: str, global_batch: int) -> float:
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    rows = [r for r in rows if "elapsed_s" in r]  # step records (eval records have none)
    first, last = rows[0], rows[-1]
    return (last["step"] - first["step"]) * global_batch / (last["elapsed_s"] - first["elapsed_s"])


def run_once(overrides: list[str], steps: int, log_every: int) -> dict:
    with tempfile.TemporaryDirectory() as run_dir:
        cmd = [sys.executable, "-m", "hybridrec.train", "+experiment=ctr", *overrides,
               f"train.steps={steps}", f"train.log_every={log_every}", "data.eval_batches=1",
               f"hydra.run.dir={run_dir}"]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        summary = json.load(open(os.path.join(run_dir, "summary.json")))
        return {
            "samples_per_second": steady_rate(run_dir, summary["global_batch_size"]),
            "peak_rss_mb": summary["peak_rss_mb"],
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    log_every = max(1, args.steps // 10)

    runs: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    for rep in range(args.reps):
        for name, overrides in CONFIGS.items():  # alternate: noise spreads over every config
            r = run_once(overrides, args.steps, log_every)
            runs[name].append(r)
            print(f"rep {rep + 1}/{args.reps} {name:28s} {r['samples_per_second']:>10,.0f} samples/s", flush=True)

    base = statistics.median(r["samples_per_second"] for r in next(iter(runs.values())))
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    lines = [
        "# Benchmark report",
        "",
        f"`python benchmarks/bench.py --reps {args.reps} --steps {args.steps}` on {os.cpu_count()} cores "
        f"({device}), torch {torch.__version__}, {time.strftime('%Y-%m-%d')}.",
        f"Experiment `ctr` (DLRM, 26 tables, 64-dim, global batch 2048); steady-state rate after the first "
        f"{log_every} steps; {args.reps} alternating repetitions per configuration.",
        "",
        "| configuration | median samples/s | min - max | vs first | peak RSS MB per rank (last rep) |",
        "|---|---:|---:|---:|---|",
    ]
    results = {}
    for name, rs in runs.items():
        rates = [r["samples_per_second"] for r in rs]
        med = statistics.median(rates)
        results[name] = {"rates": rates, "median": med, "peak_rss_mb": rs[-1]["peak_rss_mb"]}
        lines.append(f"| {name} | {med:,.0f} | {min(rates):,.0f} - {max(rates):,.0f} | "
                     f"{med / base:.2f}x | {', '.join(f'{m:.0f}' for m in rs[-1]['peak_rss_mb'])} |")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "REPORT.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"args": vars(args), "device": device, "results": results}, f, indent=2)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
