"""The input alone: rows/s that ``hybridrec.data.loader.batches`` delivers into one rank's
batches, for every source, at 2,048 and 32,768 rows per step, read inline (one core), on the
input thread, and with 1, 2 and 4 worker processes; beside the rate at which training
consumes rows when its input costs nothing (``fixed_batch.py``: one pre-built batch fed again
and again, the ``ctr`` model on one rank).

Each figure is measured in a process of its own (inline pinned to one core with
``os.sched_setaffinity``; the other modes may use every core), as the median over
alternating repetitions (every configuration once per repetition, in reversed order every
other one). ``--baseline DIR`` also measures the inline reader of another checkout (say the
commit before a change: ``git worktree add DIR <commit>``) in the same repetitions, and the
report gives the ratio per repetition.

    python benchmarks/input_rates.py [--reps 3] [--quick] [--baseline DIR]

Writes benchmarks/results/INPUT_RATES.md and input_rates.json (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from common import ROOT, machine

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = ("inline", "thread", "1 worker", "2 workers", "4 workers")
BATCHES = (2048, 32768)
_MIN_SECONDS = 1.5  # each measurement reads for at least this long, and at least _MIN_BATCHES
_MIN_BATCHES = 8


def _makers(data: str) -> dict[str, Any]:
    """Source builders by name (global batch -> source): the input benchmark's sources (their
    files written once into ``data``), and MovieLens and the example feature log when their
    files are there (``make data-movielens``, ``make data-example``)."""
    from omegaconf import OmegaConf

    from common import compose_config
    from hybridrec.data import build_source
    from input_scaling import sources  # the files, written once; the same builders

    def sized(cfg: Any, batch: int) -> Any:
        cfg = OmegaConf.create(OmegaConf.to_container(cfg))
        cfg.batch_size = batch
        return cfg

    makers = sources(data, 200_000)
    for name, overrides, marker in (
        ("MovieLens-100k ratings", ["+experiment=movielens"], os.path.join(ROOT, "data", "ml-100k", "u.data")),
        (
            "example feature log (Parquet, multi-hot)",
            ["+experiment=feature_log"],
            os.path.join(ROOT, "data", "example", "vocab", "item_id.parquet"),
        ),
    ):
        if os.path.exists(marker):
            cfg = compose_config(overrides).data
            makers[name] = lambda b, cfg=cfg: build_source(sized(cfg, b), 0)
    return makers


def one(data: str, name: str, batch: int, mode: str) -> float:
    """Rows/s of ``name`` at ``batch`` rows per step in ``mode``, in this process."""
    import torch

    from hybridrec.data import loader

    if mode == "inline":
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
        torch.set_num_threads(1)
        import pyarrow

        pyarrow.set_cpu_count(1)
    workers = int(mode.split()[0]) if "worker" in mode else 0
    source = _makers(data)[name](batch)
    it = loader.batches(source, "train", 0, 1, None, 0, num_workers=workers, prefetch=2, thread=mode == "thread")
    for _ in range(2 + workers):  # workers started, files opened, first blocks parsed
        next(it)
    n, tick = 0, time.perf_counter()
    while n < _MIN_BATCHES or time.perf_counter() - tick < _MIN_SECONDS:
        next(it)
        n += 1
    seconds = time.perf_counter() - tick
    it.close()
    return n * batch / seconds


def _run(data: str, name: str, batch: int, mode: str, tree: str = ROOT) -> float:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tree, HERE])}
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "input_rates.py"), "--one", data, name, str(batch), mode],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{name} {batch} {mode}: {proc.stderr[-2000:]}")
    return float(proc.stdout.strip().splitlines()[-1])


def consumption(batch: int, steps: int) -> float:
    """Training's own rate at ``batch`` rows per step: ``ctr``'s model on one rank, every step
    fed the same pre-built batch (steady state: after the first log window)."""
    with tempfile.TemporaryDirectory() as d:
        subprocess.run(
            [
                sys.executable,
                os.path.join(HERE, "fixed_batch.py"),
                "+experiment=ctr",
                f"data.batch_size={batch}",
                f"train.steps={steps}",
                f"train.log_every={max(1, steps // 6)}",
                "train.eval_every=0",
                "data.eval_batches=1",
                "data.valid_batches=1",
                f"hydra.run.dir={d}",
            ],
            check=True,
            capture_output=True,
            cwd=ROOT,
        )
        rows = [r for r in map(json.loads, open(os.path.join(d, "metrics.jsonl"))) if "elapsed_s" in r]
        first, last = rows[0], rows[-1]
        return (last["step"] - first["step"]) * batch / (last["elapsed_s"] - first["elapsed_s"])


def measure(reps: int, quick: bool, baseline: str | None, data: str) -> dict[str, Any]:
    names = list(_makers(data))
    if quick:
        names = [n for n in names if n in ("synthetic (ctr)", "Criteo binary", "Parquet (the binary rows)")]
    modes = MODES if not quick else ("inline", "2 workers")
    configs = [(name, batch, mode) for name in names for batch in BATCHES for mode in modes]
    if baseline:
        configs += [(name, batch, "inline (baseline)") for name in names for batch in BATCHES]
    runs: dict[str, list[float]] = {}
    for rep in range(reps):
        for name, batch, mode in configs if rep % 2 == 0 else configs[::-1]:
            tree = baseline if mode == "inline (baseline)" else ROOT
            rate = _run(data, name, batch, mode.replace(" (baseline)", ""), tree)
            runs.setdefault(f"{name}|{batch}|{mode}", []).append(rate)
            print(f"rep {rep + 1}/{reps}  {name:42s} {batch:6d}  {mode:18s} {rate:12,.0f} rows/s", flush=True)
    train = {str(b): statistics.median(consumption(b, 30 if b == 2048 else 12) for _ in range(reps)) for b in BATCHES}
    return {"runs": runs, "training": train, "names": names, "modes": list(modes), "baseline": baseline}


def table(res: dict[str, Any]) -> list[str]:
    med = lambda key: statistics.median(res["runs"][key])
    L = []
    for batch in BATCHES:
        train = res["training"][str(batch)]
        L += [
            f"## {batch:,} rows per step",
            "",
            f"Training consumes {train:,.0f} rows/s (`ctr`, one rank, one pre-built batch). Rows/s of the input "
            f"alone (median of the repetitions), and the input / training ratio:",
            "",
            "| source | "
            + " | ".join(res["modes"])
            + " | 2 workers / inline |"
            + (" inline / baseline inline |" if res["baseline"] else ""),
            "|---|" + "---:|" * (len(res["modes"]) + 1 + bool(res["baseline"])),
        ]
        for name in res["names"]:
            cells = [
                f"{med(f'{name}|{batch}|{m}'):,.0f} ({med(f'{name}|{batch}|{m}') / train:.1f}x)" for m in res["modes"]
            ]
            ratio = (
                med(f"{name}|{batch}|2 workers") / med(f"{name}|{batch}|inline") if "2 workers" in res["modes"] else 0
            )
            row = f"| {name} | " + " | ".join(cells) + f" | {ratio:.2f} |"
            if res["baseline"]:
                pairs = zip(res["runs"][f"{name}|{batch}|inline"], res["runs"][f"{name}|{batch}|inline (baseline)"])
                ratios = sorted(a / b for a, b in pairs)
                row += f" {statistics.median(ratios):.2f} ({ratios[0]:.2f} - {ratios[-1]:.2f}) |"
            L.append(row)
        L.append("")
    return L


def main() -> None:
    if sys.argv[1:2] == ["--one"]:
        data, name, batch, mode = sys.argv[2:6]
        print(one(data, name, int(batch), mode))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="three sources, inline and 2 workers")
    parser.add_argument("--baseline", help="another checkout whose inline reader is measured alongside")
    parser.add_argument(
        "--data",
        default=os.path.join(tempfile.gettempdir(), "hybridrec-input-rates"),
        help="where the benchmark's files are written once (kept between runs)",
    )
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--report", action="store_true", help="rewrite INPUT_RATES.md from input_rates.json")
    args = parser.parse_args()
    if args.report:
        with open(os.path.join(args.out, "input_rates.json")) as f:
            res = json.load(f)
    else:
        os.makedirs(args.data, exist_ok=True)
        _makers(args.data)  # write the files once, before any measurement
        res = measure(args.reps, args.quick, args.baseline and os.path.abspath(args.baseline), args.data)
        res["machine"] = machine()
        res["settings"] = {"reps": args.reps, "quick": args.quick}
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "input_rates.json"), "w") as f:
            json.dump(res, f, indent=1)
    args.reps, args.quick = (
        res.get("settings", {}).get("reps", args.reps),
        res.get("settings", {}).get("quick", args.quick),
    )
    cpu = res["machine"].get("cpu", "?")
    text = "\n".join(
        [
            f"# Input rates\n\n`python benchmarks/input_rates.py --reps {args.reps}"
            + (" --quick" if args.quick else "")
            + (" --baseline <checkout>" if res.get("baseline") else "")
            + f"` on {cpu}, {os.cpu_count()} cores.\n",
            *table(res),
        ]
    )
    with open(os.path.join(args.out, "INPUT_RATES.md"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
