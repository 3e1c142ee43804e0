"""Dense-state bytes per rank, DDP against FSDP2, on a model whose dense part is large.

DLRM-DCNv2 with 26 features, wide cross layers and a wide top MLP (~20 M dense parameters),
trained with the real Trainer on 2 ranks for a few steps per mode. Then each rank counts the bytes it
holds for dense parameters, gradients and optimizer state (its local shards for FSDP2), and
the steady-state samples/s is timed. FSDP2 should hold about 1/N of DDP's, plus padding.

    python benchmarks/dense_memory.py [--steps 8]
Writes benchmarks/results/DENSE_MEMORY.md.
"""

from __future__ import annotations

import argparse
import os
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
    "model=dcn", "model.embedding_dim=64", "model.dense_arch_layer_sizes=[512,256,64]",
    "model.over_arch_layer_sizes=[2048,2048,1024,1]", "model.dcn_num_layers=3",
    "model.dcn_low_rank_dim=1024", "data.num_embeddings_per_feature=[" + ",".join(["1000"] * 26) + "]",
    "data.batch_size=512", "sharding=table_wise",
]


def local_bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def measure(cfgs: list, steps: int) -> list[list[dict]]:
    """Runs on every rank: for each config, a few real training steps, then every rank's
    dense-state bytes (one process group for all configs: start-up is paid once)."""
    from hybridrec.trainer import Trainer, init_distributed, pick_device, shutdown_distributed

    warnings.simplefilter("ignore", FutureWarning)
    device = pick_device(cfgs[0])
    init_distributed(device)
    done = False
    try:
        results = []
        for cfg in cfgs:
            trainer = Trainer(cfg, "/tmp", device)
            batches = trainer.data.batches("train", trainer.rank, trainer.world_size, steps + 2)
            for _ in range(2):  # warm-up: tracing, pipeline fill, lazy FSDP init
                trainer.pipeline.progress(batches)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                trainer.pipeline.progress(batches)
            dist.barrier()
            seconds = time.perf_counter() - start
            params = trainer.optimizer.dense_params
            state = [v for s in trainer.optimizer.dense.state.values() for v in s.values() if torch.is_tensor(v)]
            out = {
                "params": sum(local_bytes(p) for p in params),
                "grads": sum(local_bytes(p.grad) for p in params),
                "optimizer_state": sum(local_bytes(v) for v in state),
                "numel": sum(p.numel() for p in params),  # global parameter count
                "samples_per_second": steps * cfg.data.batch_size / seconds,
            }
            per_rank = [None] * dist.get_world_size()
            dist.all_gather_object(per_rank, out)
            results.append(per_rank)
            del trainer, batches
        done = True
        return results
    finally:
        shutdown_distributed(clean=done)


def run(steps: int, model: list[str] = MODEL) -> dict[str, list[dict]]:
    """Each mode's per-rank bytes and samples/s: {"ddp": [rank 0, rank 1], "fsdp": [...]}."""
    from hybridrec.config import register_configs
    from hybridrec.launch import spawn

    register_configs()
    modes = ("ddp", "fsdp")
    cfgs = []
    for mode in modes:
        with initialize_config_dir(config_dir=os.path.abspath(CONF), version_base="1.3"):
            cfgs.append(compose(config_name="config", overrides=model + [f"mesh={mode}"]))
    return dict(zip(modes, spawn(measure, 2, cfgs, steps)))


def totals(results: dict[str, list[dict]]) -> dict[str, list[int]]:
    return {mode: [m["params"] + m["grads"] + m["optimizer_state"] for m in ranks] for mode, ranks in results.items()}


def table(results: dict[str, list[dict]]) -> list[str]:
    """The per-rank table (markdown lines) and the FSDP2 / DDP ratio."""
    mib = lambda b: f"{b / 2**20:,.1f}"
    lines = [
        "| mode | rank | params MiB | grads MiB | optimizer state MiB | total MiB | samples/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    tot = totals(results)
    for mode, ranks in results.items():
        for r, m in enumerate(ranks):
            lines.append(f"| {mode} | {r} | {mib(m['params'])} | {mib(m['grads'])} | "
                         f"{mib(m['optimizer_state'])} | {mib(tot[mode][r])} | {m['samples_per_second']:,.0f} |")
    ratio = max(tot["fsdp"]) / max(tot["ddp"])
    return lines + ["", f"FSDP2 / DDP, largest rank: {ratio:.3f} (ideal 1/2 = 0.500; the excess is shard padding)."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    results = run(args.steps)
    numel = results["ddp"][0]["numel"]
    lines = [
        "# Dense-state memory per rank: DDP vs FSDP2",
        "",
        f"`python benchmarks/dense_memory.py --steps {args.steps}`: DLRM-DCNv2 with "
        f"{numel / 1e6:.1f} M dense parameters (3 cross layers of rank 1024, top MLP 2048-2048-1024-1), "
        f"dense Adagrad, 2 ranks (gloo, CPU), global batch 512. Bytes each rank holds after a step.",
        "",
        *table(results),
    ]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "DENSE_MEMORY.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    # The property this benchmark exists to check: at most 1/N of DDP's plus a small constant.
    tot = totals(results)
    if max(tot["fsdp"]) > max(tot["ddp"]) / 2 + 2**20:
        sys.exit("FSDP2 holds more than 1/2 of DDP's dense state + 1 MiB")


if __name__ == "__main__":
    main()
