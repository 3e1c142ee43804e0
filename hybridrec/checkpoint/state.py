"""hybridrec's own part of a checkpoint (``TrainState``), the checksums that make damage
visible, and which checkpoint directories are complete, loadable and newest."""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
import pickle
import re
import uuid
import warnings
from dataclasses import dataclass, field
from typing import Any, NoReturn, Optional

import blake3
import torch
from omegaconf import DictConfig

from hybridrec.checkpoint.errors import CheckpointError, UnsafeCheckpoint, one_line
from hybridrec.checkpoint.safety import CONFIG_YAML, METADATA, inside, load_yaml, read_metadata, refusal
from hybridrec.data import SparseFeature, shorten

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
    stream: dict[str, Any] = field(default_factory=dict)
    """train.schedule=continuous (``hybridrec.training.continuous.Stream``): the partitions trained so
    far in order, the position (partition, row) and the progressive evaluations. Empty for
    other schedules."""
    history: list[dict[str, Any]] = field(default_factory=list)
    """The run's ``metrics.jsonl`` records up to ``step``, in order (rank 0's: loss reports,
    evaluations, earlier resumes), so that a run resumed from this checkpoint writes the
    whole training's history and no record of steps after it. Empty in checkpoints written
    before the field existed."""
    data_version: Optional[int] = None
    """``Source.version`` of the data it was trained on: the version of the generator that drew
    the rows (the synthetic click log). None: rows read from files, or a checkpoint written
    before the field existed (the synthetic log's rows were then version 1's)."""
    files: dict[str, str] = field(default_factory=dict)
    """BLAKE3 of every other file of the checkpoint, by name: DCP's files (hashed by the rank
    that wrote them), trainer_state.pt and config.yaml. Empty only in checkpoints written
    before the field existed, which load only with ``allow_unverified`` (a checkpoint that
    lacks them otherwise is damaged or edited: its manifest was removed)."""

    def to_files(self, directory: str) -> None:
        """Write the state into ``directory``, where DCP's files (hashed in ``files``) and
        ``config.yaml`` already are; ``trainer_state.pt`` and ``config.yaml`` are hashed here."""
        torch.save({"rng": self.rng, "losses": self.losses}, os.path.join(directory, STATE_TENSORS))
        self.files.update(hash_files(directory, [STATE_TENSORS, CONFIG_YAML]))
        fields = {
            "step": self.step,
            "schedulers": self.schedulers,
            "features": self.features,
            "num_dense_features": self.num_dense_features,
            "runs": self.runs,
            "selection": self.selection,
            **({"stream": self.stream} if self.stream else {}),
            "history": self.history,
            **({"data_version": self.data_version} if self.data_version is not None else {}),
            "files": dict(sorted(self.files.items())),
        }
        fields["state_blake3"] = _fields_digest(fields)  # the file's own check: it cannot hash itself
        with open(os.path.join(directory, STATE_JSON), "w") as f:
            json.dump(fields, f, indent=1)  # floats are written in full: they read back bit-exact

    @classmethod
    def from_files(cls, directory: str, allow_unverified: bool = False) -> TrainState:
        """Read and check the state (a ``CheckpointError`` names the file and the field that is
        wrong). The JSON is checked against its own checksum, then ``trainer_state.pt`` against
        the one the JSON records, before torch reads it: a changed byte is damage, named as
        such. A state without checksums is refused unless ``allow_unverified``."""
        json_path, tensors_path = inside(directory, STATE_JSON), inside(directory, STATE_TENSORS)
        if not os.path.isfile(json_path) and os.path.isfile(tensors_path):
            # Never opened: before this format, trainer_state.pt was read with a full unpickle.
            raise CheckpointError(
                f"{directory} was written by an older hybridrec, whose state ({STATE_TENSORS} without "
                f"{STATE_JSON}) was read by unpickling arbitrary objects; this version does not load that "
                f"format. Re-create the checkpoint by training again with this version"
            )
        for path in (json_path, tensors_path):
            if not os.path.isfile(path):
                raise CheckpointError(
                    f"{directory} is not a committed checkpoint: {path} is missing (a save that "
                    f"never committed, or a damaged directory)"
                )
        try:
            with open(json_path, "rb") as f:
                fields = json.loads(f.read().decode())
        except (ValueError, UnicodeDecodeError) as e:  # not JSON, or not text
            raise CheckpointError(f"{json_path} is damaged: not valid JSON ({one_line(e)})") from None
        if not isinstance(fields, dict):
            raise CheckpointError(f"{json_path} is damaged: a JSON {type(fields).__name__}, not an object of fields")
        digest = fields.pop("state_blake3", None)
        if digest is None or "files" not in fields:
            unverified(directory, json_path, "state_blake3" if digest is None else "files", allow_unverified)
        elif digest != _fields_digest(fields):
            raise CheckpointError(
                f"{directory} is damaged: {json_path} does not match the checksum of its "
                f"fields recorded when it was saved"
            )
        _check_fields(fields, json_path)
        if "files" in fields and not fields["files"]:
            # hybridrec lists every file of a step when it commits it: an empty manifest would
            # leave the files' checksums unchecked ("required" only for the files it names)
            raise CheckpointError(
                f"{directory} is damaged or was edited: {json_path} lists no files in its manifest "
                f"('files'), so no file of it can be verified; refused"
            )
        if fields.get("files"):
            verify_files(directory, fields["files"], [STATE_TENSORS])
        tensors = _load_tensors(tensors_path)
        for key, dtype, dims in (("rng", torch.uint8, 2), ("losses", torch.float64, 1)):
            t = tensors.get(key)
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != dims:
                what = f"a {t.dtype} tensor of {t.dim()} dimensions" if isinstance(t, torch.Tensor) else "missing"
                raise CheckpointError(
                    f"{tensors_path} is damaged: '{key}' is {what}, expected {dtype} with {dims} dimensions"
                )
        if len(tensors["losses"]) != fields["step"]:
            raise CheckpointError(
                f"{directory} is damaged: {tensors_path} holds {len(tensors['losses'])} losses "
                f"for step {fields['step']} of {json_path}"
            )
        return cls(
            step=fields["step"],
            schedulers=fields["schedulers"],
            features=fields["features"],
            num_dense_features=fields["num_dense_features"],
            rng=tensors["rng"],
            losses=tensors["losses"],
            runs=list(fields.get("runs", [])),
            selection=dict(fields.get("selection") or {}),
            stream=dict(fields.get("stream") or {}),
            history=list(fields.get("history") or []),
            data_version=fields.get("data_version"),
            files=dict(fields.get("files") or {}),
        )


