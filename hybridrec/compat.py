"""Every use of a private TorchRec, torch or Hydra attribute, in one place.

The pins (constraints.txt: torch 2.13.0, torchrec 1.8.0, hydra-core 1.3.2) are what these were
read against; a version bump breaks them here, not across the package. Each function says
which public API is missing.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

# ShardedTensor lives under torch.distributed._shard: TorchRec's sharded tables are
# ShardedTensors, and torch has no public import path for the class while it deprecates it.
from torch.distributed._shard.sharded_tensor import ShardedTensor  # noqa: F401  (re-exported)
# DCP's planner puts a loaded non-tensor value back into the nested state dict with this
# helper; a planner that loads those values safely (checkpoint.SafeLoadPlanner) needs it too.
from torch.distributed.checkpoint._traverse import set_element  # noqa: F401  (re-exported)
from torch.utils._pytree import tree_map_only  # noqa: F401  (re-exported: no public pytree map by type)
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.types import Topology


def dmp_root(dmp: DistributedModelParallel) -> nn.Module:
    """The module DMP wraps, as the data-parallel wrapper must see it. ``dmp.module`` is the
    public accessor, but it unwraps DDP/FSDP and so is not the object FSDP2's root
    ``fully_shard`` must be applied to while DMP is still building its wrapper."""
    return dmp._dmp_wrapped_module


def planner_topology(planner: EmbeddingShardingPlanner) -> Topology:
    """The topology the planner was built with (kept only privately by the planner)."""
    return planner._topology


def planner_options(planner: EmbeddingShardingPlanner, module: nn.Module, sharders: list) -> list:
    """Every sharding option the planner's enumerator offers: the planner exposes no way to
    ask why no plan fits, so the error message enumerates the options itself."""
    return planner._enumerator.enumerate(module, sharders)


def planner_reserved_share(planner: EmbeddingShardingPlanner) -> float:
    """The share of device memory the planner's storage reservation holds back (no public
    getter on either reservation policy; 0 when the policy has none)."""
    return getattr(planner._storage_reservation, "_percentage", 0.0)


def floating_to(x: Any, dtype: torch.dtype) -> Any:
    """Every floating-point tensor in a nested structure cast to ``dtype``."""
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, x)


@contextlib.contextmanager
def one_post_forward_mesh() -> Iterator[None]:
    """Inside: every ``fully_shard`` with ``reshard_after_forward=N`` (an int) on the same mesh
    shares one post-forward mesh. FSDP2 builds a new DeviceMesh, with new process groups
    (NCCL communicators), for each call; there is no public way to pass one in."""
    import torch.distributed.fsdp._fully_shard._fully_shard as fs

    build, meshes = fs._get_post_forward_mesh_info, {}

    def shared(reshard_after_forward: Any, mesh_info: Any) -> Any:
        if isinstance(reshard_after_forward, bool):
            return build(reshard_after_forward, mesh_info)
        key = (reshard_after_forward, id(mesh_info.mesh))
        if key not in meshes:
            meshes[key] = build(reshard_after_forward, mesh_info)
        return meshes[key]

    fs._get_post_forward_mesh_info = shared
    try:
        yield
    finally:
        fs._get_post_forward_mesh_info = build


def size_oblivious_export() -> Any:
    """A context in which ``torch.export`` keeps a dynamic dimension general for sizes 0 and
    1 too. By default it specializes on them, so a program traced for a batch of rows
    refuses a batch of one row (a guard failure at call time). The switch is the one torch's
    export tutorial documents as experimental: ``torch.fx.experimental._config``."""
    import torch.fx.experimental._config as fx_config

    return fx_config.patch(backed_size_oblivious=True)


def failed_job_error(job_return: Any) -> BaseException:
    """The exception a failed Hydra job raised (``hydra.core.utils.JobReturn``): the public
    ``return_value`` re-raises it, after writing "Error executing job" to stderr, which a
    callback that only records the failure must not do; the dataclass keeps it in a field."""
    return job_return._return_value


def decline_restarts(agent: Any) -> None:
    """Make torch's elastic agent end the job at this failure instead of restarting its
    workers: it restarts while its private ``_remaining_restarts`` is above 0, and has no
    public way to refuse a restart for one kind of failure (``_monitor_workers``, where the
    failure is seen, is the documented method to extend: "Elastic Agent: Extending the Agent")."""
    agent._remaining_restarts = 0


def restarts_left(agent: Any) -> int:
    """How many more times torch's elastic agent will restart its workers after a failure
    (its private ``_remaining_restarts``; no public getter)."""
    return agent._remaining_restarts
