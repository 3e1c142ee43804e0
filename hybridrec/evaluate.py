"""Entry point: ``python -m hybridrec.evaluate checkpoint=<dir> [data.<key>=...] [launcher.nproc_per_node=N]``.

Scores the model of a saved checkpoint on one split (``split=eval``, the test set, or
``valid``) with the evaluation training runs (``hybridrec.training.scoring``), on 1 or N ranks
started as training starts them. The config is the checkpoint's own ``config.yaml``, typed
again, with the data changes given here (``config.evaluation_config``). Everything a rank
would refuse (a checkpoint that is missing, uncommitted or damaged, data whose features
do not fit its tables, a bad key) fails here first, in one line. Writes ``metrics.json``
and ``predictions.parquet`` into the Hydra run directory.
"""

from __future__ import annotations

import logging

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from hybridrec.base.signals import Killed
from hybridrec.checkpoint import CheckpointError, check_checkpoint, check_fits, resolve_checkpoint, saved_config
from hybridrec.config import evaluation_config, register_configs
from hybridrec.data import DataError, build_source
from hybridrec.reports.logs import hydra_verbose, quiet_libraries
from hybridrec.run.errors import USER_ERRORS, check_command_line, exit_user_error, user_message
from hybridrec.run.launch import RankError, launch, quiet_secondary_ranks
from hybridrec.run.preflight import check_job, plan_before_launch
from hybridrec.training.scoring import ScoreCheckpoint

register_configs()
log = logging.getLogger("hybridrec.evaluate")  # not "__main__" under python -m


@hydra.main(version_base="1.3", config_path="conf", config_name="evaluate")
def main(ev: DictConfig) -> float:
    quiet_libraries(hydra_verbose())  # TorchRec's planner INFO lines, unless hydra.verbose asks for them
    # A user error is one line naming the key or file (HYDRA_FULL_ERROR=1: the traceback).
    try:
        if OmegaConf.is_missing(ev, "checkpoint"):
            raise CheckpointError(
                "checkpoint is not set: give checkpoint=<dir>, a training run's checkpoint.dir "
                "(its newest loadable checkpoint) or one of its step_<N> directories"
            )
        path, which = resolve_checkpoint(ev.checkpoint, ev.allow_unverified)
        if which:
            log.info(which)
        state = check_checkpoint(path, ev.allow_unverified)
        if ev.launcher.max_restarts:
            raise ValueError(
                "launcher.max_restarts restarts training from its checkpoints; an evaluation "
                "that fails is run again as a whole: leave it 0"
            )
        saved = saved_config(path, ev.trusted_targets)  # refuses a config that would run code
        cfg = evaluation_config(saved, ev, data_option=HydraConfig.get().runtime.choices.get("data") is not None)
        dims = check_job(cfg)
        data = build_source(cfg.data, cfg.seed)
        check_fits(state, data.features, data.num_dense_features, path)
        scored = [s for s in data.splits if s != "train"]
        if ev.split not in scored:
            raise DataError(
                f"split={ev.split}: this data source has {' and '.join(scored)} to score: "
                f"split={' or split='.join(scored)}"
            )
        plan_before_launch(cfg, dims, data)
    except ValueError as e:  # CheckpointError, LaunchError, DataError and PlanError included
        exit_user_error(e, user_message(e))
    job = ScoreCheckpoint(path, ev.split, ev.predictions, ev.allow_unverified)
    try:
        result = launch(cfg, HydraConfig.get().runtime.output_dir, job)
    except (*USER_ERRORS, RankError, Killed) as e:  # raised inside a rank: bad rows, a checkpoint that does not load
        exit_user_error(e, f"hybridrec: {e}")
    metrics = result["eval"]
    return metrics["auc"] if "auc" in metrics else metrics["ndcg@10"]  # what a Hydra sweeper would maximize


if __name__ == "__main__":
    quiet_secondary_ranks()
    check_command_line("evaluate")
    main()