_FEATURE_FIELDS = {f.name for f in dataclasses.fields(SparseFeature)}


def _check_fields(fields: dict[str, Any], json_path: str) -> None:
    """Each field of ``trainer_state.json`` has the type training writes: a checkpoint whose
    state was edited or damaged is named here (file, field, value), not where a value of the
    wrong type would fail later (as a config error, or deep in a rank)."""

    def bad(field_: str, value: Any, expected: str) -> NoReturn:
        raise CheckpointError(
            f"{json_path} is damaged or was edited: field '{field_}' is {shorten(value)} "
            f"(a {type(value).__name__}), expected {expected}"
        )

    def count(key: str, least: int) -> None:
        value = fields.get(key)
        if key not in fields:
            raise CheckpointError(f"{json_path} is damaged or was edited: field '{key}' is missing")
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            bad(key, value, f"an integer >= {least}")

    count("step", 0)
    count("num_dense_features", 0)
    if "data_version" in fields:
        count("data_version", 1)
    for key in ("schedulers", "features"):
        if key not in fields:
            raise CheckpointError(f"{json_path} is damaged or was edited: field '{key}' is missing")
        if not isinstance(fields[key], list) or not all(isinstance(x, dict) for x in fields[key]):
            bad(key, fields[key], "a list of objects")
    for i, f in enumerate(fields["features"]):
        if unknown := sorted(set(f) - _FEATURE_FIELDS):
            bad(f"features[{i}].{unknown[0]}", f[unknown[0]], f"one of the fields {', '.join(sorted(_FEATURE_FIELDS))}")
        if not isinstance(f.get("name"), str) or not f["name"]:
            bad(f"features[{i}].name", f.get("name"), "a feature name")
        n = f.get("num_embeddings")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            bad(f"features[{i}].num_embeddings", n, "an integer >= 1")
        try:
            SparseFeature(**f)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{json_path} is damaged or was edited: field 'features[{i}]': {e}") from None
    runs = fields.get("runs", [])
    if not isinstance(runs, list) or not all(isinstance(r, str) for r in runs):
        bad("runs", runs, "a list of run ids")
    for key in ("selection", "stream"):
        if not isinstance(fields.get(key) or {}, dict):
            bad(key, fields[key], "an object")
    history = fields.get("history") or []
    if not isinstance(history, list):
        bad("history", history, "a list of metrics records")
    for i, record in enumerate(history):
        step = record.get("step") if isinstance(record, dict) else None
        # a record after the checkpoint's step would show steps the resumed run trains again
        if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= fields["step"]:
            bad(f"history[{i}]", record, f"a metrics record with a step from 0 to {fields['step']}")
    files = fields.get("files") or {}
    if not isinstance(files, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and _DIGEST.fullmatch(v) for k, v in files.items()
    ):
        bad("files", files, "an object of file names and BLAKE3 digests")


