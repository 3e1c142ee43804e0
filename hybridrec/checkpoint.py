"""Distributed checkpoints with torch.distributed.checkpoint (DCP), and the unsharded export.

A checkpoint is a directory ``<checkpoint.dir>/step_<N>`` holding DCP's files for the model
(TorchRec's sharded tables as ShardedTensors, FSDP2 parameters as DTensors) and the
optimizers (fused sparse state, dense state), plus ``trainer_state.pt`` (step = data position,
learning-rate schedules, RNG states) and ``config.yaml``. DCP stores every tensor by its global
offsets, so a checkpoint loads under another world size or sharding plan (resharding).

Atomic commit: a save writes ``step_<N>.partial`` and, once every rank has finished,
rank 0 renames it to ``step_<N>``. A crash mid-save leaves only a ``.partial`` directory,
which resume never picks and the next save removes.
"""

from __future__ import annotations

import glob
import logging
import os
import re
import shutil
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)
_STEP_DIR = re.compile(r"step_(\d+)$")


def probe_writable(directory: str) -> None:
    """Fail now, not at the first save, if checkpoints cannot be written there."""
    try:
        os.makedirs(directory, exist_ok=True)
        probe = os.path.join(directory, f".probe-{os.getpid()}")
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"checkpoint.dir={directory} is not writable: {e}") from e


def latest(directory: str) -> Optional[str]:
    """The newest complete checkpoint (committed, with DCP's metadata), or None."""
    complete = [
        (int(m.group(1)), path)
        for path in glob.glob(os.path.join(directory, "step_*"))
        if (m := _STEP_DIR.search(path)) and os.path.isfile(os.path.join(path, ".metadata"))
    ]
    return max(complete)[1] if complete else None


def resume_path(cfg: DictConfig) -> Optional[str]:
    """checkpoint.resume: auto (newest complete, if any), never, or a checkpoint path."""
    resume = cfg.checkpoint.resume
    if resume == "never" or not cfg.checkpoint.dir and resume == "auto":
        return None
    if resume == "auto":
        return latest(cfg.checkpoint.dir)
    if not os.path.isfile(os.path.join(resume, ".metadata")):
        raise ValueError(f"checkpoint.resume={resume} is not a complete checkpoint (no .metadata)")
    return resume


def _app_state(trainer: Any) -> dict[str, Any]:
    """What DCP saves and loads in place: the sharded model and optimizer state."""
    return {"model": trainer.model.state_dict(), "optim": trainer.optimizer.optimizer.state_dict()}


def save(trainer: Any, step: int) -> str:
    """Save the training state after ``step`` (collective); returns the committed path."""
    cfg = trainer.cfg.checkpoint
    final = os.path.join(cfg.dir, f"step_{step:08d}")
    partial = final + ".partial"
    if trainer.rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    dist.barrier()
    try:
        dcp.save(_app_state(trainer), checkpoint_id=partial)
        rng = [None] * trainer.world_size
        dist.all_gather_object(rng, torch.get_rng_state())
        if trainer.rank == 0:
            torch.save(
                {
                    "step": step,
                    "schedulers": [s.state_dict() for s in trainer.optimizer.schedulers],
                    "rng": rng,
                    "losses": trainer.losses,
                    # what export needs to rebuild the model without the data files
                    "features": [vars(f) for f in trainer.data.features],
                    "num_dense_features": trainer.data.num_dense_features,
                },
                os.path.join(partial, "trainer_state.pt"),
            )
            OmegaConf.save(trainer.cfg, os.path.join(partial, "config.yaml"))
    except OSError as e:  # disk full, permissions: the previous checkpoint is untouched
        raise RuntimeError(f"checkpoint save at step {step} into {partial} failed: {e}") from e
    dist.barrier()  # every rank's files are written
    if trainer.rank == 0:
        shutil.rmtree(final, ignore_errors=True)  # a re-run of the same step replaces it
        os.replace(partial, final)  # the commit: atomic on one filesystem
        _prune(cfg.dir, cfg.keep_last)
    dist.barrier()
    return final


def _prune(directory: str, keep: int) -> None:
    steps = sorted((int(m.group(1)), p) for p in glob.glob(os.path.join(directory, "step_*"))
                   if (m := _STEP_DIR.search(p)))
    for _, path in steps[: max(0, len(steps) - keep)]:
        shutil.rmtree(path, ignore_errors=True)
    for stale in glob.glob(os.path.join(directory, "step_*.partial")):
        shutil.rmtree(stale, ignore_errors=True)  # an interrupted save


def load(trainer: Any, path: str) -> int:
    """Load a checkpoint into the trainer (any world size or plan); returns its step."""
    # The dense optimizers create their state lazily: create it now so DCP can load into it.
    for name, opt in trainer.optimizer.optimizer.optimizers:
        if name != "sparse":
            opt.init_state()
    state = _app_state(trainer)
    dcp.load(state, checkpoint_id=path)
    trainer.model.load_state_dict(state["model"])
    trainer.optimizer.optimizer.load_state_dict(state["optim"])
    extra = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False)
    for scheduler, saved in zip(trainer.optimizer.schedulers, extra["schedulers"]):
        scheduler.load_state_dict(saved)
    rng = extra["rng"]
    torch.set_rng_state(rng[trainer.rank] if len(rng) == trainer.world_size else rng[0])
    trainer.losses = list(extra["losses"])
    return int(extra["step"])
