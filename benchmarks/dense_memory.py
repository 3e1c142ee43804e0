"""A dense-heavy case: DDP against FSDP2 on MLPerf DLRM-DCNv2's dense sizes, small tables.

DLRM-DCNv2 with MLPerf's dense part (bottom MLP 512-256-128, 3 cross layers of rank 512 over
27 x 128-dim features, top MLP 1024-1024-512-256-1; ~10 M dense parameters) and 26 tables
of 1000 rows, trained with the real Trainer on 2 ranks in each dense mode: DDP, FSDP2, and
FSDP2 with bf16 compute (fp32 reduction). All modes live in one process group; their timed
windows alternate (the order reversed every other repetition), so a slow phase of a shared
machine hits every mode alike. Then each rank counts the bytes it holds for dense
parameters, gradients and optimizer state (its local shards for FSDP2): FSDP2 should hold
about 1/N of DDP's, plus padding.

    python benchmarks/dense_memory.py [--steps 8] [--reps 3]
Writes benchmarks/results/DENSE_MEMORY.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from torch.distributed.tensor import DTensor

HERE = os.path.dirname(os.path.abspath(__file__))
CONF = os.path.join(HERE, "..", "hybridrec", "conf")
MODEL = [
    "model=dcn",
    "model.embedding_dim=128",
    "model.dense_arch_layer_sizes=[512,256,128]",
    "model.over_arch_layer_sizes=[1024,1024,512,256,1]",
    "model.dcn_num_layers=3",
    "model.dcn_low_rank_dim=512",
    "data.num_embeddings_per_feature=[" + ",".join(["1000"] * 26) + "]",
    "data.batch_size=2048",
    "sharding=table_wise",
    "optimizer=adagrad",
]
MODES = {
    "ddp": ["mesh=ddp"],
    "fsdp": ["mesh=fsdp"],
    "fsdp bf16": ["mesh=fsdp", "mesh.param_dtype=bfloat16", "mesh.reduce_dtype=float32"],
}


def local_bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def measure(cfgs: list, steps: int, reps: int) -> list[list[dict]]:
    """Runs on every rank: one Trainer per config (one process group: start-up is paid once),
    then ``reps`` alternating timed windows of ``steps`` steps each, then every rank's
    dense-state bytes."""
    from hybridrec.data import loader
    from hybridrec.parallel.devices import pick_device
    from hybridrec.parallel.distributed import init_distributed, shutdown_distributed
    from hybridrec.training.trainer import Trainer

    warnings.simplefilter("ignore", FutureWarning)
    device = pick_device(cfgs[0])
    init_distributed(device)
    done = False
    try:
        trainers, streams, rates = [], [], [[] for _ in cfgs]
        for i, cfg in enumerate(cfgs):
            trainer = Trainer(cfg, "/tmp", device)
            trainers.append(trainer)
            streams.append(loader.batches(trainer.data, "train", trainer.rank, trainer.world_size, 3 + reps * steps))
            for step in range(1, 4):  # warm-up: tracing, pipeline fill, lazy FSDP init
                trainer.step(streams[i], step)
        taken = [3] * len(cfgs)  # steps each trainer has taken
        for rep in range(reps):
            order = range(len(cfgs)) if rep % 2 == 0 else reversed(range(len(cfgs)))
            for i in order:
                dist.barrier()
                start = time.perf_counter()
                for _ in range(steps):
                    taken[i] += 1
                    trainers[i].step(streams[i], taken[i])
                dist.barrier()
                rates[i].append(steps * cfgs[i].data.batch_size / (time.perf_counter() - start))
        results = []
        for i, trainer in enumerate(trainers):
            params = trainer.optimizer.dense_params
            state = [v for s in trainer.optimizer.dense.state.values() for v in s.values() if torch.is_tensor(v)]
            out = {
                "params": sum(local_bytes(p) for p in params),
                "grads": sum(local_bytes(p.grad) for p in params),
                "optimizer_state": sum(local_bytes(v) for v in state),
                "numel": sum(p.numel() for p in params),  # global parameter count
                "samples_per_second": statistics.median(rates[i]),
                "samples_per_second_reps": rates[i],
            }
            per_rank = [None] * dist.get_world_size()
            dist.all_gather_object(per_rank, out)
            results.append(per_rank)
        done = True
        return results
    finally:
        shutdown_distributed(clean=done)


def run(
    steps: int, reps: int = 3, model: list[str] = MODEL, modes: dict[str, list[str]] = MODES
) -> dict[str, list[dict]]:
    """Each mode's per-rank bytes and samples/s: {"ddp": [rank 0, rank 1], "fsdp": [...], ...}."""
    from hybridrec.config import register_configs
    from hybridrec.run.launch import spawn

    register_configs()
    cfgs = []
    for overrides in modes.values():
        with initialize_config_dir(config_dir=os.path.abspath(CONF), version_base="1.3"):
            cfgs.append(compose(config_name="config", overrides=model + overrides))
    return dict(zip(modes, spawn(measure, 2, cfgs, steps, reps)))


