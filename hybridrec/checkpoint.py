"""Distributed checkpoints with torch.distributed.checkpoint (DCP), and the unsharded export.

A checkpoint is a directory ``<checkpoint.dir>/step_<N>`` holding DCP's files for the model
(TorchRec's sharded tables as ShardedTensors, FSDP2 parameters as DTensors) and the
optimizers (fused sparse state, dense state), plus hybridrec's own state (``TrainState``:
step = data position, learning-rate schedules, RNG states, losses, feature list) and
``config.yaml``. DCP stores every tensor by its global offsets, so a checkpoint loads under
another world size or sharding plan (resharding).

Loading hybridrec's files never runs code from the checkpoint: ``trainer_state.json`` is
JSON, ``trainer_state.pt`` holds plain tensors and is read with ``torch.load(weights_only=True)``
(a file with pickled objects is refused, not loaded), and ``config.yaml`` is read by
OmegaConf with yaml's safe loader. DCP's own ``.metadata`` is a pickle that
torch.distributed.checkpoint unpickles itself: like any DCP checkpoint, load one only from a
trusted source.

Atomic commit: a save writes ``step_<N>.partial`` and, once every rank has finished,
rank 0 renames it to ``step_<N>``. A crash mid-save leaves only a ``.partial`` directory,
which resume never picks and the next save removes.
"""

from __future__ import annotations

import copy
import glob
import json
import logging
import os
import pickle
import re
import shutil
import warnings
from dataclasses import dataclass
from typing import Any, Optional

from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)
_STEP_DIR = re.compile(r"step_(\d+)$")
STATE_JSON, STATE_TENSORS = "trainer_state.json", "trainer_state.pt"


class CheckpointError(ValueError):
    """A checkpoint hybridrec refuses to load: state files holding pickled objects, a format
    written by an older hybridrec, or files missing."""


@dataclass
class TrainState:
    """hybridrec's own part of a checkpoint, beside DCP's files: what resume needs besides the
    model and optimizer state, and what export needs to rebuild the model.

    Stored as ``trainer_state.json`` and ``trainer_state.pt`` (plain tensors, read with
    ``torch.load(weights_only=True)``), so loading it never unpickles an object.
    """

    step: int
    """Steps done, which is also the data position: every source restarts at that global batch."""
    schedulers: list[dict[str, Any]]
    """``LambdaLR.state_dict()`` of each optimizer part. Numbers only: the schedules are plain
    functions rebuilt from the config, which torch stores as None in ``lr_lambdas``."""
    features: list[dict[str, Any]]
    """The sparse features (``SparseFeature`` fields), so export needs no data files."""
    num_dense_features: int
    rng: torch.Tensor
    """uint8, ``[world_size, n]``: every rank's CPU RNG state."""
    losses: torch.Tensor
    """float64: the global mean loss of every step so far (the Python floats, exactly)."""

    def to_files(self, directory: str) -> None:
        torch.save({"rng": self.rng, "losses": self.losses}, os.path.join(directory, STATE_TENSORS))
        fields = {"step": self.step, "schedulers": self.schedulers, "features": self.features,
                  "num_dense_features": self.num_dense_features}
        with open(os.path.join(directory, STATE_JSON), "w") as f:
            json.dump(fields, f, indent=1)  # floats are written in full: they read back bit-exact

    @classmethod
    def from_files(cls, directory: str) -> TrainState:
        """Read and check the state (a ``CheckpointError`` says what is wrong with it)."""
        json_path, tensors_path = os.path.join(directory, STATE_JSON), os.path.join(directory, STATE_TENSORS)
        if not os.path.isfile(json_path) and os.path.isfile(tensors_path):
            # Never opened: before this format, trainer_state.pt was read with a full unpickle.
            raise CheckpointError(
                f"{directory} was written by an older hybridrec, whose state ({STATE_TENSORS} without "
                f"{STATE_JSON}) was read by unpickling arbitrary objects; this version does not load that "
                f"format. Re-create the checkpoint by training again with this version"
            )
        for path in (json_path, tensors_path):
            if not os.path.isfile(path):
                name = os.path.basename(path)
                raise CheckpointError(f"{directory} is not a complete hybridrec checkpoint (no {name})")
        try:
            with open(json_path) as f:
                fields = json.load(f)
        except ValueError as e:  # not JSON, or not text
            raise CheckpointError(f"{json_path} is not a valid checkpoint file: {e}") from e
        tensors = _load_tensors(tensors_path)
        if (not isinstance(fields, dict) or {"step", "schedulers", "features", "num_dense_features"} - fields.keys()
                or not all(isinstance(tensors.get(k), torch.Tensor) for k in ("rng", "losses"))):
            raise CheckpointError(f"{directory} is not a valid hybridrec checkpoint: its state lacks fields it needs")
        return cls(step=int(fields["step"]), schedulers=fields["schedulers"], features=fields["features"],
                   num_dense_features=int(fields["num_dense_features"]), rng=tensors["rng"], losses=tensors["losses"])


def _load_tensors(path: str) -> dict[str, Any]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns about a pickle protocol before refusing it
            tensors = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # torch's message is a paragraph; the line naming the refused global is what matters
        reason = next((line.strip().rstrip(".") for line in str(e).splitlines() if "nsupported" in line), "")
        raise CheckpointError(
            f"{path} is not a safe checkpoint file (it holds pickled objects, which loading would execute)"
            f"{': ' + reason if reason else ''}; refused, nothing in it was run"
        ) from e
    if not isinstance(tensors, dict):
        raise CheckpointError(f"{path} is not a valid checkpoint file: a {type(tensors).__name__}, not tensors by name")
    return tensors


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


