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

The package, one module per job: ``errors`` (what goes wrong), ``safety`` (opening files
without running code), ``state`` (TrainState, checksums, which checkpoints are complete and
newest), ``compatibility`` (whether a checkpoint fits a run), ``saver`` (writing and
committing, the directory lock) and ``loading`` (restoring into a run or a model).

May import: base, config, data, models, parallel, reports.
"""

from hybridrec.checkpoint.compatibility import check_compatible, check_dir, check_fits, layout_differences
from hybridrec.checkpoint.errors import CheckpointError, Diverged, UnsafeCheckpoint, root_cause
from hybridrec.checkpoint.loading import load, load_weights
from hybridrec.checkpoint.safety import (
    CONFIG_YAML,
    METADATA,
    SafeLoadPlanner,
    SafeReader,
    read_metadata,
    refusal,
    run_targets,
    safe_load,
    saved_config,
)
from hybridrec.checkpoint.saver import LOCK, Checkpointer, DirLock, Resumable, exploded, typical_loss
from hybridrec.checkpoint.state import (
    STATE_JSON,
    STATE_TENSORS,
    TrainState,
    check_checkpoint,
    check_complete,
    committed,
    hash_files,
    latest,
    new_run_id,
    own_files,
    probe_writable,
    resolve_checkpoint,
    resume_path,
    verify,
)

__all__ = [
    "CONFIG_YAML",
    "LOCK",
    "METADATA",
    "STATE_JSON",
    "STATE_TENSORS",
    "CheckpointError",
    "Checkpointer",
    "DirLock",
    "Diverged",
    "Resumable",
    "SafeLoadPlanner",
    "SafeReader",
    "TrainState",
    "UnsafeCheckpoint",
    "check_checkpoint",
    "check_compatible",
    "exploded",
    "typical_loss",
    "check_complete",
    "check_dir",
    "check_fits",
    "committed",
    "hash_files",
    "latest",
    "layout_differences",
    "load",
    "load_weights",
    "new_run_id",
    "own_files",
    "probe_writable",
    "read_metadata",
    "refusal",
    "resolve_checkpoint",
    "resume_path",
    "root_cause",
    "run_targets",
    "safe_load",
    "saved_config",
    "verify",
]
