"""Dry-run planning: ``python -m hybridrec.plan +experiment=NAME topology.world_size=64 ...``.

Plans the embedding tables for a simulated topology with the same planner, constraints and
storage reservation as a real run, prints the plan report, saves ``plan.json`` in the Hydra
run directory and exits: no GPU, no process group. The plan is ``preflight.dry_plan``, the
one every command runs for its own topology before its ranks start.
"""

from __future__ import annotations

import logging
import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from hybridrec.config import register_configs
from hybridrec.parallel.parallel_dims import planning_dims
from hybridrec.parallel.sharding import format_report
from hybridrec.reports.logs import hydra_verbose, quiet_libraries
from hybridrec.reports.runlog import write_json
from hybridrec.run.preflight import dry_plan
from hybridrec.run.validation import validate

register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    verbose = hydra_verbose()
    if verbose is not True:
        logging.getLogger().setLevel(logging.WARNING)  # the plan report is printed; libraries log at INFO
    quiet_libraries(verbose)  # hydra.verbose=torchrec.distributed.planner shows TorchRec's planner lines
    try:
        # "is None", not "or": a 0 given is refused by validate, not read as unset
        validate(cfg, cfg.topology.world_size if cfg.topology.world_size is not None else cfg.launcher.nproc_per_node)
        report = dry_plan(cfg, planning_dims(cfg), detect=False)
    except ValueError as e:  # PlanError included
        sys.exit(f"hybridrec.plan: {e}")
    path = os.path.join(HydraConfig.get().runtime.output_dir, "plan.json")
    write_json(path, report)
    print(format_report(report))
    print(f"hybridrec.plan: saved {os.path.abspath(path)}")


if __name__ == "__main__":
    main()