_DIGEST = re.compile(r"[0-9a-f]{64}")
_warned_unverified: set[str] = set()


def unverified(directory: str, json_path: str, missing: str, allowed: bool) -> None:
    """A state without its checksums (``missing``: the field that is absent): refused as
    damage unless ``allowed`` (a checkpoint written before checksums existed), then loaded
    with one warning per process."""
    if not allowed:
        raise CheckpointError(
            f"{directory} is damaged or was edited: {json_path} has no '{missing}' field, so its content cannot be "
            f"verified (hybridrec writes checksums into every checkpoint); refused. A checkpoint written by a "
            f"hybridrec older than checksums loads, unverified, with checkpoint.allow_unverified=true (evaluate and "
            f"export: allow_unverified=true)"
        )
    if directory not in _warned_unverified:
        _warned_unverified.add(directory)
        log.warning(
            f"{directory} records no checksums ('{missing}' is missing from {STATE_JSON}): loaded without "
            f"verifying its content (allow_unverified=true)"
        )


def _fields_digest(fields: dict[str, Any]) -> str:
    return blake3.blake3(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def hash_files(directory: str, names: list[str]) -> dict[str, str]:
    """BLAKE3 of each named file of ``directory``. BLAKE3, not SHA-256: the same 256-bit
    strength at 4-5x the speed on one core, and it hashes one large file on several threads
    (here the rank's own share of the cores), so checking costs a fraction of writing."""
    threads = max(1, torch.get_num_threads())
    return {name: blake3.blake3(max_threads=threads).update_mmap(inside(directory, name)).hexdigest() for name in names}


def own_files(directory: str, rank: int) -> list[str]:
    """The DCP files rank ``rank`` wrote (FileSystemWriter names them ``__<rank>_<i>.distcp``;
    rank 0 also writes ``.metadata``). The commit checks that these cover every file."""
    names = sorted(n for n in os.listdir(directory) if n.startswith(f"__{rank}_") and n.endswith(".distcp"))
    return names + ([METADATA] if rank == 0 else [])


def verify_files(path: str, recorded: dict[str, str], names: list[str]) -> None:
    """Each of ``names`` matches the BLAKE3 hash ``recorded`` for it at the commit (a
    ``CheckpointError`` names the first that does not, or has none)."""
    if unlisted := [n for n in names if n not in recorded]:
        raise CheckpointError(f"{path} is damaged: no checksum recorded for {unlisted[0]}")
    for name, digest in hash_files(path, names).items():
        if digest != recorded[name]:
            raise CheckpointError(
                f"{path} is damaged: {os.path.join(path, name)} does not match the checksum recorded when it was "
                f"saved (a changed byte, or a partial overwrite)"
            )


def verify(path: str, state: TrainState, dcp_files: list[str]) -> None:
    """Every file of the checkpoint matches the BLAKE3 hash recorded at its commit.
    ``dcp_files``: the files its ``.metadata`` lists, each of which must have a recorded
    checksum. A state without checksums was refused or allowed when it was read."""
    if state.files:
        verify_files(path, state.files, sorted({*dcp_files, METADATA, STATE_TENSORS, CONFIG_YAML}))


def _load_tensors(path: str) -> dict[str, Any]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns about a pickle protocol before refusing it
            tensors = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, EOFError, RuntimeError) as e:  # RuntimeError: not a zip archive
        raise refusal(e, path) from None
    if not isinstance(tensors, dict):
        raise CheckpointError(f"{path} is damaged: a {type(tensors).__name__}, not tensors by name")
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
    return sorted(
        (int(m.group(1)), path)
        for path in glob.glob(os.path.join(directory, "step_*"))
        if (m := _STEP_DIR.search(path)) and os.path.isdir(path)
    )


