"""The reference: a hand-written TorchRec training loop, as TorchRec's own DLRM examples
(examples/golden_training/train_dlrm.py, examples/dlrm/dlrm_main.py) write it.

    planner -> DistributedModelParallel (its default DDP wrapper for the dense part)
            -> fused sparse optimizer (apply_optimizer_in_backward)
            -> dense optimizer (KeyedOptimizerWrapper) -> CombinedOptimizer
            -> TrainPipelineSparseDist; the loop body is pipeline.progress(iterator)

Same model (TorchRec's DLRM with the experiment's sizes), same data (the synthetic click
log, each rank taking its slice of the same global batches), same global batch, same
optimizers and learning rates as ``python -m hybridrec.train +experiment=ctr``: the numbers
are read from the config hybridrec composes for the same overrides, so the two cannot drift
apart. Nothing of hybridrec's training path (parallelize, optimizer, trainer) is used.

Timed like hybridrec's steady state (benchmarks/bench.py): the rate runs from the end of step
``--warmup`` (tracing, pipeline fill and lazy init excluded) to the last step, both points
after a collective, as hybridrec's log windows are. Step times are host wall time per
``progress`` call, over all steps, as hybridrec's summary.json reports them.

On CUDA (``--device cuda``, or auto when torch sees a GPU) each rank takes the GPU of its
LOCAL_RANK, NCCL, and the planner plans for ``cuda``: with the tables in device memory it
chooses FBGEMM's fused CUDA embedding kernels (the ``compute_kernels`` of the output).

    torchrun --standalone --nproc_per_node 2 benchmarks/reference_torchrec.py \\
        --steps 120 --warmup 20 --out ref.json [--device cuda] [hydra overrides, e.g. data.batch_size=4096]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from torchrec.datasets.random import RandomRecDataset
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.storage_reservations import HeuristicalStorageReservation
from torchrec.distributed.sharding_plan import get_default_sharders
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

CONF = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "hybridrec", "conf")


def experiment_config(overrides: list[str]):
    """The config ``python -m hybridrec.train +experiment=ctr <overrides>`` runs with: the
    source of the model sizes, data, batch and learning rates (data, not framework code)."""
    from hybridrec.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=os.path.abspath(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=["+experiment=ctr", *overrides])


def optimizer_class(target: str) -> type:
    module, name = target.rsplit(".", 1)
    return getattr(__import__(module, fromlist=[name]), name)


def kwargs(node) -> dict:
    from hybridrec.data import LOADER_KEYS  # the loader's settings, not the source's

    return {k: v for k, v in OmegaConf.to_container(node).items() if not k.startswith("_") and k not in LOADER_KEYS}


def pick_device(choice: str) -> torch.device:
    """This rank's device: ``auto`` = the GPU of LOCAL_RANK when torch sees one, else CPU."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise SystemExit("reference: --device cuda, but torch sees no GPU")
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    return torch.device("cpu")


def build_model(cfg, data, device: torch.device) -> DLRMTrain:
    """TorchRec's DLRM with the experiment's sizes, tables on the meta device (DMP
    materializes the local shards), the dense part on ``device``."""
    tables = [
        EmbeddingBagConfig(
            name=f"t_{f.name}",
            embedding_dim=cfg.model.embedding_dim,
            num_embeddings=f.num_embeddings,
            feature_names=[f.name],
        )
        for f in data.features
    ]
    return DLRMTrain(
        DLRM(
            embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
            dense_in_features=data.num_dense_features,
            dense_arch_layer_sizes=list(cfg.model.dense_arch_layer_sizes),
            over_arch_layer_sizes=list(cfg.model.over_arch_layer_sizes),
            dense_device=device,
        )
    )


def build_planner(
    world_size: int, local_world_size: int, device_type: str, local_batch: int
) -> EmbeddingShardingPlanner:
    """The planner as in dlrm_main.py: the ranks' device, per-rank batch, heuristic
    reservation (and TorchRec's default memory sizes)."""
    return EmbeddingShardingPlanner(
        topology=Topology(local_world_size=local_world_size, world_size=world_size, compute_device=device_type),
        batch_size=local_batch,
        storage_reservation=HeuristicalStorageReservation(percentage=0.05),
    )


