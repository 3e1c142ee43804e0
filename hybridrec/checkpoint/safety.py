"""Opening a checkpoint without running code from it: DCP's ``.metadata`` through an
unpickler that admits only what metadata is made of, the state's non-tensor values through
``torch.load(weights_only=True)``, and ``config.yaml`` through yaml's safe loader with every
``_target_`` checked against what hybridrec ships or the loading run trusts."""

from __future__ import annotations

import io
import os
import pickle
import warnings
from typing import Any, Iterable, NoReturn

import torch
import torch.distributed.checkpoint as dcp
import yaml
from omegaconf import DictConfig, OmegaConf
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from hybridrec.checkpoint.errors import CheckpointError, UnsafeCheckpoint, one_line
from hybridrec.compat import set_element
from hybridrec.config import TARGET_GROUPS, shipped_targets, typed

METADATA = ".metadata"  # DCP's index of the checkpoint's tensors (a pickle)
CONFIG_YAML = "config.yaml"  # the run's resolved config: what check_compatible compares


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
        raise CheckpointError(f"{file} is unreadable ({type(e).__name__}: {one_line(e)})") from e
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
                f"object: {refused_global(e)}); refused, nothing in it was run. Use checkpoints only from "
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
                            f"belongs ({refused_global(cause)}); refused, nothing in it was run. Use checkpoints "
                            f"only from a source you trust, or re-create this one by training")


def refused_global(e: BaseException) -> str:
    # torch's message is a paragraph; the line naming the refused global is what matters
    return next((line.strip().rstrip(".") for line in str(e).splitlines() if "nsupported" in line),
                one_line(e))


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
        raise CheckpointError(f"{file} is not a valid checkpoint file ({type(e).__name__}: {one_line(e)})") from e
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