def check_committed_name(path: str, key: str) -> None:
    """Refuse a ``.partial`` directory: a save that never committed (training renames
    ``step_<N>.partial`` to ``step_<N>`` once every rank has written and the state is known
    sane), whatever files it holds. ``key``: how the user named it."""
    if os.path.basename(os.path.normpath(path)).endswith(".partial"):
        raise CheckpointError(
            f"{key}={path} is not a committed checkpoint: a save that never finished (training renames "
            f"step_<N>.partial to step_<N> once every rank has written and the state is sane); it is never "
            f"resumed, evaluated or exported: give a step_<N> directory"
        )


def check_complete(path: str, verify_content: bool = True, allow_unverified: bool = False) -> TrainState:
    """The checkpoint's state, once every file it needs is there: DCP's ``.metadata``, the
    storage files it lists (plain files of the directory, at their full length), hybridrec's
    state and config, and, with ``verify_content``, each file's content as recorded at commit
    (``verify``). The small files are verified before ``.metadata`` is unpickled, so a
    changed byte in it is called damage, not a planted payload. Checked before loading, so a
    damaged checkpoint is named (``CheckpointError``) instead of failing in DCP or loading
    NaNs. ``allow_unverified``: a state without checksums loads (with a warning)."""
    metadata = inside(path, METADATA)
    if not os.path.isfile(metadata):
        raise CheckpointError(
            f"{path} is not a complete checkpoint ({metadata} is missing: an interrupted "
            f"save, or not a checkpoint directory)"
        )
    state = TrainState.from_files(path, allow_unverified)
    if not os.path.isfile(inside(path, CONFIG_YAML)):
        raise CheckpointError(f"{path} is damaged: {os.path.join(path, CONFIG_YAML)} is missing")
    if verify_content and state.files:
        verify_files(path, state.files, [METADATA, CONFIG_YAML])
    load_yaml(path)  # parses (safely): YAML that does not is damage, a tag in it unsafe
    ends: dict[str, int] = {}
    for info in read_metadata(path).storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CheckpointError(f"{path} is damaged: {file} is missing (its .metadata lists it)")
        if os.path.getsize(file) < end:
            raise CheckpointError(
                f"{path} is damaged: {file} is truncated ({os.path.getsize(file):,} of {end:,} bytes)"
            )
    if verify_content:
        verify(path, state, list(ends))
    return state


def check_checkpoint(path: str, allow_unverified: bool = False) -> TrainState:
    """A checkpoint that a model is read from (``hybridrec.evaluate``, ``hybridrec.export``):
    a committed, complete ``step_<N>`` directory with its ``config.yaml``. Each refusal
    (``CheckpointError``) names the path and what to give instead."""
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint={path}: no such directory")
    check_committed_name(path, "checkpoint")
    if not os.path.isfile(os.path.join(path, METADATA)) and committed(path):
        try:
            newest = latest(path)
        except CheckpointError:  # every one damaged: no suggestion
            newest = None
        raise CheckpointError(
            f"checkpoint={path} is a checkpoint.dir, not one checkpoint: give one of its step_<N> directories"
            + (f", e.g. checkpoint={newest} (the newest loadable)" if newest else "")
        )
    return check_complete(path, allow_unverified=allow_unverified)


