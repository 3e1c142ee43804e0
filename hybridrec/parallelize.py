"""The only place where hybridrec shards a model.

Order, fixed for every model:
  1. fuse the sparse optimizer into the embedding backward (TorchRec needs it before sharding);
  2. plan the embedding tables with TorchRec's planner (identical plan on every rank);
  3. DistributedModelParallel shards the tables and hands the rest of the model to our
     data-parallel wrapper, which applies FSDP2 ``fully_shard`` to each dense unit (or DDP);
  4. initialize the embedding shards from the seed, independently of the plan.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.fsdp import fully_shard
from torchrec.distributed.model_parallel import (
    DataParallelWrapper,
    DefaultDataParallelWrapper,
    DistributedModelParallel,
)
from torchrec.distributed.types import ShardingEnv
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from hybridrec.config import DenseParallel, HybridrecConfig
from hybridrec.optim import sparse_optimizer
from hybridrec.sharding import HybridEBCSharder, plan_tables


class FSDP2Wrapper(DataParallelWrapper):
    """Shards the model's dense units with FSDP2.

    DMP calls ``wrap`` once the tables are sharded. TorchRec's default wrapper puts the rest of
    the model in DDP, which fails on FSDP2's DTensor parameters, so this one applies
    ``fully_shard`` to the units the model names (its MLPs) and leaves the tables alone.
    """

    def __init__(self, reshard_after_forward: bool) -> None:
        self.reshard_after_forward = reshard_after_forward

    def wrap(self, dmp: DistributedModelParallel, env: ShardingEnv, device: torch.device) -> None:
        mesh = DeviceMesh.from_group(env.process_group, device.type)
        for unit in dmp.module.dense_units():
            fully_shard(unit, mesh=mesh, reshard_after_forward=self.reshard_after_forward)
        # Data-parallel tables need nothing here: TorchRec wraps their lookups in DDP itself
        # (ShardedEmbeddingBagCollection.init_data_parallel).


def parallelize(
    model: nn.Module,
    cfg: HybridrecConfig,
    device: torch.device,
    local_world_size: int,
    pooling: dict[str, float],
    pg: dist.ProcessGroup,
) -> tuple[DistributedModelParallel, dict | None]:
    """Shard ``model``; returns the DMP and the plan report (on rank 0, else None)."""
    cls, kwargs = sparse_optimizer(cfg.optimizer.sparse)
    apply_optimizer_in_backward(cls, model.sparse_module().parameters(), kwargs)

    sharder = HybridEBCSharder()
    plan, report = plan_tables(
        model, cfg, sharder, dist.get_world_size(pg), local_world_size, device.type, pooling, pg
    )
    wrapper = (
        FSDP2Wrapper(cfg.mesh.reshard_after_forward)
        if cfg.mesh.dense == DenseParallel.fsdp
        else DefaultDataParallelWrapper()
    )
    dmp = DistributedModelParallel(
        module=model,
        env=ShardingEnv.from_process_group(pg),
        device=device,
        plan=plan,
        sharders=[sharder],
        data_parallel_wrapper=wrapper,
    )
    init_embeddings(dmp.module.sparse_module(), cfg.seed)
    return dmp, report


_INIT_BLOCK = 65536  # rows per independently seeded block of the embedding init


@torch.no_grad()
def init_embeddings(sharded_ebc: nn.Module, seed: int) -> None:
    """Fill every local shard with values that depend only on (seed, table, row, column).

    TorchRec initializes each shard from the process's random stream, so the same seed gives
    different tables under different plans or world sizes. Here the table is split into
    blocks of rows, each drawn from its own seeded generator: a shard draws the blocks it
    overlaps and keeps its rows and columns. Result: identical tables for any plan, which is
    what lets a 2-rank run reproduce a 1-rank run, and a run be reproduced on another cluster.
    """
    for key, weight in sharded_ebc.state_dict().items():
        table = key.split(".")[-2]
        rows, dim = weight.size()
        shards = (
            [(s.metadata.shard_offsets, s.tensor) for s in weight.local_shards()]
            if isinstance(weight, ShardedTensor)
            else [((0, 0), weight)]  # data_parallel: a full replica
        )
        for (row0, col0), local in shards:
            local.copy_(_table_slice(seed, table, rows, dim, row0, row0 + local.size(0), col0, col0 + local.size(1)))


def _table_slice(
    seed: int, table: str, rows: int, dim: int, row0: int, row1: int, col0: int, col1: int
) -> torch.Tensor:
    # TorchRec's default init distribution: uniform(+-sqrt(1 / num_embeddings)).
    bound = (1.0 / rows) ** 0.5
    table_seed = (seed * 1_000_003 + zlib.crc32(table.encode())) * 1_000_033
    parts = []
    for block in range(row0 // _INIT_BLOCK, (row1 - 1) // _INIT_BLOCK + 1):
        lo = block * _INIT_BLOCK
        n = min(_INIT_BLOCK, rows - lo)
        g = torch.Generator().manual_seed((table_seed + block) % 2**63)
        values = torch.empty(n, dim).uniform_(-bound, bound, generator=g)
        parts.append(values[max(row0 - lo, 0) : min(row1 - lo, n), col0:col1])
    return torch.cat(parts)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict, on rank 0 (other ranks get an empty dict). Collective.

    Embedding shards (ShardedTensor, any sharding type) are gathered with
    ``ShardedTensor.gather``; FSDP2 parameters (DTensor) with ``full_tensor``; replicated
    tensors are taken as they are. Keys are those of the unsharded model.
    """
    rank = dist.get_rank()
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        if isinstance(value, ShardedTensor):
            full = torch.empty(value.size(), dtype=value.dtype) if rank == 0 else None
            value.gather(dst=0, out=full)
        elif isinstance(value, DTensor):
            full = value.full_tensor()
        else:
            full = value
        if rank == 0:
            out[key] = full.detach().cpu().clone()
    return out
