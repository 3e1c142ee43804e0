import os
import sys
import warnings

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from hybridrec.config import register_configs

CONF_DIR = os.path.join(os.path.dirname(__file__), "..", "hybridrec", "conf")
# Make the test helpers importable by the ranks that elastic_launch spawns.
sys.path.insert(0, os.path.dirname(__file__))

register_configs()


def compose_cfg(overrides: list[str] = ()) -> DictConfig:
    """The config `python -m hybridrec.train <overrides>` would see."""
    with initialize_config_dir(config_dir=os.path.abspath(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.fixture
def cfg_factory():
    return compose_cfg


@pytest.fixture(autouse=True)
def _quiet_library_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield


def dry_plan_for(cfg: DictConfig, world: int, local: int, device: str) -> dict:
    """hybridrec.plan's dry plan of ``cfg`` for ``world`` ranks, ``local`` per node."""
    from hybridrec.parallel_dims import ParallelDims
    from hybridrec.plan import dry_plan

    return dry_plan(cfg, ParallelDims.build(cfg.mesh, world, local, device), detect=False)