def resolve_checkpoint(path: str, allow_unverified: bool = False) -> tuple[str, str]:
    """``checkpoint=`` of ``hybridrec.evaluate`` and ``hybridrec.export``: a ``step_<N>``
    directory, or a ``checkpoint.dir``, which stands for its newest loadable checkpoint (what a
    resumed run would continue: the newest that passes the same verification as a load, down
    to its files' checksums), so that the commands after training need not know its last
    step. Returns the checkpoint and a line saying which one a directory stood for and why
    each newer one was passed over ("" for a step directory, returned as given and checked by
    ``check_checkpoint``)."""
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, METADATA)) or not committed(path):
        if (where := _run_checkpoints(path)) is not None:
            raise CheckpointError(
                f"checkpoint={path} is a run's output directory, not a checkpoint: "
                + (
                    f"its checkpoints are in {where}: give checkpoint={where}"
                    if where
                    else "that run saved no checkpoint (checkpoint.dir was not set)"
                )
            )
        return path, ""
    newest, skipped = _newest_loadable(path, verify_content=True, allow_unverified=allow_unverified)
    if newest is None:
        raise CheckpointError(
            f"checkpoint={path} holds no loadable checkpoint ({skipped[0]}): give a step_<N> directory"
        )
    return newest, (
        f"checkpoint={path}: its newest loadable checkpoint, {newest}"
        + (f" (newer, not loadable: {'; '.join(skipped)})" if skipped else "")
    )


def _run_checkpoints(path: str) -> Optional[str]:
    """For a run's output directory (Hydra's ``.hydra/config.yaml`` in it): its
    ``checkpoint.dir`` ("" when the run saved none); None for any other path. Read with yaml's
    safe loader, as a checkpoint's config is."""
    import yaml

    try:
        with open(os.path.join(path, ".hydra", "config.yaml")) as f:
            cfg = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return None
    where = ((cfg or {}).get("checkpoint") or {}).get("dir") if isinstance(cfg, dict) else None
    return str(where) if where else ""


def latest(
    directory: str, warn: bool = False, verify_content: bool = True, allow_unverified: bool = False
) -> Optional[str]:
    """The newest loadable checkpoint in ``directory``, or None if there is none. Damaged newer
    ones are skipped (with a warning naming what is wrong when ``warn``), and so is a
    ``step_<N>`` that is a symbolic link out of ``directory``; a directory whose every
    checkpoint is damaged is refused, rather than trained over from scratch.
    ``verify_content``: check the files' hashes too (``check_complete``)."""
    path, skipped = _newest_loadable(directory, verify_content, allow_unverified)
    if path is not None:
        if skipped and warn:
            log.warning(
                f"resuming from {path}, the newest loadable checkpoint, not from a newer one: {'; '.join(skipped)}"
            )
        return path
    if skipped:
        raise CheckpointError(
            f"checkpoint.dir={directory} holds no loadable checkpoint ({skipped[0]}): "
            f"repair or delete its step_* directories, or use another checkpoint.dir"
        )
    return None


def _newest_loadable(directory: str, verify_content: bool, allow_unverified: bool) -> tuple[Optional[str], list[str]]:
    """The newest checkpoint of ``directory`` that ``check_complete`` accepts (None: none
    does), and why each newer one was passed over. A planted payload is never passed over."""
    skipped = []
    home = os.path.realpath(directory)
    for _, path in reversed(committed(directory)):
        real = os.path.realpath(path)
        if os.path.islink(path) and os.path.commonpath([real, home]) != home:
            skipped.append(f"{path} is a symbolic link to {real}, outside checkpoint.dir (not read)")
            continue
        try:
            check_complete(path, verify_content, allow_unverified)
        except UnsafeCheckpoint:
            raise  # never skipped quietly: someone planted it
        except CheckpointError as e:
            skipped.append(str(e))
            continue
        return path, skipped
    return None, skipped


def resume_path(cfg: DictConfig, warn: bool = False, verify_content: bool = True) -> Optional[str]:
    """checkpoint.resume: auto (newest loadable, if any), never, or a committed checkpoint
    path, checked (with ``verify_content``, down to the files' hashes)."""
    ck = cfg.checkpoint
    resume, allow = ck.resume, bool(ck.allow_unverified)
    if resume == "never" or not ck.dir and resume == "auto":
        return None
    if resume == "auto":
        return latest(ck.dir, warn, verify_content, allow)
    if not os.path.isdir(resume):
        raise CheckpointError(f"checkpoint.resume={resume}: no such checkpoint directory")
    check_committed_name(resume, "checkpoint.resume")
    check_complete(resume, verify_content, allow)
    return resume
