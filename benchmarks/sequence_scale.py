"""Why a sequence ranker wants TorchRec and FSDP2 together: the item table and the stack at scale.

1. A dry run of the planner (``python -m hybridrec.plan``) for a 100M-row, 1,024-wide item table
   and a 24-block, 1,024-wide HSTU on 64 GPUs (8 per node): where the table goes and what each
   rank holds. Beside it, the stack's dense state per rank (fp32 parameters, gradients and
   Adam's two moments) under DDP (every rank holds all of it) and FSDP2 (1/64 each), counted
   from the model built on the meta device (no memory is allocated).
2. Measured on 2 CPU ranks (gloo): SASRec with 8 blocks x 512 wide trained under DDP and under
   FSDP2 (one unit per block), the bytes of dense parameters, gradients and optimizer state each
   rank holds after a step, and samples/s over alternating windows
   (``benchmarks/dense_memory.py``'s measurement).

    python benchmarks/sequence_scale.py [--steps 4] [--reps 2]

Writes benchmarks/results/SEQUENCE_SCALE.md. Needs MovieLens-100k (``make data-movielens``).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from hydra.core.global_hydra import GlobalHydra

import dense_memory
from common import ROOT, compose_config, machine, write_markdown

HERE = os.path.dirname(os.path.abspath(__file__))
# The dry run's model and cluster (the sizes named in the module docstring).
DRY_RUN = [
    "+experiment=sequences",
    "model=hstu",
    "model.num_blocks=24",
    "model.embedding_dim=1024",
    "model.num_heads=8",
    "model.attention_dim=128",
    "model.linear_dim=128",
    "data=parquet_seq",
    "data.items_column=items",
    "data.num_items=100000000",
    "topology.world_size=64",
    "topology.local_world_size=8",
    "topology.compute_device=cuda",
    "topology.device_memory_gb=80",
]
# The measured stack: 8 SASRec blocks, 512 wide, on 2 CPU ranks.
MEASURED = [
    "+experiment=sequences",
    "model=sasrec",
    "model.num_blocks=8",
    "model.embedding_dim=512",
    "model.num_heads=8",
    "data.batch_size=64",
]
MODES = {"ddp": ["mesh=ddp"], "fsdp": ["mesh=fsdp"]}
ADAM_BYTES = 4 + 4 + 2 * 4  # fp32 parameter, gradient, exp_avg, exp_avg_sq


def _histories(path: str, users: int = 2048) -> None:
    """A Parquet file of short histories: the dry run's source reads it for its shape only."""
    rng = np.random.default_rng(0)
    histories = [list(rng.integers(1, 100_000_000, 20)) for _ in range(users)]
    pq.write_table(pa.table({"items": pa.array(histories, pa.list_(pa.int64()))}), path)


def dense_parameters(overrides: list[str]) -> int:
    """The stack's parameters (everything but the item table), built on the meta device."""
    from hybridrec.data import build_source
    from hybridrec.models import build_model

    cfg = compose_config(overrides)
    source = build_source(cfg.data, cfg.seed)
    with torch.device("meta"):
        model = build_model(cfg, source.features, source.num_dense_features)
    return sum(p.numel() for name, p in model.named_parameters() if not name.startswith("items."))