class Checkpointer:
    """Saves the trainer's state every ``checkpoint.every_n_steps`` and at the end.

    With ``checkpoint.async_save``, DCP first copies the state into CPU staging memory and
    writes it from a background thread while training goes on; the checkpoint is committed
    (renamed from ``.partial``) once that write has finished, at the next save or at the
    end. Its background collectives run on a gloo group of their own, so they never
    interleave with the training's collectives.
    """

    def __init__(self, trainer: Any) -> None:
        self.trainer, self.cfg = trainer, trainer.cfg.checkpoint
        self.group = dist.new_group(backend="gloo") if self.cfg.async_save else None
        self.writer = ThreadPoolExecutor(max_workers=1) if self.cfg.async_save else None
        self.pending: Optional[tuple] = None

    def save(self, step: int) -> None:
        """Save the state after ``step`` (collective)."""
        self.wait()  # one save in flight at a time
        t = self.trainer
        final = os.path.join(self.cfg.dir, f"step_{step:08d}")
        partial = final + ".partial"
        if t.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            os.makedirs(partial)
        dist.barrier()
        extra = self._trainer_state(step)  # captured now, written at commit
        try:
            if self.cfg.async_save:
                # DCP's async_save cannot stage TorchRec's ShardedTensors (no data_ptr), so
                # copy the state here and run DCP's save on the copy in a background thread:
                # what async_save does, with a stager that knows ShardedTensors.
                staged = _stage(_app_state(t))
                future = self.writer.submit(dcp.save, staged, checkpoint_id=partial, process_group=self.group)
                self.pending = (future, step, partial, final, extra)
                return
            dcp.save(_app_state(t), checkpoint_id=partial)
        except OSError as e:  # disk full, permissions: the previous checkpoint is untouched
            raise RuntimeError(f"checkpoint save at step {step} into {partial} failed: {e}") from e
        self._commit(step, partial, final, extra)

    def wait(self) -> None:
        """Finish and commit an async save in flight, if any."""
        if self.pending is None:
            return
        future, step, partial, final, extra = self.pending
        self.pending = None
        try:
            future.result()
        except OSError as e:
            raise RuntimeError(f"checkpoint save at step {step} into {partial} failed: {e}") from e
        self._commit(step, partial, final, extra)

    def _trainer_state(self, step: int) -> TrainState:
        t = self.trainer
        rng = [None] * t.world_size
        dist.all_gather_object(rng, torch.get_rng_state())
        return TrainState(
            step=step,
            schedulers=copy.deepcopy([s.state_dict() for s in t.optimizer.schedulers]),
            features=[vars(f) for f in t.data.features],
            num_dense_features=t.data.num_dense_features,
            rng=torch.stack(rng),
            losses=torch.tensor(t.losses, dtype=torch.float64),
        )

    def _commit(self, step: int, partial: str, final: str, extra: TrainState) -> None:
        t = self.trainer
        dist.barrier()  # every rank's files are written
        if t.rank == 0:
            extra.to_files(partial)
            OmegaConf.save(t.cfg, os.path.join(partial, "config.yaml"))
            shutil.rmtree(final, ignore_errors=True)  # a re-run of the same step replaces it
            os.replace(partial, final)  # the commit: atomic on one filesystem
            _prune(self.cfg.dir, self.cfg.keep_last)
        dist.barrier()
        log.info(f"checkpoint committed: {final}")


def _stage(obj: Any) -> Any:
    """A copy of a state dict that training can no longer change."""
    if isinstance(obj, ShardedTensor):
        shards = [Shard(s.tensor.detach().clone(), s.metadata) for s in obj.local_shards()]
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            shards, obj.metadata(), process_group=obj._process_group
        )
    if isinstance(obj, torch.Tensor):  # DTensor included: clone keeps its placements
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _stage(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_stage(v) for v in obj)
    return copy.deepcopy(obj)


def _prune(directory: str, keep: int) -> None:
    steps = sorted((int(m.group(1)), p) for p in glob.glob(os.path.join(directory, "step_*"))
                   if (m := _STEP_DIR.search(p)))
    for _, path in steps[: max(0, len(steps) - keep)]:
        shutil.rmtree(path, ignore_errors=True)
    for stale in glob.glob(os.path.join(directory, "step_*.partial")):
        shutil.rmtree(stale, ignore_errors=True)  # an interrupted save


def load(trainer: Any, path: str) -> int:
    """Load a checkpoint into the trainer (any world size or plan); returns its step."""
    extra = TrainState.from_files(path)  # first: a refused checkpoint loads nothing
    # The dense optimizers create their state lazily: create it now so DCP can load into it.
    for name, opt in trainer.optimizer.optimizer.optimizers:
        if name != "sparse":
            opt.init_state()
    state = _app_state(trainer)
    dcp.load(state, checkpoint_id=path)
    trainer.model.load_state_dict(state["model"])
    trainer.optimizer.optimizer.load_state_dict(state["optim"])
    for scheduler, saved in zip(trainer.optimizer.schedulers, extra.schedulers):
        scheduler.load_state_dict(saved)
    rng = extra.rng
    torch.set_rng_state((rng[trainer.rank] if len(rng) == trainer.world_size else rng[0]).clone())
    trainer.losses = extra.losses.tolist()
    return extra.step
