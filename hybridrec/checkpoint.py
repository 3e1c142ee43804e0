"""Distributed checkpoints with torch.distributed.checkpoint (DCP), and the unsharded export.

A checkpoint is a directory ``<checkpoint.dir>/step_<N>`` holding DCP's files for the model
(TorchRec's sharded tables as ShardedTensors, FSDP2 parameters as DTensors) and the
optimizers (fused sparse state, dense state), plus hybridrec's own state (``TrainState``:
step = data position, learning-rate schedules, RNG states, losses, feature list) and
``config.yaml``. DCP stores every tensor by its global offsets, so a checkpoint loads under
another world size or sharding plan (resharding).

Opening a checkpoint never runs code from it:

- ``trainer_state.json`` is JSON and ``trainer_state.pt`` holds plain tensors, read with
  ``torch.load(weights_only=True)``;
- ``config.yaml`` is read with yaml's safe loader (a Python tag is refused), and every
  ``_target_`` in it must be a class hybridrec ships for that node, one of the loading
  run's own, or one the user trusts explicitly (``checkpoint.trusted_targets``), before
  anything is instantiated from it (``saved_config``);
- DCP's ``.metadata`` is a pickle, which DCP itself unpickles without restriction: hybridrec
  reads it with an unpickler that admits only the classes DCP's metadata is made of
  (``SafeReader``), and the non-tensor values of the state with ``weights_only=True``
  (``SafeLoadPlanner``). Anything else is refused in one line naming the file and the global.

Integrity: at commit, ``trainer_state.json`` records the BLAKE3 hash of every other file of the
checkpoint (each rank hashes the files it wrote) and of its own fields; loading verifies
them first, so a flipped byte is a damaged checkpoint, never a model that silently scores NaN.

Atomic commit: a save writes ``step_<N>.partial`` and rank 0 renames it to ``step_<N>`` once
every rank has written and the state is known sane: its weights finite, and the loss of the
next step finite (the final checkpoint: the scores of the final evaluation). A diverged
state is therefore never committed, and the newest committed checkpoint always resumes.
A crash mid-save leaves only a ``.partial`` directory, which resume never picks and a save
of the same step replaces; a save that fails (disk full, read-only, permissions) removes
its own ``.partial`` and says why in one line.

One run per directory: a run holds an OS lock on ``checkpoint.dir`` (``DirLock``) for its
lifetime; a second run is refused before launch. The kernel drops the lock when the
process dies, so ``kill -9`` leaves nothing stale.

Ownership: every checkpoint records the runs it descends from (``TrainState.runs``, a
random id per run, inherited on resume). ``keep_last`` prunes only checkpoints written by
this run or by the runs it continues, so a directory shared by mistake never loses another
run's checkpoints; ``train.py`` refuses such a directory before launch anyway.
"""

from __future__ import annotations

import copy
import errno
import fcntl
import glob
import io
import json
import logging
import os
import pickle
import re
import shutil
import socket
import time
import uuid
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, NoReturn, Optional

from concurrent.futures import Future, ThreadPoolExecutor

import blake3
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.tensor import DTensor
import yaml
from omegaconf import DictConfig, OmegaConf
from torch import nn

from hybridrec.compat import ShardedTensor, set_element
from hybridrec.config import TARGET_GROUPS, shipped_targets, typed
from hybridrec.data import SparseFeature
from hybridrec.objective import Selection
from hybridrec.optim import TrainOptimizer

log = logging.getLogger(__name__)
_STEP_DIR = re.compile(r"step_(\d+)$")
STATE_JSON, STATE_TENSORS = "trainer_state.json", "trainer_state.pt"
CONFIG_YAML = "config.yaml"  # the run's resolved config: what check_compatible compares
METADATA = ".metadata"  # DCP's index of the checkpoint's tensors (a pickle)
LOCK = ".lock"  # in checkpoint.dir: held by the run writing there


class CheckpointError(ValueError):
    """A checkpoint hybridrec refuses to load: state files holding pickled objects, a format
    written by an older hybridrec, or files missing."""


class UnsafeCheckpoint(CheckpointError):
    """A checkpoint file that opening would make run code: refused before anything in it ran."""


class Diverged(ValueError):
    """Training state that must not be committed: a non-finite loss, weights or scores."""


# What DCP's .metadata is made of (torch 2.13): its dataclasses, torch.Size, dtypes, layouts
# and paths. pickle's own way to restrict an unpickler is find_class; torch's weights_only
# unpickler admits tensors, not these classes, and DCP's reader offers no safe mode.
_METADATA_GLOBALS = {
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, path: str) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                     torch.dtype)):
            return super().find_class(module, name)
        raise UnsafeCheckpoint(
            f"{self.path} is not safe to open: it would call {module}.{name}, which is not part of DCP's "
            f"metadata (a pickle planted in the checkpoint); refused, nothing in it was run. Use checkpoints "
            f"only from a source you trust, or re-create this one by training"
        )


