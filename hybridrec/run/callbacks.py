"""Hydra callbacks (``hydra.callbacks`` in conf/config.yaml and conf/evaluate.yaml): what is
checked in the process that composes a run or a sweep before Hydra acts on it: the output
directory can be made, and a submitit launcher's layout can start hybridrec's ranks."""

from __future__ import annotations

import os
import re
import sys
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from hybridrec.config import Device
from hybridrec.run.validation import validate

_SUBMITIT = "hydra_plugins.hydra_submitit_launcher.submitit_launcher."


def check_submitit(cfg: DictConfig) -> None:
    """Rules for Hydra's submitit launcher (hydra/launcher=slurm, local, submitit_*), checked
    in the submitting process: a layout that cannot start hybridrec's ranks fails before any
    job is queued. Then the config itself is validated for the job's world size."""
    hl = cfg.hydra.launcher
    target = str(hl.get("_target_", ""))
    if not target.startswith(_SUBMITIT):
        return
    local = target.endswith("LocalLauncher")
    nproc, device = cfg.launcher.nproc_per_node, cfg.launcher.device
    if hl.tasks_per_node != 1:
        raise ValueError(
            f"hydra.launcher.tasks_per_node={hl.tasks_per_node}: hybridrec runs one task per node, "
            f"which starts launcher.nproc_per_node ranks itself (as torchrun does); set "
            f"hydra.launcher.tasks_per_node=1 launcher.nproc_per_node={hl.tasks_per_node}"
        )
    if hl.nodes < 1 or (local and hl.nodes != 1):
        raise ValueError(
            f"hydra.launcher.nodes={hl.nodes}: must be >= 1"
            + (", and 1 with submitit's local executor (use hydra/launcher=slurm for several)" if local else "")
        )
    if hl.timeout_min < 1:
        raise ValueError(f"hydra.launcher.timeout_min must be >= 1, got {hl.timeout_min}")
    # GPUs the job gets per node: gpus_per_node, or a gres such as gpu:8 / gpu:a100:8.
    gres = re.fullmatch(r"gpu(?::[^:,]+)?:(\d+)", str(hl.get("gres") or ""))
    gpus = hl.gpus_per_node or (int(gres.group(1)) if gres else 0)
    if device == Device.cuda and gpus < nproc:
        raise ValueError(
            f"launcher.device=cuda starts {nproc} rank(s) per node, one GPU each, but the job asks "
            f"for {gpus} GPU(s) per node: set hydra.launcher.gpus_per_node={nproc}"
        )
    if device != Device.cpu and gpus and gpus != nproc:
        raise ValueError(
            f"hydra.launcher.gpus_per_node={gpus} but launcher.nproc_per_node={nproc}: one rank per "
            f"GPU, so they must be equal (or launcher.device=cpu)"
        )
    validate(cfg, hl.nodes * nproc)


class RunDirCheck(Callback):
    """Hydra callback (hydra.callbacks in conf/config.yaml and conf/evaluate.yaml): the run's
    output directory (``hydra.run.dir``, or a sweep's ``hydra.sweep.dir``) can be created,
    checked before Hydra creates it, whose own failure (a path under a file, a read-only
    disk) is a traceback."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _check_output_dir("hydra.run.dir", config.hydra.run.dir)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _check_output_dir("hydra.sweep.dir", config.hydra.sweep.dir)


def _check_output_dir(key: str, path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        blocker = next((p for p in _ancestors(path) if os.path.exists(p) and not os.path.isdir(p)), None)
        why = f"{blocker} is a file, not a directory" if blocker else (e.strerror or str(e))
        sys.exit(f"hybridrec: {key}={path}: cannot create the output directory ({why}): give another {key}")
    if not os.access(path, os.W_OK):
        sys.exit(f"hybridrec: {key}={path}: the output directory is not writable: give another {key}")


def _ancestors(path: str) -> list[str]:
    """``path`` and every directory above it, nearest first."""
    out, path = [], os.path.abspath(path)
    while True:
        out.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            return out
        path = parent


class SubmititCheck(Callback):
    """Hydra callback (hydra.callbacks in conf/config.yaml): runs ``check_submitit`` once,
    before the launcher submits the sweep's jobs."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            check_submitit(config)
        except ValueError as e:
            sys.exit(f"hybridrec: invalid launcher config: {e}")
