"""hybridrec's own part of a checkpoint (``TrainState``), the checksums that make damage
visible, and which checkpoint directories are complete, loadable and newest."""

from __future__ import annotations

import glob
import json
import logging
import os
import pickle
import re
import uuid
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import blake3
import torch
from omegaconf import DictConfig

from hybridrec.checkpoint.errors import CheckpointError, UnsafeCheckpoint
from hybridrec.checkpoint.safety import CONFIG_YAML, METADATA, read_metadata, refused_global

log = logging.getLogger(__name__)
_STEP_DIR = re.compile(r"step_(\d+)$")
STATE_JSON, STATE_TENSORS = "trainer_state.json", "trainer_state.pt"


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
            f"{refused_global(e)}; refused, nothing in it was run"
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


