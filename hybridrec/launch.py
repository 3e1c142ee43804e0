"""Starting ranks: in-process for one rank, PyTorch's elastic launcher for several.

``launcher.nproc_per_node=N`` starts N workers on this machine with
``torch.distributed.launcher.elastic_launch``, the machinery behind ``torchrun`` (c10d
rendezvous on a free local port, spawned workers, failures reported with tracebacks).
When the process is already one rank of a launched job (torchrun, srun), it just runs.
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any, Callable

from omegaconf import DictConfig

from hybridrec.trainer import run

log = logging.getLogger(__name__)


def already_launched() -> bool:
    """True when an outer launcher (torchrun, Slurm + env) made this process one rank."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def in_sweep() -> bool:
    """True inside a Hydra multirun job (``-m``), where jobs share the Hydra process."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def world_size(cfg: DictConfig) -> int:
    return int(os.environ["WORLD_SIZE"]) if already_launched() else cfg.launcher.nproc_per_node


def launch(cfg: DictConfig, run_dir: str) -> dict[str, Any]:
    """Run the job on ``world_size(cfg)`` ranks and return rank 0's summary."""
    if already_launched():
        if cfg.launcher.nproc_per_node != 1:
            log.info("already launched (torchrun/srun): launcher.nproc_per_node is ignored")
        return run(cfg, run_dir)
    nproc = cfg.launcher.nproc_per_node
    if nproc == 1 and not in_sweep():
        return run(cfg, run_dir)
    # Jobs of a sweep (-m) get processes of their own, one rank included: peak memory,
    # thread settings and library state of one job must not leak into the next.
    return spawn(run, nproc, cfg, run_dir, max_restarts=cfg.launcher.max_restarts)


def spawn(fn: Callable[..., Any], nproc: int, *args: Any, max_restarts: int = 0) -> Any:
    """Rank 0's return value of ``fn(*args)`` run on ``nproc`` local ranks, started by
    PyTorch's elastic launcher: c10d rendezvous on a free port, spawned workers, no restarts.
    Tests and benchmarks use it too, so they start ranks exactly as users do. With
    ``max_restarts``, a failed rank makes the agent stop and restart every rank."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"hybridrec-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # port 0: the c10d store picks a free port
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
    )
    # The elastic agent logs every state change at INFO; keep the user's console for training.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    return elastic_launch(config, fn)(*args)[0]
