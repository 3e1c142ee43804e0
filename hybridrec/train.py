"""Entry point: ``python -m hybridrec.train +experiment=ctr [overrides]``.

Hydra composes and type-checks the config, ``validate`` checks cross-field rules, and only
then are ranks started (``launch.py``): a bad config never costs a process group.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from hybridrec.config import check_device, register_configs, validate
from hybridrec.checkpoint import CheckpointError, TrainState, check_compatible, check_dir, probe_writable, resume_path
from hybridrec.data import build_source
from hybridrec.launch import RankError, already_launched, launch, world_size
from hybridrec.parallel_dims import job_dims
from hybridrec.logs import hydra_verbose, quiet_libraries
from hybridrec.plan import dry_plan
from hybridrec.trainer import USER_ERRORS, full_errors

register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    quiet_libraries(hydra_verbose())  # TorchRec's planner INFO lines, unless hydra.verbose asks for them
    # A user error is one line naming the key or file (HYDRA_FULL_ERROR=1: the traceback).
    try:
        world = world_size(cfg)  # under a submitit job: nodes x nproc_per_node, or why not
        validate(cfg, world)
        dims = job_dims(cfg, world)  # the layout every rank will rebuild from its own environment
        check_device(cfg, dims.device_type)
        if cfg.checkpoint.dir:
            probe_writable(cfg.checkpoint.dir)
        # A checkpoint the ranks would refuse, find damaged or of another model fails here,
        # before launch (and before any elastic restart could retry it).
        path = resume_path(cfg)
        state = TrainState.from_files(path) if path else None  # checked complete by resume_path
        data = build_source(cfg.data, cfg.seed) if state or not already_launched() else None
        if state:
            check_compatible(cfg, path, state, data.features, data.num_dense_features)
        if state and state.step >= cfg.train.steps:
            raise CheckpointError(
                f"checkpoint {path} is at step {state.step} and train.steps={cfg.train.steps}: nothing to "
                f"train; raise train.steps (the total, e.g. train.steps={state.step + cfg.train.steps}), or "
                f"start a new run in another checkpoint.dir"
            )
        check_dir(cfg, path, state)
        if not already_launched():
            # Plan the tables here first: a constraint the planner cannot meet fails now, not
            # after N ranks have started. The ranks plan again (identically) over their group.
            dry_plan(cfg, dims, detect=True, data=data)
    except CheckpointError as e:
        _exit(e, f"hybridrec: {e}")
    except ValueError as e:  # PlanError and DataError included
        _exit(e, f"hybridrec: invalid config: {e}")
    try:
        summary = launch(cfg, HydraConfig.get().runtime.output_dir)
    except (*USER_ERRORS, RankError) as e:  # raised inside a rank: bad rows, checkpoint, disk full
        _exit(e, f"hybridrec: {e}")
    return summary["train_loss"]  # what a Hydra sweeper would minimize


def _exit(error: BaseException, message: str) -> NoReturn:
    if full_errors():
        raise error
    sys.exit(message)


def _quiet_secondary_ranks() -> None:
    # Under torchrun every rank runs Hydra, and each would create its own timestamped run
    # directory and log file. Ranks other than 0 write to a scratch directory instead; the
    # trainer then adopts rank 0's directory (broadcast after the process group is up).
    if already_launched() and os.environ["RANK"] != "0":
        scratch = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"hybridrec-rank{os.environ['RANK']}")
        sys.argv += [f"hydra.run.dir={scratch}", "hydra.output_subdir=null", "hydra/job_logging=none"]


if __name__ == "__main__":
    _quiet_secondary_ranks()
    main()
