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
which resume never picks and a save of the same step replaces; a save that fails (disk
full) removes its own ``.partial`` and says why in one line.

Ownership: every checkpoint records the runs it descends from (``TrainState.runs``, a
random id per run, inherited on resume). ``keep_last`` prunes only checkpoints written by
this run or by the runs it continues, so a directory shared by mistake never loses another
run's checkpoints; ``train.py`` refuses such a directory before launch anyway.
"""

from __future__ import annotations

import copy
import errno
import glob
import json
import logging
import os
import pickle
import re
import shutil
import uuid
import warnings
from dataclasses import dataclass
from typing import Any, NoReturn, Optional

from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor
from omegaconf import DictConfig, OmegaConf
from torch import nn

from hybridrec.compat import ShardedTensor
from hybridrec.data import SparseFeature
from hybridrec.optim import TrainOptimizer

log = logging.getLogger(__name__)
_STEP_DIR = re.compile(r"step_(\d+)$")
STATE_JSON, STATE_TENSORS = "trainer_state.json", "trainer_state.pt"
CONFIG_YAML = "config.yaml"  # the run's resolved config: what check_compatible compares


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
    runs: list[str]
    """Ids of the runs whose training this checkpoint holds, oldest first: the last one wrote
    it. A run prunes only checkpoints written by a run in its own list (itself, or a run it
    resumed). Empty in checkpoints written before the field existed: never pruned."""

    def to_files(self, directory: str) -> None:
        torch.save({"rng": self.rng, "losses": self.losses}, os.path.join(directory, STATE_TENSORS))
        fields = {"step": self.step, "schedulers": self.schedulers, "features": self.features,
                  "num_dense_features": self.num_dense_features, "runs": self.runs}
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
                raise CheckpointError(f"{directory} is damaged: {path} is missing")
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
                   num_dense_features=int(fields["num_dense_features"]), rng=tensors["rng"], losses=tensors["losses"],
                   runs=[str(r) for r in fields.get("runs", [])])


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


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def committed(directory: str) -> list[tuple[int, str]]:
    """(step, path) of the committed checkpoint directories (``step_<N>``, not ``.partial``),
    oldest first, whether complete or damaged."""
    return sorted((int(m.group(1)), path) for path in glob.glob(os.path.join(directory, "step_*"))
                  if (m := _STEP_DIR.search(path)) and os.path.isdir(path))


def check_complete(path: str) -> TrainState:
    """The checkpoint's state, once every file it needs is there: DCP's ``.metadata``, the
    storage files it lists (at their full length), and hybridrec's state. Checked before
    loading, so a damaged checkpoint is named (``CheckpointError``) instead of failing in DCP."""
    metadata = os.path.join(path, ".metadata")
    if not os.path.isfile(metadata):
        raise CheckpointError(f"{path} is not a complete checkpoint ({metadata} is missing: an interrupted "
                              f"save, or not a checkpoint directory)")
    state = TrainState.from_files(path)
    if not os.path.isfile(os.path.join(path, CONFIG_YAML)):
        raise CheckpointError(f"{path} is damaged: {os.path.join(path, CONFIG_YAML)} is missing")
    try:
        storage = dcp.FileSystemReader(path).read_metadata().storage_data
    except Exception as e:  # a truncated or foreign file: its error names no file
        raise CheckpointError(f"{metadata} is unreadable ({type(e).__name__}: {_one_line(e)})") from e
    ends: dict[str, int] = {}
    for info in storage.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CheckpointError(f"{path} is damaged: {file} is missing (its .metadata lists it)")
        if os.path.getsize(file) < end:
            raise CheckpointError(f"{path} is damaged: {file} is truncated ({os.path.getsize(file):,} of "
                                  f"{end:,} bytes)")
    return state


def check_checkpoint(path: str) -> TrainState:
    """A checkpoint that a model is read from (``hybridrec.evaluate``, ``hybridrec.export``):
    a committed, complete ``step_<N>`` directory with its ``config.yaml``. Each refusal
    (``CheckpointError``) names the path and what to give instead."""
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint={path}: no such directory")
    if os.path.basename(os.path.normpath(path)).endswith(".partial"):
        raise CheckpointError(
            f"checkpoint={path} is not a committed checkpoint: a save that never finished (training "
            f"renames step_<N>.partial to step_<N> once every rank has written); give a step_<N> directory"
        )
    if not os.path.isfile(os.path.join(path, ".metadata")) and committed(path):
        try:
            newest = latest(path)
        except CheckpointError:  # every one damaged: no suggestion
            newest = None
        raise CheckpointError(
            f"checkpoint={path} is a checkpoint.dir, not one checkpoint: give one of its step_<N> directories"
            + (f", e.g. checkpoint={newest} (the newest loadable)" if newest else "")
        )
    state = check_complete(path)
    if not os.path.isfile(os.path.join(path, "config.yaml")):
        raise CheckpointError(f"{path} is not a complete checkpoint (no config.yaml)")
    return state


def check_fits(state: TrainState, features: list[Any], num_dense_features: int, path: str) -> None:
    """The data's features are those the checkpoint's tables were trained for: same names,
    order and sizes, same number of dense features. Checked before launch: the tables
    would not load otherwise (or, worse, ids would mean other rows)."""
    saved = [(f["name"], f["num_embeddings"]) for f in state.features]
    given = [(f.name, f.num_embeddings) for f in features]
    if saved != given:
        diff = next((i for i, (a, b) in enumerate(zip(saved, given)) if a != b), min(len(saved), len(given)))
        what = lambda fs: f"{fs[diff][0]} ({fs[diff][1]:,} rows)" if diff < len(fs) else "nothing"
        raise CheckpointError(
            f"the data's sparse feature {diff} is {what(given)} but {path} was trained with {what(saved)} "
            f"({len(given)} features against {len(saved)}): give data keys that keep the features of "
            f"{os.path.join(path, 'config.yaml')}"
        )
    if num_dense_features != state.num_dense_features:
        raise CheckpointError(f"the data has {num_dense_features} dense features but {path} was trained with "
                              f"{state.num_dense_features}")


def latest(directory: str, warn: bool = False) -> Optional[str]:
    """The newest loadable checkpoint in ``directory``, or None if there is none. Damaged newer
    ones are skipped (with a warning naming what is wrong when ``warn``); a directory whose
    every checkpoint is damaged is refused, rather than trained over from scratch."""
    skipped = []
    for _, path in reversed(committed(directory)):
        try:
            check_complete(path)
        except CheckpointError as e:
            skipped.append(str(e))
            continue
        if skipped and warn:
            log.warning(f"resuming from {path}, the newest loadable checkpoint, not from a newer one: "
                        f"{'; '.join(skipped)}")
        return path
    if skipped:
        raise CheckpointError(f"checkpoint.dir={directory} holds no loadable checkpoint ({skipped[0]}): "
                              f"repair or delete its step_* directories, or use another checkpoint.dir")
    return None


def resume_path(cfg: DictConfig, warn: bool = False) -> Optional[str]:
    """checkpoint.resume: auto (newest loadable, if any), never, or a checkpoint path, checked."""
    resume = cfg.checkpoint.resume
    if resume == "never" or not cfg.checkpoint.dir and resume == "auto":
        return None
    if resume == "auto":
        return latest(cfg.checkpoint.dir, warn)
    if not os.path.isdir(resume):
        raise CheckpointError(f"checkpoint.resume={resume}: no such checkpoint directory")
    check_complete(resume)
    return resume


def saved_config(path: str) -> DictConfig:
    """The resolved config a checkpoint was saved with (``config.yaml``, read with yaml's safe loader)."""
    file = os.path.join(path, CONFIG_YAML)
    try:
        cfg = OmegaConf.load(file)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is damaged: {file} is missing") from None
    except Exception as e:  # not YAML, or not a mapping
        raise CheckpointError(f"{file} is not a valid checkpoint file ({type(e).__name__}: {_one_line(e)})") from e
    if not isinstance(cfg, DictConfig) or not all(k in cfg for k in ("model", "loss", "optimizer")):
        raise CheckpointError(f"{file} is not a hybridrec config: it lacks model, loss or optimizer")
    return cfg


def _short(target: Any) -> str:
    return str(target).rsplit(".", 1)[-1]


def _names(names: list[str], shown: int = 3) -> str:
    return ", ".join(names[:shown]) + (f" +{len(names) - shown} more" if len(names) > shown else "")


def layout_differences(saved: DictConfig, saved_features: list[dict[str, Any]], saved_dense: int,
                       cfg: DictConfig, features: list[dict[str, Any]], dense: int) -> list[str]:
    """What differs, between a checkpoint and a run, in what decides the checkpoint's state
    dict (its keys, shapes and meaning): the model (class and every field that shapes its
    weights), the tables (one per sparse feature: names, rows; the width is
    model.embedding_dim), the dense features, the loss and the optimizers (their state is
    saved). One ``key: checkpoint X, run Y`` per difference. The mesh, the sharding and the
    world size are not in it: DCP reshards a checkpoint to any of them."""
    diffs = []
    model, run_model = saved.model, cfg.model
    if model.get("_target_") != run_model._target_:
        # Fields of another model class mean nothing side by side: the class is the difference.
        diffs.append(f"model._target_: checkpoint {_short(model.get('_target_'))}, run {_short(run_model._target_)}")
    else:
        free = getattr(OmegaConf.get_type(run_model), "free_on_resume", ())
        for key in run_model:
            if key == "_target_" or key in free:
                continue
            a, b = model.get(key), run_model[key]
            a, b = (OmegaConf.to_container(v) if OmegaConf.is_config(v) else v for v in (a, b))
            if a != b:
                diffs.append(f"model.{key}: checkpoint {a}, run {b}")
    rows = {f"t_{f['name']}": f["num_embeddings"] for f in saved_features}
    run_rows = {f"t_{f['name']}": f["num_embeddings"] for f in features}
    if rows.keys() != run_rows.keys():
        only_saved = [t for t in rows if t not in run_rows]
        only_run = [t for t in run_rows if t not in rows]
        diffs.append(f"tables: only in the checkpoint [{_names(only_saved)}], only in the run [{_names(only_run)}]")
    resized = [t for t in run_rows if t in rows and rows[t] != run_rows[t]]
    diffs += [f"{t} rows: checkpoint {rows[t]:,}, run {run_rows[t]:,}" for t in resized[:3]]
    if len(resized) > 3:
        diffs.append(f"{len(resized) - 3} more tables resized")
    if saved_dense != dense:
        diffs.append(f"dense features: checkpoint {saved_dense}, run {dense}")
    for key in ("loss._target_", "optimizer.sparse._target_", "optimizer.dense._target_"):
        a, b = OmegaConf.select(saved, key), OmegaConf.select(cfg, key)
        if a != b:
            diffs.append(f"{key}: checkpoint {_short(a)}, run {_short(b)}")
    return diffs


def check_compatible(cfg: DictConfig, path: str, state: TrainState, features: list[Any],
                     num_dense_features: int) -> None:
    """Refuse to resume ``path`` into a run whose model, tables, loss or optimizers differ:
    DCP would fail on the first missing key or shape, inside every rank (checked before
    launch by ``train.py`` and again by ``load``). Raises one ``CheckpointError`` naming
    every difference and the fix."""
    diffs = layout_differences(saved_config(path), state.features, state.num_dense_features,
                               cfg, [vars(f) for f in features], num_dense_features)
    if not diffs:
        return
    if cfg.checkpoint.resume == "auto":
        fix = (f"train this config in another checkpoint.dir, or resume with the config it was saved with "
               f"({os.path.join(path, CONFIG_YAML)})")
    else:
        fix = (f"resume a checkpoint of this model, or train from scratch with checkpoint.resume=never "
               f"(its config: {os.path.join(path, CONFIG_YAML)})")
    raise CheckpointError(f"checkpoint {path} does not fit this run ({'; '.join(diffs)}): {fix}")


def _writer(path: str) -> Optional[str]:
    """The id of the run that wrote the checkpoint at ``path`` (None: unknown or unreadable)."""
    try:
        with open(os.path.join(path, STATE_JSON)) as f:
            runs = json.load(f).get("runs") or [None]
        return runs[-1]
    except (OSError, ValueError, AttributeError):
        return None


def check_dir(cfg: DictConfig, resume: Optional[str], state: Optional[TrainState]) -> None:
    """Refuse, before launch, a ``checkpoint.dir`` holding checkpoints that this run does not
    continue: its saves would mix with them (and replace any of the same step). With
    ``resume=auto`` the newest one is continued, so the directory is this run's."""
    ck = cfg.checkpoint
    if not ck.dir or ck.resume == "auto":
        return
    ours = set(state.runs) if state else set()
    foreign = [(step, path) for step, path in committed(ck.dir)
               if os.path.realpath(path) != os.path.realpath(resume or "") and (not ours or _writer(path) not in ours)]
    if not foreign:
        return
    step, path = foreign[-1]
    why = ("checkpoint.resume=never" if resume is None
           else f"checkpoint.resume={resume} continues another run")
    raise CheckpointError(
        f"checkpoint.dir={ck.dir} holds checkpoints of another run (newest: {os.path.basename(path)}, step {step}) "
        f"and {why}: use another checkpoint.dir, checkpoint.resume=auto to continue the run in it, or delete "
        f"its step_* directories yourself"
    )


def _one_line(e: BaseException) -> str:
    """The first line of an exception's message: what goes into a one-line error."""
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def _root_cause(e: BaseException) -> BaseException:
    """What went wrong under DCP's wrapper: a ``CheckpointException`` holds each failed rank's
    exception (lowest rank first here), and an exception may be chained to its cause."""
    while True:
        if isinstance(e, CheckpointException) and e.failures:
            e = e.failures[min(e.failures)][0]
        elif isinstance(e, OSError) or (e.__cause__ or e.__context__) is None:
            return e
        else:
            e = e.__cause__ or e.__context__


@dataclass
class Resumable:
    """What a checkpoint saves from one rank and a resume restores into it, named explicitly:
    the checkpoint code sees nothing else of the trainer."""

    model: nn.Module
    optimizer: TrainOptimizer
    """Its combined sparse + dense optimizer and the LR schedulers."""
    features: list[SparseFeature]
    """The sparse features: export rebuilds the model from them, without the data files."""
    num_dense_features: int
    losses: list[float]
    """The global mean loss of every step so far (the trainer appends; a resume refills it)."""
    runs: list[str]
    """This run's id after the ids of the runs it continues: what keep_last may delete."""

    def dcp_state(self) -> dict[str, Any]:
        """What DCP saves and loads in place: the sharded model and optimizer state."""
        return {"model": self.model.state_dict(), "optim": self.optimizer.optimizer.state_dict()}

    def train_state(self, step: int) -> TrainState:
        """The rest, after ``step`` (collective: gathers every rank's RNG state)."""
        rng = [None] * dist.get_world_size()
        dist.all_gather_object(rng, torch.get_rng_state())
        return TrainState(
            step=step,
            schedulers=copy.deepcopy([s.state_dict() for s in self.optimizer.schedulers]),
            features=[vars(f) for f in self.features],
            num_dense_features=self.num_dense_features,
            rng=torch.stack(rng),
            losses=torch.tensor(self.losses, dtype=torch.float64),
            runs=list(self.runs),
        )


class Checkpointer:
    """Saves the trainer's state every ``checkpoint.every_n_steps`` and at the end.

    With ``checkpoint.async_save``, DCP first copies the state into CPU staging memory and
    writes it from a background thread while training goes on; the checkpoint is committed
    (renamed from ``.partial``) once that write has finished, at the next save or at the
    end. Its background collectives run on a gloo group of their own, so they never
    interleave with the training's collectives.
    """

    def __init__(self, cfg: DictConfig, live: Resumable, device: torch.device,
                 resumed_from: Optional[str] = None) -> None:
        self.run_cfg, self.cfg, self.live = cfg, cfg.checkpoint, live
        self.rank = dist.get_rank()
        self.group = dist.new_group(backend="gloo") if self.cfg.async_save else None
        self.writer = None
        if self.cfg.async_save:
            # A new thread starts on cuda:0: the writer is put on this rank's GPU before DCP
            # touches any device state (its planning runs on the group's device).
            self.writer = ThreadPoolExecutor(
                max_workers=1, initializer=_use_device, initargs=(device,), thread_name_prefix="hybridrec-ckpt"
            )
        self.pending: Optional[tuple] = None
        self.last: Optional[str] = resumed_from  # the newest checkpoint of this run's training

    def save(self, step: int) -> None:
        """Save the state after ``step`` (collective)."""
        self.wait()  # one save in flight at a time
        final = os.path.join(self.cfg.dir, f"step_{step:08d}")
        partial = final + ".partial"
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            os.makedirs(partial)
        dist.barrier()
        extra = self.live.train_state(step)  # captured now, written at commit
        try:
            if self.cfg.async_save:
                # DCP's async_save cannot stage TorchRec's ShardedTensors (no data_ptr), so
                # copy the state here and run DCP's save on the copy in a background thread:
                # what async_save does, with a stager that knows ShardedTensors.
                staged = _stage(self.live.dcp_state())
                future = self.writer.submit(dcp.save, staged, checkpoint_id=partial, process_group=self.group)
                self.pending = (future, step, partial, final, extra)
                return
            dcp.save(self.live.dcp_state(), checkpoint_id=partial)
        # DCP wraps every rank's failure in a CheckpointException (a BaseException), on every rank
        except (CheckpointException, OSError) as e:
            self._abandon(step, partial, e)
        self._commit(step, partial, final, extra)

    def wait(self) -> None:
        """Finish and commit an async save in flight, if any."""
        if self.pending is None:
            return
        future, step, partial, final, extra = self.pending
        self.pending = None
        try:
            future.result()
        except (CheckpointException, OSError) as e:
            self._abandon(step, partial, e)
        self._commit(step, partial, final, extra)

    def _abandon(self, step: int, partial: str, error: BaseException) -> NoReturn:
        """A save that failed: remove what it wrote and, when the cause is the storage (disk
        full, permissions, I/O), say why in one line. Nothing else was touched, so the previous
        checkpoint stays loadable. Any other cause is a bug: its traceback is kept."""
        cause = _root_cause(error)
        try:
            free = shutil.disk_usage(self.cfg.dir).free
        except OSError:
            free = None
        full = getattr(cause, "errno", None) == errno.ENOSPC or free == 0
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        # torch's zip writer reports a short write (a full disk) as "unexpected pos", not OSError
        if not (isinstance(cause, OSError) or full or "unexpected pos" in str(cause)):
            raise error
        previous = self.last
        raise CheckpointError(
            f"checkpoint save at step {step} failed{': no space left on device' if full else ''} "
            f"({type(cause).__name__}: {_one_line(cause)}; {'?' if free is None else f'{free:,}'} bytes free "
            f"in checkpoint.dir={self.cfg.dir}); removed the partial save {partial}; "
            + (f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint of this run")
            + ". Free space there or point checkpoint.dir elsewhere"
        ) from error

    def _commit(self, step: int, partial: str, final: str, extra: TrainState) -> None:
        runs = self.live.runs
        dist.barrier()  # every rank's files are written
        if self.rank == 0:
            if os.path.isdir(final) and _writer(final) not in runs:
                shutil.rmtree(partial, ignore_errors=True)
                raise CheckpointError(f"{final} was written by another run: not replaced (saving step {step}); "
                                      f"use another checkpoint.dir")
            try:
                extra.to_files(partial)
                OmegaConf.save(self.run_cfg, os.path.join(partial, CONFIG_YAML), resolve=True)
            except OSError as e:
                self._abandon(step, partial, e)
            shutil.rmtree(final, ignore_errors=True)  # a re-run of the same step (this run's) replaces it
            os.replace(partial, final)  # the commit: atomic on one filesystem
            _prune(self.cfg.dir, self.cfg.keep_last, runs)
        self.last = final
        dist.barrier()
        log.info(f"checkpoint committed: {final}")


def _use_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)


def _stage(state: Any) -> Any:
    """A CPU copy of a state dict that training can no longer change, for the background
    writer. CUDA tensors are copied into pinned host memory without blocking, then the
    copies are awaited once; a copy on the GPU would double the tables' and optimizer's
    device memory at every save."""
    staged = _to_host(state)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()  # every non-blocking device-to-host copy has landed
    return staged


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    pinned = t.is_cuda  # pinned memory exists only with CUDA (and makes the copy asynchronous)
    out = torch.empty_like(t, device="cpu", pin_memory=pinned)
    return out.copy_(t.detach(), non_blocking=pinned)


def _to_host(obj: Any) -> Any:
    if isinstance(obj, ShardedTensor):
        # TorchRec's table shards: ShardedTensor.to rewrites the shards' placements to CPU
        # (metadata a hand-made copy would have to patch), copying even on CPU (copy=True).
        # Pageable, not pinned: pinned shards would also need the metadata's pin_memory flag.
        return obj.to(device="cpu", copy=True)
    if isinstance(obj, DTensor):  # FSDP2's parameters and states: copy the local shard, keep the layout
        return DTensor.from_local(_host_copy(obj.to_local()), obj.device_mesh, obj.placements,
                                  run_check=False, shape=obj.shape, stride=obj.stride())
    if isinstance(obj, torch.Tensor):
        return _host_copy(obj)
    if isinstance(obj, dict):
        return {k: _to_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_host(v) for v in obj)
    return copy.deepcopy(obj)


def _prune(directory: str, keep: int, runs: list[str]) -> None:
    """Delete all but the newest ``keep`` checkpoints written by ``runs`` (this run and the runs
    it continues): never one another run wrote, nor one whose writer is unknown."""
    ours = [path for _, path in committed(directory) if _writer(path) in runs]
    for path in ours[: max(0, len(ours) - keep)]:
        shutil.rmtree(path, ignore_errors=True)


def load(cfg: DictConfig, path: str, live: Resumable) -> TrainState:
    """Restore a checkpoint (of any world size or plan) into ``live``, the state of a run of
    ``cfg``: model, optimizer, LR schedulers, this rank's RNG, the loss history and the runs
    it continues. Returns the saved state (its ``step`` is where training goes on)."""
    extra = TrainState.from_files(path)  # first: a refused checkpoint loads nothing
    # train.py checked this before launch; ranks started otherwise (tests, benchmarks) check here
    check_compatible(cfg, path, extra, live.features, live.num_dense_features)
    # The dense optimizers create their state lazily: create it now so DCP can load into it.
    for name, opt in live.optimizer.optimizer.optimizers:
        if name != "sparse":
            opt.init_state()
    state = live.dcp_state()
    _dcp_load(state, path, "resume with the model and data config it was saved with ({path}/config.yaml), or start "
                           "a new run in another checkpoint.dir")
    live.model.load_state_dict(state["model"])
    live.optimizer.optimizer.load_state_dict(state["optim"])
    for scheduler, saved in zip(live.optimizer.schedulers, extra.schedulers):
        scheduler.load_state_dict(saved)
    rng, rank = extra.rng, dist.get_rank()
    torch.set_rng_state((rng[rank] if len(rng) == dist.get_world_size() else rng[0]).clone())
    live.losses[:] = extra.losses.tolist()
    live.runs[:] = extra.runs + live.runs[-1:]  # this run continues those: their checkpoints are its own
    return extra


def load_weights(model: Any, path: str) -> int:
    """Load only the model's weights of the checkpoint at ``path`` into ``model`` (sharded by
    any plan, on any world size: DCP reads the parts each rank holds); returns its step.
    The optimizer state stays on disk: scoring a saved model needs none of it."""
    step = TrainState.from_files(path).step  # first: a refused checkpoint loads nothing
    state = {"model": model.state_dict()}
    _dcp_load(state, path, "evaluate it with the data it was trained on: give only data keys that keep the "
                           "features and their sizes ({path}/config.yaml)")
    model.load_state_dict(state["model"])
    return step


def _dcp_load(state: dict[str, Any], path: str, fix: str) -> None:
    try:
        dcp.load(state, checkpoint_id=path)
    except CheckpointException as e:
        # A difference check_compatible does not know of (the files themselves and the model,
        # table and optimizer layout were checked before launch).
        cause = _root_cause(e)
        raise CheckpointError(
            f"{path} does not fit this run's model ({type(cause).__name__}: {_one_line(cause)}): "
            + fix.format(path=path)
        ) from e
