"""Opening a checkpoint without running code from it: DCP's ``.metadata`` through an
unpickler that admits only what metadata is made of, the state's non-tensor values through
``torch.load(weights_only=True)``, and ``config.yaml`` through yaml's safe loader with every
``_target_`` checked against what hybridrec ships or the loading run trusts."""

from __future__ import annotations

import importlib.util
import io
import os
import pickle
import pickletools
import re
import sys
import warnings
from typing import Any, Iterable, NoReturn

import torch
import torch.distributed.checkpoint as dcp
import yaml
from omegaconf import DictConfig, OmegaConf
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from hybridrec.base.compat import set_element
from hybridrec.checkpoint.errors import CheckpointError, UnsafeCheckpoint, one_line
from hybridrec.config import TARGET_GROUPS, renamed_targets, shipped_targets, typed

METADATA = ".metadata"  # DCP's index of the checkpoint's tensors (a pickle)
CONFIG_YAML = "config.yaml"  # the run's resolved config: what check_compatible compares


# What DCP's .metadata is made of (torch 2.11 to 2.13): its dataclasses, torch.Size, dtypes,
# layouts and paths. pickle's own way to restrict an unpickler is find_class; torch's
# weights_only unpickler admits tensors, not these classes, and DCP's reader offers no safe mode.
_METADATA_GLOBALS = {
    *(
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}
_TRUST_HINT = "Use checkpoints only from a source you trust, or re-create this one by training"


def inside(directory: str, name: str, what: str = "") -> str:
    """``directory/name``, refused (``CheckpointError`` naming the entry) unless it stays in
    ``directory``: ``name`` is one plain file name (no separator, not ``.`` or ``..``) and the
    path, symbolic links resolved, is in the directory's own resolved path. Every file of a
    checkpoint is opened through it, so a planted entry (``../../x.distcp``) or a planted
    link cannot make hybridrec read or write outside what the user named. ``what``: where
    the name came from, for the message."""
    where = f" ({what})" if what else ""
    if not name or name in (".", "..") or "/" in name or "\0" in name or os.sep in name:
        raise CheckpointError(
            f"{directory} is damaged or was edited: the entry {name!r}{where} is not a file name "
            f"in the checkpoint directory (it would reach outside it); refused, nothing was read"
        )
    path = os.path.join(directory, name)
    real, home = os.path.realpath(path), os.path.realpath(directory)
    if os.path.islink(path) and os.path.commonpath([real, home]) != home:
        raise CheckpointError(
            f"{path}{where} is a symbolic link to {real}, outside the checkpoint directory; "
            f"refused, nothing was read through it"
        )
    return path


def planted_or_damaged(module: str, name: str) -> str:
    """Whether a pickle's global ``module.name`` is something that exists and could be called
    (a payload someone planted) or a name nothing answers to (damage: a changed byte in a
    class name). Decided without importing anything: a module this process has not imported
    is looked up by its top-level spec only, which runs no code."""
    loaded = sys.modules.get(module)
    if loaded is not None:
        target: Any = loaded
        for part in name.split("."):
            target = getattr(target, part, None)
            if target is None:
                return "damaged"
        return "planted" if callable(target) else "damaged"
    try:
        found = importlib.util.find_spec(module.split(".")[0]) is not None
    except (ImportError, ValueError):
        found = False
    return "planted" if found else "damaged"


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, path: str) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        if planted_or_damaged(module, name) == "damaged":
            raise CheckpointError(
                f"{self.path} is damaged: it names {module}.{name}, which does not exist (a "
                f"changed byte); nothing in it was run"
            )
        raise UnsafeCheckpoint(
            f"{self.path} is not safe to open: it would call {module}.{name}, which is not part of DCP's "
            f"metadata (a pickle planted in the checkpoint); refused, nothing in it was run. {_TRUST_HINT}"
        )


