"""Helpers that run inside ranks started by elastic_launch (importable by spawned workers)."""

from __future__ import annotations

import os
import uuid
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch.distributed.tensor import DTensor
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from hybridrec.parallelize import full_state_dict
from hybridrec.trainer import Trainer, init_distributed, pick_device


def train_and_gather(cfgs: list[DictConfig], run_dir: str) -> list[dict[str, Any]]:
    """Train each config in turn in one process group; return per-step global losses, the
    unsharded final weights (rank 0) and the plan, for each."""
    warnings.simplefilter("ignore", FutureWarning)
    device = pick_device(cfgs[0])
    init_distributed(device)
    try:
        results = []
        for i, cfg in enumerate(cfgs):
            out = os.path.join(run_dir, str(i))
            os.makedirs(out, exist_ok=True)
            trainer = Trainer(cfg, out, device)
            summary = trainer.train()
            results.append(
                {
                    "losses": trainer.losses,
                    "state": full_state_dict(trainer.model),
                    "summary": summary,
                    "dense_placements": _dense_placements(trainer),
                    "plan_notes": (trainer.plan or {}).get("notes"),
                }
            )
        return results
    finally:
        dist.destroy_process_group()


def _dense_placements(trainer: Trainer) -> str:
    """How the dense parameters are held: "S(0)" (sharded on dim 0) for FSDP2, "replicated" otherwise."""
    dense = [p for m in trainer.model.module.dense_units() for p in m.parameters()]
    kinds = {str(p.placements[0]) if isinstance(p, DTensor) else "replicated" for p in dense}
    assert len(kinds) == 1, kinds
    return kinds.pop()


def launch(fn: Callable, nproc: int, *args: Any) -> Any:
    """Rank 0's return value of fn(*args) run on nproc local ranks (gloo)."""
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex[:8],
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
        monitor_interval=0.1, start_method="spawn",
    )
    return elastic_launch(config, fn)(*args)[0]