def totals(results: dict[str, list[dict]]) -> dict[str, list[int]]:
    return {mode: [m["params"] + m["grads"] + m["optimizer_state"] for m in ranks] for mode, ranks in results.items()}


def table(
    results: dict[str, list[dict]], flops_per_sample: float | None = None, sgemm_gflops: float | None = None
) -> list[str]:
    """The per-rank table (markdown lines), the FSDP2 / DDP bytes ratio and each mode's
    samples/s against DDP's (median over the alternating windows, with the range)."""
    mib = lambda b: f"{b / 2**20:,.1f}"
    roof = flops_per_sample and sgemm_gflops
    lines = [
        "| mode | rank | params MiB | grads MiB | optimizer state MiB | total MiB | samples/s (median) | min - max | vs DDP |"
        + (" dense roofline |" if roof else ""),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if roof else ""),
    ]
    tot = totals(results)
    ddp = results["ddp"][0]["samples_per_second_reps"]
    for mode, ranks in results.items():
        for r, m in enumerate(ranks):
            reps = m["samples_per_second_reps"]
            vs = statistics.median(a / b for a, b in zip(reps, ddp))
            row = (
                f"| {mode} | {r} | {mib(m['params'])} | {mib(m['grads'])} | {mib(m['optimizer_state'])} | "
                f"{mib(tot[mode][r])} | {m['samples_per_second']:,.0f} | {min(reps):,.0f} - {max(reps):,.0f} | "
                f"{vs:.3f} |"
            )
            if roof:
                row += f" {m['samples_per_second'] * flops_per_sample / (sgemm_gflops * 1e9):.0%} |"
            lines.append(row)
    ratio = max(tot["fsdp"]) / max(tot["ddp"])
    return lines + [
        "",
        f"FSDP2 / DDP dense-state bytes, largest rank: {ratio:.3f} (ideal 1/2 = 0.500; the excess "
        "is shard padding). samples/s: the job's rows per second as each rank timed the same windows.",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    results = run(args.steps, args.reps)
    numel = results["ddp"][0]["numel"]
    lines = [
        "# Dense-heavy case: DDP vs FSDP2",
        "",
        f"`python benchmarks/dense_memory.py --steps {args.steps} --reps {args.reps}`: DLRM-DCNv2 with MLPerf's "
        f"dense sizes ({numel / 1e6:.1f} M dense parameters), 26 tables of 1000 rows, dense Adagrad, 2 ranks "
        "(gloo, CPU), global batch 2048. Bytes each rank holds after a step.",
        "",
        *table(results),
    ]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "DENSE_MEMORY.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    check_sharded(results)


def check_sharded(results: dict[str, list[dict]]) -> None:
    """The property these benchmarks exist to show: FSDP2 holds at most 1/N of DDP's dense
    state on each rank, plus a small constant (shard padding); exits non-zero otherwise."""
    tot = totals(results)
    ranks = len(tot["ddp"])
    if max(tot["fsdp"]) > max(tot["ddp"]) / ranks + 2**20:
        sys.exit(f"FSDP2 holds more than 1/{ranks} of DDP's dense state + 1 MiB")


if __name__ == "__main__":
    main()
