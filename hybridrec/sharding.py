"""Embedding placement: the sharder, the planner's topology and constraints, the plan report."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
from torchrec.distributed.planner.types import (
    KernelConfig,
    ParameterConstraints,
    TopologyFactory,
    TrainerConfig,
)
from torchrec.distributed.types import ShardingPlan, ShardingType

from hybridrec.config import ShardingConfig


class HybridEBCSharder(EmbeddingBagCollectionSharder):
    """TorchRec's sharder, with row-wise and table-row-wise offered on CPU too.

    TorchRec 1.8 lists them for CUDA/MTIA only, but on CPU/gloo they plan, train and match
    single-process training (tests/test_equivalence.py). Offering them makes every row-wise
    code path runnable and testable without a GPU.
    """

    def sharding_types(self, compute_device_type: str) -> list[str]:
        types = super().sharding_types(compute_device_type)
        if compute_device_type == "cpu":
            types += [t.value for t in (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE) if t.value not in types]
        return types


def make_plan(
    model: nn.Module,
    cfg: ShardingConfig,
    sharder: HybridEBCSharder,
    device: torch.device,
    local_batch_size: int,
    local_world_size: int,
    pg: dist.ProcessGroup,
) -> ShardingPlan:
    """Ask TorchRec's planner for a plan; ``collective_plan`` plans on rank 0 and broadcasts it."""
    topology = TopologyFactory.create_topology(
        trainer_config=TrainerConfig(
            world_size=dist.get_world_size(pg), local_world_size=local_world_size
        ),
        kernel_config=KernelConfig(compute_device=device.type),
    )
    tables = [name.split(".")[-2] for name, _ in model.named_parameters() if "embedding_bags" in name]
    # One ParameterConstraints per table; an empty list leaves that choice to the planner.
    constraints = {
        table: ParameterConstraints(
            sharding_types=[t.value for t in cfg.types] or None,
            compute_kernels=list(cfg.compute_kernels) or None,
        )
        for table in tables
    }
    planner = EmbeddingShardingPlanner(
        topology=topology,
        batch_size=local_batch_size,
        constraints=constraints,
        # TorchRec's default (heuristic) reservation is deprecated for over-estimating dense
        # tensors; reserve a fixed share of each rank's memory for everything but the tables.
        storage_reservation=FixedPercentageStorageReservation(percentage=0.15),
    )
    return planner.collective_plan(model, [sharder], pg)


def plan_report(plan: ShardingPlan) -> dict[str, dict[str, Any]]:
    """For every table: where the planner put it (``summary.json``'s ``plan``)."""
    report = {}
    for module_path, params in plan.plan.items():
        for table, ps in params.items():  # type: ignore[union-attr]
            report[table] = {
                "module": module_path,
                "sharding_type": ps.sharding_type,
                "compute_kernel": ps.compute_kernel,
                "ranks": list(ps.ranks or []),
            }
    return report