def check_pickle_stream(data: bytes, file: str) -> None:
    """A pickle's opcodes parse from start to STOP, with nothing after (``pickletools``
    reads them without executing any); otherwise the file is damaged, and said so before
    any unpickler could call it something else."""
    end = -1
    try:
        for op, _arg, pos in pickletools.genops(data):
            assert pos is not None  # genops reads bytes through a BytesIO, which has a position
            end = pos
            if op.name == "STOP":
                break
        else:
            raise ValueError("no STOP opcode: the stream is cut short")
    except Exception as e:  # pickletools raises ValueError or others on a garbled opcode
        raise CheckpointError(
            f"{file} is damaged: not a valid pickle stream ({one_line(e)}); nothing in it was run"
        ) from None
    if end + 1 != len(data):
        raise CheckpointError(
            f"{file} is damaged: {len(data) - end - 1} bytes after the end of its pickle stream; nothing in it was run"
        )


def read_metadata(path: str) -> dcp_metadata.Metadata:
    """DCP's ``.metadata`` of the checkpoint at ``path``, unpickled with only the classes
    metadata is made of (``UnsafeCheckpoint`` for a parsable stream naming another callable,
    ``CheckpointError`` for a damaged one), and every storage file it names a plain file of
    the checkpoint directory (``inside``)."""
    file = inside(path, METADATA)
    try:
        with open(file, "rb") as f:
            data = f.read()
    except OSError as e:
        raise CheckpointError(f"{file} is unreadable ({one_line(e)})") from None
    check_pickle_stream(data, file)
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data), file).load()
    except CheckpointError:  # UnsafeCheckpoint included
        raise
    except Exception as e:  # a stream that parses but does not build metadata: pickle's message names no file
        raise CheckpointError(f"{file} is damaged ({type(e).__name__}: {one_line(e)})") from e
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CheckpointError(f"{file} is not DCP metadata (a {type(metadata).__name__})")
    for index, info in (getattr(metadata, "storage_data", None) or {}).items():
        inside(path, str(getattr(info, "relative_path", "")), f"the storage file of {index.fqn} in {METADATA}")
    return metadata


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader, with ``read_metadata`` as above: every ``dcp.load`` in hybridrec
    goes through it (tensors themselves DCP already reads with ``weights_only=True``)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        metadata = read_metadata(str(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        assert metadata.storage_meta is not None  # set just above
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
        except (pickle.UnpicklingError, EOFError, RuntimeError) as e:
            raise refusal(e, f"{read_item.dest_index.fqn} in {self.checkpoint_path}") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def safe_load(state: dict[str, Any], path: str, no_dist: bool = False) -> None:
    """``dcp.load`` of ``path`` into ``state`` through the safe reader and planner."""
    dcp.load(state, storage_reader=SafeReader(path), planner=SafeLoadPlanner(path), no_dist=no_dist)


def refusal(cause: BaseException, what: str) -> CheckpointError:
    """What a ``weights_only=True`` read (torch's, or the safe planner's) that failed on
    ``what`` means: a pickle naming a callable that exists was planted (``UnsafeCheckpoint``);
    one naming nothing that exists, or bytes that are no pickle at all, are damage
    (``CheckpointError``). Either way nothing in it ran. A ``CheckpointError`` raised by the
    safe reader or planner under DCP's wrapper is returned as it is."""
    if isinstance(cause, CheckpointError):
        return cause
    text = str(cause)
    named = re.search(r"GLOBAL ([\w.]+)", text)
    if named:
        module, _, name = named.group(1).rpartition(".")
        if planted_or_damaged(module, name) == "planted":
            return UnsafeCheckpoint(
                f"{what} is not safe to open: it holds a pickled object that would call "
                f"{named.group(1)} where a tensor or a number belongs (planted); refused, "
                f"nothing in it was run. {_TRUST_HINT}"
            )
        return CheckpointError(
            f"{what} is damaged: it names {named.group(1)}, which does not exist (a changed "
            f"byte); nothing in it was run"
        )
    reason = next((line.strip().rstrip(".") for line in text.splitlines() if "nsupported" in line), one_line(cause))
    return CheckpointError(f"{what} is damaged: not a readable tensor record ({reason}); nothing in it was run")


def saved_config(path: str, trusted: Iterable[str] = ()) -> DictConfig:
    """The config a checkpoint was saved with (``config.yaml``), checked safe and typed again
    by hybridrec's schemas (``config.typed``): the one way export, evaluate and resume read
    it. Read with yaml's safe loader; every ``_target_`` must be at a node that takes one
    (``TARGET_GROUPS``) and name a class hybridrec ships for it (``shipped_targets``) or one
    of ``trusted`` (the loading run's own classes and ``trusted_targets``, never the
    checkpoint's); no Hydra instantiation key and no interpolation. Raises
    ``UnsafeCheckpoint`` before anything is instantiated."""
    file, cfg = inside(path, CONFIG_YAML), load_yaml(path)
    if not isinstance(cfg, DictConfig) or not all(k in cfg for k in ("model", "loss", "optimizer")):
        raise CheckpointError(f"{file} is not a hybridrec config: it lacks model, loss or optimizer")
    renamed_targets(cfg)  # a checkpoint saved before a class moved names its old module
    _check_safe(OmegaConf.to_container(cfg, resolve=False), file, shipped_targets(), frozenset(trusted))
    try:
        return typed(cfg)
    except ValueError as e:
        raise CheckpointError(f"{file} does not fit this hybridrec's config schema: {e}") from None


def load_yaml(path: str) -> Any:
    """The checkpoint's ``config.yaml`` as OmegaConf reads it with yaml's safe loader: a tag
    is refused as unsafe (never constructed), YAML that does not parse (a duplicated key, a
    broken line) is damage. Nothing in it is resolved or checked further here."""
    file = inside(path, CONFIG_YAML)
    try:
        return OmegaConf.load(file)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is damaged: {file} is missing") from None
    except yaml.MarkedYAMLError as e:
        line = f"line {e.problem_mark.line + 1}" if e.problem_mark else "somewhere"
        tag = re.match(r"could not determine a constructor for the tag '([^']*)'", e.problem or "")
        if tag:  # a tag such as !!python/object/apply: never constructed
            kind = "a Python object" if "python/" in tag.group(1) else "a type hybridrec never writes"
            raise UnsafeCheckpoint(
                f"{file} is not safe to open: it holds the YAML tag {tag.group(1)} ({kind}) at "
                f"{line}; refused, nothing in it was run"
            ) from None
        # a duplicated key, a broken indentation, an unclosed quote: what a saved config never holds
        raise CheckpointError(
            f"{file} is damaged or was edited: not valid YAML ({e.problem} at {line}); nothing in it was used"
        ) from None
    except Exception as e:  # not text, or not a mapping
        raise CheckpointError(f"{file} is not a valid checkpoint file ({type(e).__name__}: {one_line(e)})") from e


# Keys Hydra's instantiate acts on besides _target_: none is ever saved by hybridrec.
_INSTANTIATE_KEYS = ("_args_", "_partial_", "_recursive_", "_convert_")


def _check_safe(
    node: Any, file: str, shipped: dict[str, frozenset[str]], trusted: frozenset[str], path: str = ""
) -> None:
    def refuse(what: str) -> NoReturn:
        raise UnsafeCheckpoint(f"{file} is not safe to open: {what}; refused, nothing in it was run")

    if isinstance(node, dict):
        for key, value in node.items():
            where = f"{path}.{key}" if path else str(key)
            if key == "_target_":
                if path not in TARGET_GROUPS:
                    refuse(f"{where}={value} asks to instantiate a class where hybridrec's config has none")
                if value not in shipped[path] and value not in trusted:
                    refuse(
                        f"{where}={value} is not a class hybridrec ships for {path} nor one this run trusts "
                        f"(if it is your own, trust it explicitly: checkpoint.trusted_targets=[{value}] in "
                        f"training, trusted_targets=[{value}] for evaluate and export)"
                    )
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
    own = {
        str(OmegaConf.select(cfg, f"{path}._target_"))
        for path in TARGET_GROUPS
        if OmegaConf.select(cfg, f"{path}._target_") is not None
    }
    return own | set(OmegaConf.select(cfg, "checkpoint.trusted_targets") or [])