def dry_run(tmp: str) -> dict:
    path = os.path.join(tmp, "histories.parquet")
    _histories(path)
    overrides = [*DRY_RUN, f"data.path={path}"]
    proc = subprocess.run(
        [sys.executable, "-m", "hybridrec.plan", *overrides, f"hydra.run.dir={tmp}/plan"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    if proc.returncode != 0:
        sys.exit(f"the dry run failed:\n{proc.stderr[-3000:]}")
    out = proc.stdout + proc.stderr
    table = re.search(r"^t_items\s+([\d,]+) x (\d+)\s+(\w+)\s+(\w+)\s+([\d.]+)\s+([\d.]+)\s+(.*)$", out, re.M)
    rank0 = re.search(r"^0\s+([\d.]+) / ([\d.]+)\s+([\d.]+) / ([\d.]+)", out, re.M)
    if not table or not rank0:
        sys.exit(f"the dry run's plan table was not found:\n{out[-3000:]}")
    return {
        "overrides": DRY_RUN,
        "rows": table.group(1),
        "dim": int(table.group(2)),
        "sharding": table.group(3),
        "kernel": table.group(4),
        "device_gib": float(table.group(5)),
        "placement": table.group(7).strip(),
        "rank0_device_gib": float(rank0.group(1)),
        "rank0_capacity_gib": float(rank0.group(2)),
        "dense_parameters": dense_parameters(overrides),
    }


def report(res: dict) -> list[str]:
    m, d = res["machine"], res["dry_run"]
    gib = lambda b: f"{b / 2**30:,.2f}"
    dense = d["dense_parameters"] * ADAM_BYTES
    lines = [
        "# Sequence rankers at scale",
        "",
        f"`python benchmarks/sequence_scale.py --steps {res['steps']} --reps {res['reps']}` on {m['cpu']}, "
        f"{m['cores']} cores, torch {m['torch']}.",
        "",
        "## A 100M-item HSTU on 64 GPUs (dry run)",
        "",
        f"`python -m hybridrec.plan {' '.join(d['overrides'])} data.path=<histories>`: TorchRec's planner for "
        f"64 ranks of 80 GiB, 8 per node; the stack's state counted from the model built on the meta device "
        f"({d['dense_parameters'] / 1e6:,.1f} M dense parameters, fp32 with Adam: {ADAM_BYTES} bytes each).",
        "",
        "| part | placement | per rank |",
        "|---|---|---:|",
        f"| item table, {d['rows']} x {d['dim']} (the planner's storage estimate) | {d['sharding']}, "
        f"{d['placement']} | {d['rank0_device_gib']:.2f} GiB of {d['rank0_capacity_gib']:.0f} |",
        f"| 24 HSTU blocks under DDP (every rank all of it) | replicated | {gib(dense)} GiB |",
        f"| 24 HSTU blocks under FSDP2 (a unit per block) | sharded over 64 | {gib(dense / 64)} GiB |",
        "",
        f"TorchRec's storage estimate for the table is {d['device_gib']:,.0f} GiB (its fp32 weights alone "
        f"{gib(int(d['rows'].replace(',', '')) * d['dim'] * 4)} GiB; the estimator's sequence-table figure is "
        f"quoted as it plans with it): no GPU holds it whole, and row-wise sharding gives each of "
        f"the 64 ranks {d['rank0_device_gib']:.2f} GiB and a 64th of its lookups. The stack's state is "
        f"{gib(dense)} GiB on every rank under DDP and {gib(dense / 64)} GiB under FSDP2, which leaves the "
        f"difference to activations and longer histories.",
        "",
        "## 8 SASRec blocks x 512 wide on 2 CPU ranks (measured)",
        "",
        f"`{' '.join(MEASURED)}` with `mesh=ddp` and `mesh=fsdp`, gloo, dense Adam, {res['steps']} steps a "
        f"window, {res['reps']} alternating windows. Bytes each rank holds after a step:",
        "",
        *dense_memory.table(res["measured"]),
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        res = {"machine": machine(), "steps": args.steps, "reps": args.reps, "dry_run": dry_run(tmp)}
    GlobalHydra.instance().clear()  # compose_config left it initialized; dense_memory.run composes again
    res["measured"] = dense_memory.run(args.steps, args.reps, model=MEASURED, modes=MODES)
    os.makedirs(args.out, exist_ok=True)
    write_markdown(os.path.join(args.out, "SEQUENCE_SCALE.md"), report(res), "sequence scale")
    dense_memory.check_sharded(res["measured"])


if __name__ == "__main__":
    main()