def read_metadata(path: str) -> dcp_metadata.Metadata:
    """DCP's ``.metadata`` of the checkpoint at ``path``, unpickled with only the classes
    metadata is made of (``UnsafeCheckpoint`` otherwise)."""
    file = os.path.join(path, METADATA)
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f, file).load()
    except UnsafeCheckpoint:
        raise
    except Exception as e:  # truncated, or not a pickle: pickle's own message names no file
        raise CheckpointError(f"{file} is unreadable ({type(e).__name__}: {_one_line(e)})") from e
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CheckpointError(f"{file} is not DCP metadata (a {type(metadata).__name__})")
    return metadata


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader, with ``read_metadata`` as above: every ``dcp.load`` in hybridrec
    goes through it (tensors themselves DCP already reads with ``weights_only=True``)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        metadata = read_metadata(str(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # what FileSystemReader.read_metadata sets
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, except that the state's non-tensor values (optimizer settings,
    step counts) are read with ``torch.load(weights_only=True)``: DCP's own planner reads
    them with a full unpickle, which would run a pickle planted in a ``.distcp`` file."""

    def __init__(self, checkpoint_path: str) -> None:
        super().__init__()
        self.checkpoint_path = checkpoint_path

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeCheckpoint(
                f"{read_item.dest_index.fqn} in {self.checkpoint_path} is not safe to open (a pickled "
                f"object: {_refused_global(e)}); refused, nothing in it was run. Use checkpoints only from "
                f"a source you trust, or re-create this one by training"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def safe_load(state: dict[str, Any], path: str, no_dist: bool = False) -> None:
    """``dcp.load`` of ``path`` into ``state`` through the safe reader and planner."""
    dcp.load(state, storage_reader=SafeReader(path), planner=SafeLoadPlanner(path), no_dist=no_dist)


def unsafe(cause: BaseException, path: str) -> UnsafeCheckpoint:
    """What DCP's load raised under its wrapper when it met a pickled object: refused by the
    safe reader or planner, or by DCP's own ``weights_only=True`` read of a tensor."""
    if isinstance(cause, UnsafeCheckpoint):
        return cause
    return UnsafeCheckpoint(f"{path} is not safe to open: a .distcp file holds a pickled object where a tensor "
                            f"belongs ({_refused_global(cause)}); refused, nothing in it was run. Use checkpoints "
                            f"only from a source you trust, or re-create this one by training")


def _refused_global(e: BaseException) -> str:
    # torch's message is a paragraph; the line naming the refused global is what matters
    return next((line.strip().rstrip(".") for line in str(e).splitlines() if "nsupported" in line),
                _one_line(e))


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
    selection: dict[str, Any] = field(default_factory=dict)
    """``objective.Selection``: the best validation evaluation so far and the evaluations
    since (keep_best, early stopping). Empty in checkpoints written before the field existed."""
    files: dict[str, str] = field(default_factory=dict)
    """BLAKE3 of every other file of the checkpoint, by name: DCP's files (hashed by the rank
    that wrote them), trainer_state.pt and config.yaml. Empty in checkpoints written before
    the field existed: those load unverified, with a warning."""

    def to_files(self, directory: str) -> None:
        """Write the state into ``directory``, where DCP's files (hashed in ``files``) and
        ``config.yaml`` already are; ``trainer_state.pt`` and ``config.yaml`` are hashed here."""
        torch.save({"rng": self.rng, "losses": self.losses}, os.path.join(directory, STATE_TENSORS))
        self.files.update(hash_files(directory, [STATE_TENSORS, CONFIG_YAML]))
        fields = {"step": self.step, "schedulers": self.schedulers, "features": self.features,
                  "num_dense_features": self.num_dense_features, "runs": self.runs, "selection": self.selection,
                  "files": dict(sorted(self.files.items()))}
        fields["state_blake3"] = _fields_digest(fields)  # the file's own check: it cannot hash itself
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
        if isinstance(fields, dict) and "state_blake3" in fields:
            digest = fields.pop("state_blake3")
            if digest != _fields_digest(fields):
                raise CheckpointError(f"{directory} is damaged: {json_path} does not match the checksum of its "
                                      f"fields recorded when it was saved")
        tensors = _load_tensors(tensors_path)
        if (not isinstance(fields, dict) or {"step", "schedulers", "features", "num_dense_features"} - fields.keys()
                or not all(isinstance(tensors.get(k), torch.Tensor) for k in ("rng", "losses"))
                or not isinstance(fields.get("files", {}), dict)):
            raise CheckpointError(f"{directory} is not a valid hybridrec checkpoint: its state lacks fields it needs")
        return cls(step=int(fields["step"]), schedulers=fields["schedulers"], features=fields["features"],
                   num_dense_features=int(fields["num_dense_features"]), rng=tensors["rng"], losses=tensors["losses"],
                   runs=[str(r) for r in fields.get("runs", [])], selection=dict(fields.get("selection") or {}),
                   files=dict(fields.get("files", {})))


def _fields_digest(fields: dict[str, Any]) -> str:
    return blake3.blake3(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def hash_files(directory: str, names: list[str]) -> dict[str, str]:
    """BLAKE3 of each named file of ``directory``. BLAKE3, not SHA-256: the same 256-bit
    strength at 4-5x the speed on one core, and it hashes one large file on several threads
    (here the rank's own share of the cores), so checking costs a fraction of writing."""
    threads = max(1, torch.get_num_threads())
    return {name: blake3.blake3(max_threads=threads).update_mmap(os.path.join(directory, name)).hexdigest()
            for name in names}


def own_files(directory: str, rank: int) -> list[str]:
    """The DCP files rank ``rank`` wrote (FileSystemWriter names them ``__<rank>_<i>.distcp``;
    rank 0 also writes ``.metadata``). The commit checks that these cover every file."""
    names = sorted(n for n in os.listdir(directory) if n.startswith(f"__{rank}_") and n.endswith(".distcp"))
    return names + ([METADATA] if rank == 0 else [])


def verify(path: str, state: TrainState, dcp_files: list[str]) -> None:
    """Every file of the checkpoint matches the BLAKE3 hash recorded at its commit (a
    ``CheckpointError`` names the first that does not). ``dcp_files``: the files its
    ``.metadata`` lists, each of which must have a recorded checksum."""
    if not state.files:
        log.warning(f"{path} records no checksums (written by an older hybridrec): loaded without verifying "
                    f"its content")
        return
    names = sorted({*dcp_files, METADATA, STATE_TENSORS, CONFIG_YAML})
    if unlisted := [n for n in names if n not in state.files]:
        raise CheckpointError(f"{path} is damaged: no checksum recorded for {unlisted[0]}")
    for name, digest in hash_files(path, names).items():
        if digest != state.files[name]:
            raise CheckpointError(
                f"{path} is damaged: {os.path.join(path, name)} does not match the checksum recorded when it was "
                f"saved (a changed byte, or a partial overwrite)"
            )


def _load_tensors(path: str) -> dict[str, Any]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns about a pickle protocol before refusing it
            tensors = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpoint(
            f"{path} is not a safe checkpoint file (it holds pickled objects, which loading would execute): "
            f"{_refused_global(e)}; refused, nothing in it was run"
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


def check_complete(path: str, verify_content: bool = True) -> TrainState:
    """The checkpoint's state, once every file it needs is there: DCP's ``.metadata``, the
    storage files it lists (at their full length), hybridrec's state and config, and, with
    ``verify_content``, each file's content as recorded at commit (``verify``). Checked
    before loading, so a damaged checkpoint is named (``CheckpointError``) instead of failing
    in DCP or loading NaNs."""
    metadata = os.path.join(path, METADATA)
    if not os.path.isfile(metadata):
        raise CheckpointError(f"{path} is not a complete checkpoint ({metadata} is missing: an interrupted "
                              f"save, or not a checkpoint directory)")
    state = TrainState.from_files(path)
    if not os.path.isfile(os.path.join(path, CONFIG_YAML)):
        raise CheckpointError(f"{path} is damaged: {os.path.join(path, CONFIG_YAML)} is missing")
    ends: dict[str, int] = {}
    for info in read_metadata(path).storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CheckpointError(f"{path} is damaged: {file} is missing (its .metadata lists it)")
        if os.path.getsize(file) < end:
            raise CheckpointError(f"{path} is damaged: {file} is truncated ({os.path.getsize(file):,} of "
                                  f"{end:,} bytes)")
    if verify_content:
        verify(path, state, list(ends))
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
    if not os.path.isfile(os.path.join(path, METADATA)) and committed(path):
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


def _feature_layout(f: dict[str, Any]) -> tuple[str, int, str, str, bool]:
    """What of a sparse feature (``SparseFeature`` fields) the trained tables depend on: its
    name, rows, table, pooling and weighting. A checkpoint saved before features named
    their table, pooling and weighting has SparseFeature's defaults, which meant the same."""
    table = f.get("table")
    return (f["name"], f["num_embeddings"], table if table is not None else f"t_{f['name']}",
            f.get("pooling", "sum"), bool(f.get("weighted", False)))


def _feature_text(layout: tuple[str, int, str, str, bool]) -> str:
    """``name (rows[, table, pooling, weighted])``: the defaults unsaid."""
    name, rows, table, pooling, weighted = layout
    parts = [f"{rows:,} rows"]
    if table != f"t_{name}":
        parts.append(f"table {table}")
    if pooling != "sum":
        parts.append(f"{pooling} pooling")
    if weighted:
        parts.append("weighted")
    return f"{name} ({', '.join(parts)})"


def check_fits(state: TrainState, features: list[Any], num_dense_features: int, path: str) -> None:
    """The data's features are those the checkpoint's tables were trained for: same names,
    order, sizes, tables, pooling and weighting, same number of dense features. Checked
    before launch: the tables would not load otherwise (or, worse, ids would mean other
    rows, or be pooled otherwise than they were trained)."""
    saved = [_feature_layout(f) for f in state.features]
    given = [_feature_layout(vars(f)) for f in features]
    if saved != given:
        diff = next((i for i, (a, b) in enumerate(zip(saved, given)) if a != b), min(len(saved), len(given)))
        what = lambda fs: _feature_text(fs[diff]) if diff < len(fs) else "nothing"
        raise CheckpointError(
            f"the data's sparse feature {diff} is {what(given)} but {path} was trained with {what(saved)} "
            f"({len(given)} features against {len(saved)}): give data keys that keep the features of "
            f"{os.path.join(path, 'config.yaml')}"
        )
    if num_dense_features != state.num_dense_features:
        raise CheckpointError(f"the data has {num_dense_features} dense features but {path} was trained with "
                              f"{state.num_dense_features}")


def latest(directory: str, warn: bool = False, verify_content: bool = True) -> Optional[str]:
    """The newest loadable checkpoint in ``directory``, or None if there is none. Damaged newer
    ones are skipped (with a warning naming what is wrong when ``warn``); a directory whose
    every checkpoint is damaged is refused, rather than trained over from scratch.
    ``verify_content``: check the files' hashes too (``check_complete``)."""
    skipped = []
    for _, path in reversed(committed(directory)):
        try:
            check_complete(path, verify_content)
        except UnsafeCheckpoint:
            raise  # never skipped quietly: someone planted it
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


def resume_path(cfg: DictConfig, warn: bool = False, verify_content: bool = True) -> Optional[str]:
    """checkpoint.resume: auto (newest loadable, if any), never, or a checkpoint path, checked
    (with ``verify_content``, down to the files' hashes)."""
    resume = cfg.checkpoint.resume
    if resume == "never" or not cfg.checkpoint.dir and resume == "auto":
        return None
    if resume == "auto":
        return latest(cfg.checkpoint.dir, warn, verify_content)
    if not os.path.isdir(resume):
        raise CheckpointError(f"checkpoint.resume={resume}: no such checkpoint directory")
    check_complete(resume, verify_content)
    return resume


def saved_config(path: str, trusted: Iterable[str] = ()) -> DictConfig:
    """The config a checkpoint was saved with (``config.yaml``), checked safe and typed again
    by hybridrec's schemas (``config.typed``): the one way export, evaluate and resume read
    it. Read with yaml's safe loader; every ``_target_`` must be at a node that takes one
    (``TARGET_GROUPS``) and name a class hybridrec ships for it (``shipped_targets``) or one
    of ``trusted`` (the loading run's own classes and ``trusted_targets``, never the
    checkpoint's); no Hydra instantiation key and no interpolation. Raises
    ``UnsafeCheckpoint`` before anything is instantiated."""
    file = os.path.join(path, CONFIG_YAML)
    try:
        cfg = OmegaConf.load(file)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is damaged: {file} is missing") from None
    except yaml.constructor.ConstructorError as e:  # a tag such as !!python/object/apply: never constructed
        raise UnsafeCheckpoint(f"{file} is not safe to open: it holds the YAML tag {e.problem.split()[-1]} "
                               f"(a Python object); refused, nothing in it was run") from None
    except Exception as e:  # not YAML, or not a mapping
        raise CheckpointError(f"{file} is not a valid checkpoint file ({type(e).__name__}: {_one_line(e)})") from e
    if not isinstance(cfg, DictConfig) or not all(k in cfg for k in ("model", "loss", "optimizer")):
        raise CheckpointError(f"{file} is not a hybridrec config: it lacks model, loss or optimizer")
    _check_safe(OmegaConf.to_container(cfg, resolve=False), file, shipped_targets(), frozenset(trusted))
    try:
        return typed(cfg)
    except ValueError as e:
        raise CheckpointError(f"{file} does not fit this hybridrec's config schema: {e}") from None


# Keys Hydra's instantiate acts on besides _target_: none is ever saved by hybridrec.
_INSTANTIATE_KEYS = ("_args_", "_partial_", "_recursive_", "_convert_")


def _check_safe(node: Any, file: str, shipped: dict[str, frozenset[str]], trusted: frozenset[str],
                path: str = "") -> None:
    def refuse(what: str) -> NoReturn:
        raise UnsafeCheckpoint(f"{file} is not safe to open: {what}; refused, nothing in it was run")

    if isinstance(node, dict):
        for key, value in node.items():
            where = f"{path}.{key}" if path else str(key)
            if key == "_target_":
                if path not in TARGET_GROUPS:
                    refuse(f"{where}={value} asks to instantiate a class where hybridrec's config has none")
                if value not in shipped[path] and value not in trusted:
                    refuse(f"{where}={value} is not a class hybridrec ships for {path} nor one this run trusts "
                           f"(if it is your own, trust it explicitly: checkpoint.trusted_targets=[{value}] in "
                           f"training, trusted_targets=[{value}] for evaluate and export)")
            elif key in _INSTANTIATE_KEYS:
                refuse(f"{where} is a Hydra instantiation key, which hybridrec never saves")
            else:
                _check_safe(value, file, shipped, trusted, where)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _check_safe(value, file, shipped, trusted, f"{path}[{i}]")
    elif isinstance(node, str) and "${" in node:
        # a saved config is resolved: an interpolation would call a resolver at load time
        refuse(f"{path}={node!r} is an interpolation, which a saved (resolved) config never holds")


def run_targets(cfg: DictConfig) -> set[str]:
    """The classes a run's own config names (trusted: the user gave them) plus its
    ``checkpoint.trusted_targets``: what a checkpoint it resumes may name too."""
    own = {str(OmegaConf.select(cfg, f"{path}._target_")) for path in TARGET_GROUPS
           if OmegaConf.select(cfg, f"{path}._target_") is not None}
    return own | set(OmegaConf.select(cfg, "checkpoint.trusted_targets") or [])


def _short(target: Any) -> str:
    return str(target).rsplit(".", 1)[-1]


def _names(names: list[str], shown: int = 3) -> str:
    return ", ".join(names[:shown]) + (f" +{len(names) - shown} more" if len(names) > shown else "")


def layout_differences(saved: DictConfig, saved_features: list[dict[str, Any]], saved_dense: int,
                       cfg: DictConfig, features: list[dict[str, Any]], dense: int) -> list[str]:
    """What differs, between a checkpoint and a run, in what decides the checkpoint's state
    dict (its keys, shapes and meaning): the model (class and every field that shapes its
    weights), the tables (names, rows; the width is model.embedding_dim), how each sparse
    feature uses them (table, pooling, weighting), the dense features, the loss and the
    optimizers (their state is saved). One ``key: checkpoint X, run Y`` per difference. The
    mesh, the sharding and the world size are not in it: DCP reshards a checkpoint to any
    of them."""
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
            a, b = (OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v for v in (a, b))
            if a != b:
                diffs.append(f"model.{key}: checkpoint {a}, run {b}")
    saved_layout = [_feature_layout(f) for f in saved_features]
    run_layout = [_feature_layout(f) for f in features]
    rows = {table: n for _, n, table, _, _ in saved_layout}
    run_rows = {table: n for _, n, table, _, _ in run_layout}
    if rows.keys() != run_rows.keys():
        only_saved = [t for t in rows if t not in run_rows]
        only_run = [t for t in run_rows if t not in rows]
        diffs.append(f"tables: only in the checkpoint [{_names(only_saved)}], only in the run [{_names(only_run)}]")
    resized = [t for t in run_rows if t in rows and rows[t] != run_rows[t]]
    diffs += [f"{t} rows: checkpoint {rows[t]:,}, run {run_rows[t]:,}" for t in resized[:3]]
    if len(resized) > 3:
        diffs.append(f"{len(resized) - 3} more tables resized")
    # Same tables, fed otherwise: the weights load, and mean other things.
    saved_use = {name: (table, pooling, weighted) for name, _, table, pooling, weighted in saved_layout}
    changed = [(name, saved_use[name], use) for name, _, *use in run_layout
               if name in saved_use and saved_use[name] != tuple(use)]
    use_text = lambda u: f"table {u[0]}, {u[1]} pooling" + (", weighted" if u[2] else "")
    diffs += [f"feature {name}: checkpoint {use_text(a)}, run {use_text(b)}" for name, a, b in changed[:3]]
    if len(changed) > 3:
        diffs.append(f"{len(changed) - 3} more features fed otherwise")
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
    diffs = layout_differences(saved_config(path, run_targets(cfg)), state.features, state.num_dense_features,
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


def root_cause(e: BaseException) -> BaseException:
    """What went wrong under DCP's wrapper: a ``CheckpointException`` holds each failed rank's
    exception (lowest rank first here), and an exception may be chained to its cause."""
    while True:
        if isinstance(e, CheckpointException) and e.failures:
            e = e.failures[min(e.failures)][0]
        elif isinstance(e, (OSError, UnsafeCheckpoint)) or (e.__cause__ or e.__context__) is None:
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
    selection: Selection
    """The best validation evaluation so far (keep_best, early stopping)."""

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
            selection=self.selection.to_dict(),
        )


@dataclass
class _Pending:
    """A save written (or being written) to ``partial``, not yet committed."""

    step: int
    partial: str
    final: str
    state: TrainState
    write: Future
    """DCP's save, then this rank's checksums (``own_files``): done at once without async_save."""
    confirmed: bool = False
    """The loss of a later step (or the final evaluation) was finite: the state may be committed."""


class Checkpointer:
    """Saves the trainer's state every ``checkpoint.every_n_steps`` and at the end, and
    commits a save only once the state is known sane (the module docstring): ``save(N)``
    writes ``step_<N>.partial``; the trainer calls ``confirm(M)`` once the losses up to a
    step M > N are finite, or ``finish(ok)`` after the final evaluation; ``discard()`` drops
    a save of a run that diverged.

    With ``checkpoint.async_save``, DCP first copies the state into CPU staging memory and
    writes it from a background thread while training goes on; the checkpoint is committed
    once that write has finished and the save is confirmed, at the next save or at the end.
    Its background collectives run on a gloo group of their own, so they never interleave
    with the training's collectives.
    """

    def __init__(self, cfg: DictConfig, live: Resumable, device: torch.device,
                 resumed_from: Optional[str] = None) -> None:
        self.run_cfg, self.cfg, self.live, self.device = cfg, cfg.checkpoint, live, device
        self.rank = dist.get_rank()
        self.group = dist.new_group(backend="gloo") if self.cfg.async_save else None
        # A new thread starts on cuda:0: the writer is put on this rank's GPU before DCP
        # touches any device state (its planning runs on the group's device).
        self.writer = ThreadPoolExecutor(max_workers=1, initializer=_use_device, initargs=(device,),
                                         thread_name_prefix="hybridrec-ckpt")
        self.pending: Optional[_Pending] = None
        self.last: Optional[str] = resumed_from  # the newest committed checkpoint of this run's training
        # Checkpoints known loadable without hashing them again: those this process committed
        # or verified (keep_last counts only loadable ones).
        self.loadable: set[str] = {os.path.realpath(resumed_from)} if resumed_from else set()

    def path(self, step: int) -> str:
        """Where the checkpoint of ``step`` is committed."""
        return os.path.join(self.cfg.dir, f"step_{step:08d}")

    def save(self, step: int) -> None:
        """Write the state after ``step`` (collective). Commits the previous save first, which
        must have been confirmed: the trainer checks the losses before every save."""
        self.commit()
        if not _all_finite(self.live.model.state_dict(), self.device):
            raise Diverged(f"non-finite weights after step {step}: the model diverged (a learning rate too high "
                           f"is the usual cause); {self.resume_hint()}")
        final = self.path(step)
        partial = final + ".partial"
        if self.rank == 0:
            try:
                shutil.rmtree(partial, ignore_errors=True)
                os.makedirs(partial)
            except OSError as e:
                self._abandon(step, partial, e)
        dist.barrier()
        state = self.live.train_state(step)  # captured now, written at commit
        if self.cfg.async_save:
            # DCP's async_save cannot stage TorchRec's ShardedTensors (no data_ptr), so
            # copy the state here and run DCP's save on the copy in a background thread:
            # what async_save does, with a stager that knows ShardedTensors.
            write = self.writer.submit(_write, _stage(self.live.dcp_state()), partial, self.rank, self.group)
        else:
            write = Future()
            try:
                write.set_result(_write(self.live.dcp_state(), partial, self.rank, None))
            # DCP wraps every rank's failure in a CheckpointException (a BaseException), on every rank
            except (CheckpointException, OSError) as e:
                self._abandon(step, partial, e)
        self.pending = _Pending(step, partial, final, state, write)

    def confirm(self, step: int, losses: list[float]) -> None:
        """``losses`` (the global loss of every step so far) are checked finite up to ``step``:
        a save of an earlier step is committed (now without async_save; with it, at the next
        save or at the end) if the loss of the step after it did not explode
        (``checkpoint.max_loss_ratio``), else dropped with a warning."""
        if not self.pending or self.pending.step >= step:
            return
        after, before = losses[self.pending.step], sorted(losses[: self.pending.step])
        median = before[len(before) // 2]
        ratio = self.cfg.max_loss_ratio
        if ratio and median > 0 and after > ratio * median:  # (a loss that can be negative is not compared)
            if self.rank == 0:
                log.warning(f"checkpoint {self.pending.final} not committed: the loss of the step after it, "
                            f"{after:.4g}, is over checkpoint.max_loss_ratio={ratio:g} x the run's median loss "
                            f"{median:.4g} (the model is diverging)")
            self.discard()
            return
        self.pending.confirmed = True
        if not self.cfg.async_save:
            self.commit()

    def finish(self, ok: bool) -> None:
        """The end of training: commit the last save if ``ok`` (the final evaluation's scores
        were finite), else drop it."""
        if self.pending and ok:
            self.pending.confirmed = True
            self.commit()
        self.discard()
        self.writer.shutdown()

    def discard(self) -> None:
        """Drop a save that will not be committed (the training diverged after it)."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        pending.write.exception()  # wait for the write: its files are removed next
        if self.rank == 0:
            shutil.rmtree(pending.partial, ignore_errors=True)
        if self.live.selection.best_checkpoint == pending.final:
            self.live.selection.best_checkpoint = None  # the best model's save was dropped
            if self.rank == 0:
                log.warning(f"the best validation evaluation (step {pending.step}) has no checkpoint: its save was "
                            f"not committed")

    def resume_hint(self) -> str:
        """Where a diverged run can go on from, for its one-line error."""
        if self.last:
            return (f"the newest committed checkpoint, {self.last}, was followed by a finite loss: resume from it "
                    f"with a lower learning rate (checkpoint.resume=auto)")
        return "no checkpoint of this run was committed"

    def commit(self) -> None:
        """Commit the pending save, if any (collective): after its write and its confirmation."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        assert pending.confirmed, f"step {pending.step}'s save was not confirmed before the next save"
        step, partial, final, state = pending.step, pending.partial, pending.final, pending.state
        try:
            hashes = pending.write.result()
        except (CheckpointException, OSError) as e:
            self._abandon(step, partial, e)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, hashes)  # every rank's files are written, and their checksums here
        if self.rank == 0:
            if os.path.isdir(final) and _writer(final) not in self.live.runs:
                shutil.rmtree(partial, ignore_errors=True)
                raise CheckpointError(f"{final} was written by another run: not replaced (saving step {step}); "
                                      f"use another checkpoint.dir")
            for part in every:
                state.files.update(part)
            try:
                if unhashed := sorted(set(os.listdir(partial)) - set(state.files)):
                    # DCP named a file otherwise than own_files expects: a torch upgrade, not a user error
                    raise RuntimeError(f"{partial}: no rank hashed {unhashed[0]}: update checkpoint.own_files")
                OmegaConf.save(self.run_cfg, os.path.join(partial, CONFIG_YAML), resolve=True)
                state.to_files(partial)
                _fsync_dir(partial)
                shutil.rmtree(final, ignore_errors=True)  # a re-run of the same step (this run's) replaces it
                os.replace(partial, final)  # the commit: atomic on one filesystem
                _fsync_dir(self.cfg.dir)
            except OSError as e:
                self._abandon(step, partial, e)
            self.loadable.add(os.path.realpath(final))
            self._prune()
        self.last = final
        dist.barrier()
        log.info(f"checkpoint committed: {final}")

    def _abandon(self, step: int, partial: str, error: BaseException) -> NoReturn:
        """A save that failed: remove what it wrote and, when the cause is the storage (disk
        full, read-only, permissions, I/O), say why in one line. Nothing else was touched, so
        the previous checkpoint stays loadable. Any other cause is a bug: its traceback is kept."""
        cause = root_cause(error)
        what, fix = _storage_problem(cause, self.cfg.dir)  # before the removal frees space and inodes
        free = _free(self.cfg.dir)
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        # torch's zip writer reports a short write (a full disk) as "unexpected pos", not OSError
        if not (isinstance(cause, OSError) or "unexpected pos" in str(cause)):
            raise error
        previous = self.last
        removed = (f"removed the partial save {partial}" if not os.path.exists(partial) else
                   f"left the partial save {partial} (resume never picks a .partial)")
        raise CheckpointError(
            f"checkpoint save at step {step} failed{': ' + what if what else ''} ({type(cause).__name__}: "
            f"{_one_line(cause)}; {free} in checkpoint.dir={self.cfg.dir}); {removed}; "
            + (f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint of this run")
            + f". {fix}"
        ) from error

    def _prune(self) -> None:
        """Delete all but the newest ``keep_last`` loadable checkpoints written by this run and
        the runs it continues: never one another run wrote, nor one whose writer is unknown.
        A damaged one is not counted and not deleted (resume skips it, with a warning), so the
        checkpoint a run fell back to survives until ``keep_last`` newer loadable ones exist."""
        ours = [path for _, path in committed(self.cfg.dir) if _writer(path) in self.live.runs]
        best = self.live.selection.best_checkpoint
        kept = 0
        for path in reversed(ours):
            if not self._is_loadable(path):
                continue
            kept += 1
            # checkpoint.keep_best: the best one is kept besides the keep_last newest
            if kept > self.cfg.keep_last and not (best and os.path.realpath(path) == os.path.realpath(best)):
                shutil.rmtree(path, ignore_errors=True)
                self.loadable.discard(os.path.realpath(path))

    def _is_loadable(self, path: str) -> bool:
        if os.path.realpath(path) in self.loadable:
            return True
        try:
            check_complete(path)
        except CheckpointError as e:
            log.warning(f"keep_last: {e}; not counted among the kept checkpoints, left in place")
            return False
        self.loadable.add(os.path.realpath(path))
        return True


def _write(state: dict[str, Any], partial: str, rank: int, group: Any) -> dict[str, str]:
    """DCP's save of this rank's part into ``partial``, then the checksums of its files."""
    dcp.save(state, checkpoint_id=partial, process_group=group)
    return hash_files(partial, own_files(partial, rank))


def _all_finite(state: dict[str, Any], device: torch.device) -> bool:
    """Every floating-point value this rank holds of ``state`` is finite, on every rank
    (collective): table shards, FSDP2 shards and replicated tensors alike."""
    ok = True
    for value in state.values():
        if isinstance(value, ShardedTensor):
            local = [shard.tensor for shard in value.local_shards()]
        elif isinstance(value, DTensor):
            local = [value.to_local()]
        elif isinstance(value, torch.Tensor):
            local = [value]
        else:
            continue
        ok = ok and all(not t.is_floating_point() or bool(torch.isfinite(t).all()) for t in local)
    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _storage_problem(cause: BaseException, directory: str) -> tuple[str, str]:
    """What the storage error ``cause`` means for a user, and the fix."""
    code = getattr(cause, "errno", None)
    try:
        stat = os.statvfs(directory)
        no_inodes, no_space = stat.f_files > 0 and stat.f_favail == 0, stat.f_bavail == 0
    except OSError:
        no_inodes = no_space = False
    if no_inodes and code in (errno.ENOSPC, None):
        return "no free inodes on the device", "Delete files there or point checkpoint.dir elsewhere"
    if code == errno.ENOSPC or no_space or "unexpected pos" in str(cause):
        return "no space left on device", "Free space there or point checkpoint.dir elsewhere"
    if code == errno.EDQUOT:
        return "disk quota exceeded", "Free space within the quota or point checkpoint.dir elsewhere"
    if code == errno.EROFS:
        return "read-only file system", "Remount it read-write or point checkpoint.dir elsewhere"
    if code in (errno.EACCES, errno.EPERM):
        return "permission denied", "Make checkpoint.dir writable by this user or point it elsewhere"
    return "", "Check the storage, or point checkpoint.dir elsewhere"


def _free(directory: str) -> str:
    try:
        return f"{shutil.disk_usage(directory).free:,} bytes free"
    except OSError:
        return "? bytes free"


def _fsync_dir(directory: str) -> None:
    """Make a rename or a new file in ``directory`` durable (a crash after the commit must
    not lose it)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DirLock:
    """One run per ``checkpoint.dir``: an exclusive ``flock(2)`` on ``<dir>/.lock`` for the
    run's lifetime, held by the process that launches the ranks. The kernel releases it when
    that process exits, however it exits (``kill -9`` included), so it is never stale. The
    file records who holds it, for the refusal message; it is never deleted (deleting a lock
    file races with a run opening it)."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, LOCK)
        self.fd: Optional[int] = None

    def acquire(self, about: str) -> None:
        """Take the lock or raise ``CheckpointError`` naming the run holding it. ``about``:
        where this run's outputs go, recorded for the next one."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 4096).decode(errors="replace").strip() or "a run that recorded nothing"
            os.close(fd)
            raise CheckpointError(
                f"checkpoint.dir={os.path.dirname(self.path)} is in use by another run ({holder}): wait for it to "
                f"end, or give this run another checkpoint.dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, started "
                     f"{time.strftime('%Y-%m-%d %H:%M:%S')}, outputs in {about}\n".encode())
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the lock
            self.fd = None


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
    vars(live.selection).update(vars(Selection.from_dict(extra.selection)))
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
        safe_load(state, path)
    except UnsafeCheckpoint:
        raise
    except CheckpointException as e:
        # A difference check_compatible does not know of (the files themselves and the model,
        # table and optimizer layout were checked before launch).
        cause = root_cause(e)
        if isinstance(cause, (UnsafeCheckpoint, pickle.UnpicklingError)):
            raise unsafe(cause, path) from None
        raise CheckpointError(
            f"{path} does not fit this run's model ({type(cause).__name__}: {_one_line(cause)}): "
            + fix.format(path=path)
        ) from e
