"""The job's parallel layout, built and validated once: world size, ranks per node, device,
the dense replicate x shard degrees and the embedding replicas (2D).

The same object is built before launch (``job_dims``: from the launcher config or
torchrun's environment), for a dry plan (``planning_dims``: topology.world_size /
local_world_size), and inside every rank (``rank_dims``: from the process group and the
launcher's environment). Planning and parallelization take it; nothing else does mesh
arithmetic.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

import torch
from omegaconf import DictConfig

from hybridrec.config.schema import DenseParallel, Device
from hybridrec.parallel.devices import device_type
from hybridrec.parallel.distributed import local_layout


@dataclass(frozen=True)
class ParallelDims:
    world_size: int
    local_world_size: int
    """Ranks per node."""
    device_type: str
    """"cuda" or "cpu": where the ranks compute (and what the plan is for)."""
    dense: DenseParallel
    replicate: int
    """Dense replicas: > 1 only for mesh=hsdp."""
    shard: int
    """Ranks each dense replica is sharded over (FSDP2); the whole world for fsdp."""
    embedding_replicas: int
    """Copies of every table shard (2D, TorchRec's DMPCollection); 1 = plain sharding."""

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.local_world_size < 1:
            raise ValueError(f"world size {self.world_size} and ranks per node {self.local_world_size} must be >= 1")
        if self.replicate * self.shard != self.world_size:
            raise ValueError(
                f"mesh=hsdp needs mesh.replicate x mesh.shard = world_size, got replicate={self.replicate} "
                f"x shard={self.shard} = {self.replicate * self.shard} but world_size={self.world_size}"
            )
        r = self.embedding_replicas
        if r < 1 or self.world_size % r:
            raise ValueError(f"mesh.embedding_replicas={r} must be >= 1 and divide the world size {self.world_size}")
        if self.local_world_size % r and r % self.local_world_size:
            raise ValueError(
                f"mesh.embedding_replicas={r} with {self.local_world_size} ranks per node: one must "
                f"divide the other, so that every sharding group has as many ranks on each node"
            )

    @classmethod
    def build(cls, mesh: DictConfig, world_size: int, local_world_size: int, device_type: str) -> ParallelDims:
        """Unset degrees derived: hsdp shards within a node unless told otherwise."""
        if mesh.dense == DenseParallel.hsdp:
            shard = mesh.shard or (world_size // mesh.replicate if mesh.replicate else local_world_size)
            replicate = mesh.replicate or max(1, world_size // shard)
        else:
            replicate, shard = 1, world_size
        return cls(world_size, local_world_size, device_type, mesh.dense, replicate, shard, mesh.embedding_replicas)

    @property
    def embedding_group(self) -> int:
        """Ranks of one sharding group: the world the planner plans for under 2D.

        DMPCollection puts the R replicas of a shard on consecutive ranks, so that their sync
        all-reduce stays inside a node; a sharding group is then every R-th rank."""
        return self.world_size // self.embedding_replicas

    @property
    def embedding_group_per_node(self) -> int:
        """Ranks of one sharding group on each node (TorchRec's ``node_group_size``)."""
        return max(1, self.local_world_size // self.embedding_replicas)


def job_dims(cfg: DictConfig, world_size: int, env: Mapping[str, str] = os.environ) -> ParallelDims:
    """Before launch: ``world_size`` ranks (hybridrec.run.launch.world_size), as many per node as
    the launcher starts (torchrun's or srun's layout when already launched)."""
    launched = "RANK" in env and "WORLD_SIZE" in env
    local = local_layout(env).world_size if launched else min(cfg.launcher.nproc_per_node, world_size)
    return ParallelDims.build(cfg.mesh, world_size, local, device_type(cfg))


def planning_dims(cfg: DictConfig) -> ParallelDims:
    """A dry plan (``python -m hybridrec.plan``): the cluster topology.world_size /
    local_world_size / compute_device describe, defaulting to the launcher's."""
    topo = cfg.topology
    # "is None", not "or": a 0 given is refused by validation, not read as unset
    world = topo.world_size if topo.world_size is not None else cfg.launcher.nproc_per_node
    local = topo.local_world_size if topo.local_world_size is not None else world
    device = device_type(cfg) if topo.compute_device == Device.auto else topo.compute_device.value
    return ParallelDims.build(cfg.mesh, world, local, device)


def rank_dims(
    cfg: DictConfig,
    world_size: int,
    device: torch.device,
    env: Mapping[str, str] = os.environ,
) -> ParallelDims:
    """Inside a rank: the process group's size, and the ranks per node the launcher set."""
    return ParallelDims.build(cfg.mesh, world_size, local_layout(env).world_size, device.type)