def train(cfg, steps: int, warmup: int, device_choice: str = "auto", input_: str = "hybridrec") -> dict | None:
    device = pick_device(device_choice)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_batch = cfg.data.batch_size // world_size

    # Data: the same synthetic click log, each rank its rows of every global batch.
    from hybridrec.data import loader
    from hybridrec.data.synthetic import SyntheticClickLog

    data = SyntheticClickLog(seed=cfg.seed, **kwargs(cfg.data))
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, data, device)

    # Sparse optimizer fused into the embedding backward, before sharding.
    apply_optimizer_in_backward(
        optimizer_class(cfg.optimizer.sparse._target_),
        model.model.sparse_arch.parameters(),
        kwargs(cfg.optimizer.sparse),
    )

    planner = build_planner(world_size, int(os.environ["LOCAL_WORLD_SIZE"]), device.type, local_batch)
    plan = planner.collective_plan(model, get_default_sharders(), dist.GroupMember.WORLD)
    model = DistributedModelParallel(module=model, device=device, plan=plan)  # dense part: DDP

    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda params: optimizer_class(cfg.optimizer.dense._target_)(params, **kwargs(cfg.optimizer.dense)),
    )
    optimizer = CombinedOptimizer([model.fused_optimizer, dense])
    pipeline = TrainPipelineSparseDist(model, optimizer, device)

    if input_ == "pregenerated":
        # TorchRec's own examples' input: a few random batches generated up front and cycled
        # (torchrec.datasets.random.RandomRecDataset), the same shapes (rows per rank, dense
        # features, ids per feature, table sizes) and no input cost on the training thread.
        sizes = [int(f.pooling_factor) for f in data.features]  # the synthetic log: ids per sample, fixed
        batches = iter(
            RandomRecDataset(
                keys=data.keys,
                batch_size=local_batch,
                hash_sizes=[f.num_embeddings for f in data.features],
                ids_per_features=sizes,
                min_ids_per_features=sizes,
                num_dense=data.num_dense_features,
                manual_seed=cfg.seed + rank,
                num_generated_batches=10,
            )
        )
    else:  # hybridrec's synthetic click log, each rank its rows of every global batch
        batches = loader.batches(data, "train", rank, world_size, steps)
    step_times, losses = [], []
    for step in range(1, steps + 1):
        tick = time.perf_counter()
        loss, _logits, _labels = pipeline.progress(batches)
        step_times.append(time.perf_counter() - tick)
        losses.append(loss.detach())
        if step == warmup:
            sync(device)
            dist.barrier()  # the timed window starts when every rank is done with warm-up
            start = time.perf_counter()
    sync(device)
    dist.barrier()
    seconds = time.perf_counter() - start

    peak_rss = [None] * world_size  # ru_maxrss is KiB on Linux
    dist.all_gather_object(peak_rss, round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1))
    peak_device = [None] * world_size  # torch's caching allocator: tensors' peak on this GPU
    dist.all_gather_object(
        peak_device, round(torch.cuda.max_memory_allocated(device) / 2**20, 1) if device.type == "cuda" else None
    )
    loss_tail = torch.stack(losses[-max(1, steps // 10) :]).mean()
    dist.all_reduce(loss_tail)
    ms = np.array(step_times) * 1000
    out = {
        "world_size": world_size,
        "device": str(device),
        "input": input_,
        "steps": steps,
        "warmup_steps": warmup,
        "global_batch_size": cfg.data.batch_size,
        "samples_per_second": (steps - warmup) * cfg.data.batch_size / seconds,
        "step_time_p50_ms": float(np.percentile(ms, 50)),
        "step_time_p95_ms": float(np.percentile(ms, 95)),
        "peak_rss_mb": peak_rss,
        **({"peak_device_allocated_mb": peak_device} if device.type == "cuda" else {}),
        "train_loss": float(loss_tail) / world_size,  # mean of the last 10% of steps, global
        "plan": {t: [p.sharding_type, len(p.ranks)] for m in plan.plan.values() for t, p in m.items()},
        "compute_kernels": {t: p.compute_kernel for m in plan.plan.values() for t, p in m.items()},
    }
    dist.destroy_process_group()
    return out if rank == 0 else None


def sync(device: torch.device) -> None:
    """Wait for this rank's queued GPU work: the timer reads device time, not launch time."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--warmup", type=int, default=20, help="steps excluded from the rate")
    parser.add_argument("--out", required=True, help="JSON file rank 0 writes")
    parser.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="auto: the GPU of LOCAL_RANK when torch sees one, else CPU",
    )
    parser.add_argument(
        "--input",
        choices=["hybridrec", "pregenerated"],
        default="hybridrec",
        help="hybridrec: the synthetic click log built each step (hybridrec's input); "
        "pregenerated: TorchRec's RandomRecDataset, 10 batches generated up front and cycled",
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of +experiment=ctr (model/data/optimizer)")
    args = parser.parse_args()
    if not 1 <= args.warmup < args.steps:
        parser.error(f"--warmup must be in [1, --steps), got {args.warmup} and {args.steps}")
    # Library notices, not about this loop: TorchRec's ShardedTensor deprecation (once per
    # table) and the pipeline's fx-tracing notice (once per rank).
    warnings.filterwarnings("ignore", category=FutureWarning)
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    cfg = experiment_config(args.overrides)
    result = train(cfg, args.steps, args.warmup, args.device, args.input)
    if result is not None:
        result["config"] = OmegaConf.to_container(cfg, resolve=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"reference: {result['samples_per_second']:,.0f} samples/s on {result['world_size']} rank(s)")


if __name__ == "__main__":
    main()
