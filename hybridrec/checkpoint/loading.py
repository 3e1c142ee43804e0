"""Restoring a checkpoint into a run (``load``: everything a resume needs) or only its
weights into a model (``load_weights``: scoring), through the safe reader."""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch.distributed.checkpoint.api import CheckpointException

from hybridrec.checkpoint.compatibility import check_compatible
from hybridrec.checkpoint.errors import CheckpointError, one_line, root_cause
from hybridrec.checkpoint.safety import refusal, safe_load
from hybridrec.checkpoint.saver import Resumable
from hybridrec.checkpoint.state import TrainState
from hybridrec.config.objective import Selection


def load(cfg: DictConfig, path: str, live: Resumable) -> TrainState:
    """Restore a checkpoint (of any world size or plan) into ``live``, the state of a run of
    ``cfg``: model, optimizer, LR schedulers, this rank's RNG, the loss history and the runs
    it continues. Returns the saved state (its ``step`` is where training goes on)."""
    extra = TrainState.from_files(path, cfg.checkpoint.allow_unverified)  # first: a refused checkpoint loads nothing
    # train.py checked this before launch; ranks started otherwise (tests, benchmarks) check here
    check_compatible(cfg, path, extra, live.features, live.num_dense_features, live.data_version)
    # The dense optimizers create their state lazily: create it now so DCP can load into it.
    for name, opt in live.optimizer.optimizer.optimizers:
        if name != "sparse":
            opt.init_state()
    state = live.dcp_state()
    _dcp_load(
        state,
        path,
        "resume with the model and data config it was saved with ({path}/config.yaml), or start "
        "a new run in another checkpoint.dir",
    )
    live.model.load_state_dict(state["model"])
    live.optimizer.optimizer.load_state_dict(state["optim"])
    for scheduler, saved in zip(live.optimizer.schedulers, extra.schedulers):
        scheduler.load_state_dict(saved)
    rng, rank = extra.rng, dist.get_rank()
    torch.set_rng_state((rng[rank] if len(rng) == dist.get_world_size() else rng[0]).clone())
    live.losses[:] = extra.losses.tolist()
    live.runs[:] = extra.runs + live.runs[-1:]  # this run continues those: their checkpoints are its own
    vars(live.selection).update(vars(Selection.from_dict(extra.selection)))
    live.stream.clear()
    live.stream.update(extra.stream)
    return extra


def load_weights(model: Any, path: str, allow_unverified: bool = False) -> int:
    """Load only the model's weights of the checkpoint at ``path`` into ``model`` (sharded by
    any plan, on any world size: DCP reads the parts each rank holds); returns its step.
    The optimizer state stays on disk: scoring a saved model needs none of it."""
    step = TrainState.from_files(path, allow_unverified).step  # first: a refused checkpoint loads nothing
    state = {"model": model.state_dict()}
    _dcp_load(
        state,
        path,
        "evaluate it with the data it was trained on: give only data keys that keep the "
        "features and their sizes ({path}/config.yaml)",
    )
    model.load_state_dict(state["model"])
    return step


def _dcp_load(state: dict[str, Any], path: str, fix: str) -> None:
    try:
        safe_load(state, path)
    except CheckpointError:
        raise
    except CheckpointException as e:
        # A difference check_compatible does not know of (the files themselves and the model,
        # table and optimizer layout were checked before launch), or what the safe reader,
        # the safe planner or DCP's own weights_only read of a tensor refused.
        cause = root_cause(e)
        if isinstance(cause, (CheckpointError, pickle.UnpicklingError)):
            raise refusal(cause, f"a .distcp file of {path}") from None
        raise CheckpointError(
            f"{path} does not fit this run's model ({type(cause).__name__}: {one_line(cause)}): "
            + fix.format(path=path)
        ) from e
