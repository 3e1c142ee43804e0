"""The Optuna example of docs/training.md, run and written up: a study over learning rates and embedding
width on ``ctr`` with ``hydra/sweeper=objective``.

    python benchmarks/study.py [--out benchmarks/results] [--sweep-dir DIR]

Runs the guide's command into ``DIR`` (default: a temporary directory; an existing sweep
in ``DIR`` is written up as it is), then writes STUDY.md: the sweep's own table
(``summary.md``, without the directory column), the chosen job's line, and Optuna's
``optimization_results.yaml``, which must name the same trial.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

from omegaconf import OmegaConf

from common import machine
from hybridrec.reports.sweep import chosen, read_jobs, to_markdown

HERE = os.path.dirname(os.path.abspath(__file__))

COMMAND = [
    "+experiment=ctr",
    "hydra/sweeper=objective",
    "hydra.sweeper.n_trials=6",
    "hydra.sweeper.sampler.seed=0",
    "train.steps=200",
    "optimizer.sparse.lr=tag(log,interval(0.01,0.3))",
    "optimizer.dense.lr=tag(log,interval(0.005,0.2))",
    "model.embedding_dim=choice(32,64)",
]


def run(sweep_dir: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "hybridrec.train", "-m", *COMMAND, f"hydra.sweep.dir={sweep_dir}"],
        check=True,
        capture_output=True,
        cwd=os.path.dirname(HERE),
    )


def write_up(sweep_dir: str) -> str:
    jobs = read_jobs(sweep_dir)
    study = OmegaConf.load(os.path.join(sweep_dir, "optimization_results.yaml"))
    best = chosen(jobs)
    values = dict(o.split("=", 1) for o in best.overrides if "=" in o)
    agree = (
        all(float(values[k]) == float(v) for k, v in study.best_params.items())
        and best.summary["objective"]["value"] == study.best_value
    )
    if not agree:
        raise RuntimeError(
            f"{sweep_dir}: Optuna's best trial {dict(study.best_params)} is not the chosen job {best.dir}"
        )
    # without the last column (the job's directory: long, and in the CSV)
    table = [
        "|".join(line.split("|")[:-2]) + "|" if line.startswith("|") else line
        for line in to_markdown(jobs).splitlines()
    ]
    m = machine()
    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    cpu = m["cpu"] + (", avx512_bf16" if "avx512_bf16" in flags else "")
    return "\n".join(
        [
            "# An Optuna study on ctr",
            "",
            f"`python -m hybridrec.train -m {' '.join(repr(c) if '(' in c else c for c in COMMAND)}`: {cpu}, "
            f"{m['cores']} cores, torch {m['torch']}. The samples/s column is each trial's own run while other work "
            f"shared the cores: not a throughput measurement.",
            "",
            *table[2:],
            "",
            f"Optuna's `optimization_results.yaml`: best value {study.best_value:.4f}, best parameters "
            + ", ".join(f"`{k}={v}`" for k, v in study.best_params.items())
            + f": job {best.num}, the chosen one.",
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--sweep-dir", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sweep_dir = args.sweep_dir or os.path.join(tmp, "study")
        if not os.path.isfile(os.path.join(sweep_dir, "optimization_results.yaml")):
            run(sweep_dir)
        text = write_up(sweep_dir)
    with open(os.path.join(args.out, "STUDY.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
