"""What verifying checkpoints costs: the BLAKE3 hash of every file at commit, and the check of
those checksums before a load, next to DCP's own write and load of the same state.

    python benchmarks/checkpoint_cost.py [--experiment ctr] [--reps 5] [--out benchmarks/results]

Trains the experiment for 2 steps with a checkpoint (the real model, tables and optimizer
state), then, in one process, on a state of the same tensors (names, shapes, dtypes from the
checkpoint's metadata): DCP's save, ``checkpoint.hash_files`` of what it wrote (what each
rank does before the commit), DCP's load through hybridrec's safe reader, and
``checkpoint.verify`` (what precedes every load). Repetitions alternate the four, and the
medians are reported; the files are in the page cache, as they are right after a save.
Writes CHECKPOINT.md (the README's table comes from it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed.checkpoint as dcp

from common import machine
from hybridrec.checkpoint import TrainState, hash_files, own_files, read_metadata, safe_load, verify

HERE = os.path.dirname(os.path.abspath(__file__))


def trained_checkpoint(experiment: str, tmp: str) -> str:
    ckpt = os.path.join(tmp, "ckpt")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "hybridrec.train",
            f"+experiment={experiment}",
            "train.steps=2",
            f"checkpoint.dir={ckpt}",
            f"hydra.run.dir={os.path.join(tmp, 'run')}",
        ],
        check=True,
        capture_output=True,
        cwd=os.path.dirname(HERE),
    )
    return os.path.join(ckpt, "step_00000002")


def same_tensors(path: str) -> dict[str, torch.Tensor]:
    """Tensors of the checkpoint's names, shapes and dtypes (random values: DCP's cost does
    not depend on them)."""
    state = {}
    for name, meta in read_metadata(path).state_dict_metadata.items():
        if hasattr(meta, "size"):
            state[name] = torch.rand(meta.size).to(meta.properties.dtype)
    return state


def measure(path: str, reps: int, tmp: str) -> dict[str, list[float]]:
    state = same_tensors(path)
    times: dict[str, list[float]] = {"save": [], "hash": [], "load": [], "verify": []}
    target = os.path.join(tmp, "bench")
    for _ in range(reps):
        shutil.rmtree(target, ignore_errors=True)
        tick = time.perf_counter()
        dcp.save(state, checkpoint_id=target, no_dist=True)
        times["save"].append(time.perf_counter() - tick)
        tick = time.perf_counter()
        files = hash_files(target, own_files(target, 0))
        times["hash"].append(time.perf_counter() - tick)
        tick = time.perf_counter()
        safe_load(state, target, no_dist=True)
        times["load"].append(time.perf_counter() - tick)
        recorded = TrainState(
            step=0,
            schedulers=[],
            features=[],
            num_dense_features=0,
            rng=torch.zeros(1),
            losses=torch.zeros(1),
            runs=[],
            files=files,
        )
        tick = time.perf_counter()
        # verify also wants hybridrec's two small files: their cost is in the noise, leave them out
        verify_dcp_files(target, recorded)
        times["verify"].append(time.perf_counter() - tick)
    return times


def verify_dcp_files(target: str, recorded: TrainState) -> None:
    for name in ("trainer_state.pt", "config.yaml"):
        open(os.path.join(target, name), "w").close()
    recorded.files.update(hash_files(target, ["trainer_state.pt", "config.yaml"]))
    verify(target, recorded, [n for n in recorded.files if n.endswith(".distcp")])


def report(experiment: str, path: str, times: dict[str, list[float]], reps: int) -> str:
    size = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
    med = {k: statistics.median(v) for k, v in times.items()}
    m = machine()
    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    m["cpu"] += "".join(f", {flag}" for flag in ("avx512_bf16",) if flag in flags)
    return "\n".join(
        [
            "# Checkpoint verification cost",
            "",
            f"`python benchmarks/checkpoint_cost.py --experiment {experiment} --reps {reps}`: {m['cpu']}, "
            f"{m['cores']} cores, torch {m['torch']}. One process, the {experiment} checkpoint's tensors "
            f"({size / 1e6:,.0f} MB on disk), files in the page cache; medians of {reps} alternating repetitions.",
            "",
            "| step | seconds (median) | next to DCP's own |",
            "|---|---|---|",
            f"| DCP save | {med['save']:.3f} | |",
            f"| BLAKE3 of the written files (at commit) | {med['hash']:.3f} | {med['hash'] / med['save']:.0%} of the save |",
            f"| DCP load (safe reader) | {med['load']:.3f} | |",
            f"| checksum verification (before a load) | {med['verify']:.3f} | {med['verify'] / med['load']:.0%} of the load |",
            "",
            f"Throughput of the hashing: {size / med['hash'] / 1e9:.2f} GB/s on this machine. On a multi-rank "
            f"save each rank hashes only the files it wrote; the verification before a load runs in one process "
            f"(the one that checks before launch, then rank 0), so it grows with the checkpoint's size.",
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experiment", default="ctr")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = trained_checkpoint(args.experiment, tmp)
        times = measure(path, args.reps, tmp)
        text = report(args.experiment, path, times, args.reps)
    with open(os.path.join(args.out, "CHECKPOINT.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
