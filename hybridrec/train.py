"""Entry point: ``python -m hybridrec.train +experiment=ctr [overrides]``.

Hydra composes and type-checks the config, ``check_before_launch`` runs the checks of every
command (``preflight``: cross-field rules, the device, the plan) and training's own (the
checkpoint directory and the checkpoint to resume), and only then are ranks started
(``launch.py``): a bad config never costs a process group.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from typing import Optional

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from hybridrec.base.signals import Killed
from hybridrec.checkpoint import (
    CheckpointError,
    DirLock,
    TrainState,
    check_compatible,
    check_dir,
    probe_writable,
    resume_path,
)
from hybridrec.config import objective, register_configs
from hybridrec.config.schema import TrainSchedule
from hybridrec.data import build_source
from hybridrec.reports.logs import hydra_verbose, quiet_libraries
from hybridrec.reports.sweep import record_failure
from hybridrec.run.errors import USER_ERRORS, check_command_line, exit_user_error, full_errors, user_message
from hybridrec.run.launch import (
    RankError,
    already_launched,
    in_search,
    in_sweep,
    launch,
    oversubscribed,
    quiet_secondary_ranks,
)
from hybridrec.run.preflight import check_job, plan_before_launch
from hybridrec.training.build import keep_fitted

register_configs()
log = logging.getLogger("hybridrec.train")  # not "__main__" under python -m


def check_before_launch(cfg: DictConfig, lock: Optional[DirLock] = None, run_dir: str = "") -> None:
    """Everything that can be checked before a rank starts; raises ``CheckpointError``,
    ``LaunchError`` or ``ValueError`` (a config the ranks would refuse) with the one line.
    ``lock``: taken on ``checkpoint.dir`` once it is known writable (``run_dir`` is recorded
    in it), so a second run on the directory is refused here."""
    dims = check_job(cfg)
    if not already_launched() and (note := oversubscribed(cfg)):
        log.warning(note)
    if cfg.checkpoint.dir:
        probe_writable(cfg.checkpoint.dir)
        if lock:
            lock.acquire(run_dir)
    # A checkpoint the ranks would refuse, find damaged or of another model fails here,
    # before launch (and before any elastic restart could retry it).
    # Under torchrun every rank checks; rank 0 alone reads the files' content (it picks the
    # checkpoint the ranks load, verifying it again, trainer.Trainer).
    path = resume_path(cfg, verify_content=not already_launched() or os.environ["RANK"] == "0")
    state = (
        TrainState.from_files(path, cfg.checkpoint.allow_unverified) if path else None
    )  # checked complete by resume_path
    data = build_source(cfg.data, cfg.seed) if state or not already_launched() else None
    if data:
        keep_fitted(cfg, data)  # fitted once here: the ranks get the values
    if state:
        assert path is not None and data is not None  # state was read from path, and data built for it
        check_compatible(cfg, path, state, data.features, data.num_dense_features, data.version)
    # A continuous run's length is its partitions, not train.steps (a run day after day passes
    # any fixed count): the same command resumes it at any step, and the stream says what is new.
    if state and state.step >= cfg.train.steps and cfg.train.schedule != TrainSchedule.continuous:
        raise CheckpointError(
            f"checkpoint {path} is at step {state.step} and train.steps={cfg.train.steps}: nothing to "
            f"train; raise train.steps (the total, e.g. train.steps={state.step + cfg.train.steps}), or "
            f"start a new run in another checkpoint.dir"
        )
    prof = cfg.profile
    if (
        state
        and prof.enabled
        and cfg.train.schedule != TrainSchedule.continuous
        and state.step + prof.start_step + prof.steps > cfg.train.steps
    ):
        # the window counts from this process's first step (tracing and lazy init happen again)
        raise ValueError(
            f"profile.start_step={prof.start_step} + profile.steps={prof.steps} must fit in the "
            f"{cfg.train.steps - state.step} steps left after resuming {path} at step {state.step}: "
            f"lower them, or raise train.steps (the total) to at least {state.step + prof.start_step + prof.steps}"
        )
    check_dir(cfg, path, state)
    # A search sweeper optimizes the returned value: without validation it would optimize the
    # train loss, in the direction of the validation objective. The basic sweeper's fixed list
    # of jobs may compare them on the train loss (the table says which it sorts by).
    asked = (
        in_search() or cfg.checkpoint.keep_best or cfg.train.early_stop_patience > 0 or cfg.train.objective != "auto"
    )
    objective.check(cfg, data.splits if data else ["valid"], asked)  # under torchrun the ranks check the splits
    plan_before_launch(cfg, dims, data)


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    quiet_libraries(hydra_verbose())  # TorchRec's planner INFO lines, unless hydra.verbose asks for them
    # A user error is one line naming the key or file (HYDRA_FULL_ERROR=1: the traceback).
    run_dir = HydraConfig.get().runtime.output_dir
    failed = _Failure(cfg, run_dir)
    # The process that launches the job holds checkpoint.dir for its lifetime (under torchrun:
    # global rank 0, whose saves commit).
    owner = not already_launched() or os.environ["RANK"] == "0"
    lock = DirLock(cfg.checkpoint.dir) if cfg.checkpoint.dir and owner else None
    try:
        try:
            check_before_launch(cfg, lock, run_dir)
        except ValueError as e:  # CheckpointError and LaunchError are ValueErrors too
            return failed(e, user_message(e))
        try:
            summary = launch(cfg, run_dir)
        except (*USER_ERRORS, RankError, Killed) as e:  # raised inside a rank: bad rows, checkpoint, disk full
            return failed(e, f"hybridrec: {e}")
    finally:
        if lock:
            lock.release()
    value = summary["objective"]["value"]  # what a Hydra sweeper optimizes (train.objective)
    if math.isnan(value):  # e.g. AUC of a validation split with one class: no sweeper can rank NaN
        value = objective.declared(cfg).worst
        print(
            f"hybridrec: {summary['objective']['name']} is NaN: the job returns {value}, the worst value",
            file=sys.stderr,
            flush=True,
        )
    return value


class _Failure:
    """How a job stops on a user error: one line and a non-zero exit; in a sweep, the line,
    a failed row in the sweep's summary, and the objective's worst value returned, so that
    every sweeper (the basic one, Optuna, ...) ranks the job last and goes on with the others."""

    def __init__(self, cfg: DictConfig, run_dir: str) -> None:
        self.cfg, self.run_dir = cfg, run_dir

    def __call__(self, error: BaseException, message: str) -> float:
        if not in_sweep() or full_errors():
            exit_user_error(error, message)
        try:
            worst = objective.declared(self.cfg).worst
        except ValueError:  # the objective itself is the error: the sweeper's direction failed too
            worst = math.inf
        record_failure(self.run_dir, message)
        print(f"{message} (job returns {worst}, the worst value)", file=sys.stderr, flush=True)
        return worst


if __name__ == "__main__":
    quiet_secondary_ranks()
    check_command_line("config")
    main()
