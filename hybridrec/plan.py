"""Dry-run planning: ``python -m hybridrec.plan +experiment=NAME mesh.world_size=64 ...``.

Plans the embedding tables for a simulated topology with the same planner, constraints and
storage reservation as a real run, prints the plan report, saves ``plan.json`` in the Hydra
run directory and exits: no GPU, no process group. ``train.py`` uses the same function to
check, before any rank starts, that the run's own topology has a plan.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Optional

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from hybridrec.config import register_configs, validate
from hybridrec.data import build_source
from hybridrec.data.source import Source
from hybridrec.logs import hydra_verbose, quiet_libraries
from hybridrec.metrics import write_json
from hybridrec.models import build_model
from hybridrec.parallel_dims import ParallelDims, planning_dims
from hybridrec.sharding import HybridEBCSharder, format_report, plan_tables

register_configs()


def dry_plan(cfg: DictConfig, dims: ParallelDims, detect: bool, data: Optional[Source] = None) -> dict[str, Any]:
    """Plan ``cfg``'s tables for the given topology without any process group. ``detect``:
    take unset memory sizes from this machine (the check before a run here) rather than
    TorchRec's defaults (planning for another cluster). ``data``: the source, when the
    caller has built it already."""
    data = data or build_source(cfg.data, cfg.seed)
    model = build_model(cfg, data.features, data.num_dense_features, data.list_size)
    pooling = {f.name: f.pooling_factor for f in data.features}
    _, report = plan_tables(model, cfg, HybridEBCSharder(), dims, pooling, detect=detect)
    return report


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    verbose = hydra_verbose()
    if verbose is not True:
        logging.getLogger().setLevel(logging.WARNING)  # the plan report is printed; libraries log at INFO
    quiet_libraries(verbose)  # hydra.verbose=torchrec.distributed.planner shows TorchRec's planner lines
    try:
        # "is None", not "or": a 0 given is refused by validate, not read as unset
        validate(cfg, cfg.mesh.world_size if cfg.mesh.world_size is not None else cfg.launcher.nproc_per_node)
        report = dry_plan(cfg, planning_dims(cfg), detect=False)
    except ValueError as e:  # PlanError included
        sys.exit(f"hybridrec.plan: {e}")
    path = os.path.join(HydraConfig.get().runtime.output_dir, "plan.json")
    write_json(path, report)
    print(format_report(report))
    print(f"hybridrec.plan: saved {os.path.abspath(path)}")


if __name__ == "__main__":
    main()
