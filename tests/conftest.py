import copy
import json
import os
import sys
import warnings

# Before torch is imported (OpenMP reads it then), here and in every process the suite starts:
# `make test` runs two test files at once, each starting ranks and commands of its own, on
# as many cores. One intra-op thread per process, as torchrun gives each rank: with torch's
# default (every core per process) their OpenMP teams spun against each other, and a 2-rank
# test file took 1.8 times as long (measured on 2 busy cores). A value the user sets stays.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402  (after the path of the tests' helpers, or the environment, is set)
import torch  # noqa: E402  (after the path of the tests' helpers, or the environment, is set)
from hydra import compose, initialize_config_dir  # noqa: E402  (after the path of the tests' helpers, or the environment, is set)
from hydra.core.global_hydra import GlobalHydra  # noqa: E402  (after the path of the tests' helpers, or the environment, is set)
from omegaconf import DictConfig  # noqa: E402  (after the path of the tests' helpers, or the environment, is set)

from hybridrec.config import register_configs  # noqa: E402  (after the path of the tests' helpers, or the environment, is set)

CONF_DIR = os.path.join(os.path.dirname(__file__), "..", "hybridrec", "conf")
# Make the test helpers importable by the ranks that elastic_launch spawns.
sys.path.insert(0, os.path.dirname(__file__))

from shared import TWO_NODE_RUN, tables  # noqa: E402  (needs the path above)

register_configs()

# Every test belongs to exactly one tier (see [tool.pytest.ini_options] markers), so that
# `-m unit` is the fast in-process suite and `-m "not dist"` starts no ranks.
TIERS = ("unit", "dist", "slow", "gpu")
# `make test-gpu` runs the 2-rank suites on NCCL: HYBRIDREC_TEST_DEVICE=cuda (tests/shared.BASE).
ON_CUDA = os.environ.get("HYBRIDREC_TEST_DEVICE") == "cuda"


def pytest_collection_modifyitems(config, items):
    wrong = []
    gpus = torch.cuda.device_count() if ON_CUDA and torch.cuda.is_available() else 0
    for item in items:
        tiers = sorted({m.name for m in item.iter_markers() if m.name in TIERS})
        if len(tiers) != 1:
            wrong.append(f"  {item.nodeid}: {', '.join(tiers) or 'no tier'}")
        elif ON_CUDA and tiers == ["dist"] and gpus < 2:
            item.add_marker(pytest.mark.skip(reason=f"HYBRIDREC_TEST_DEVICE=cuda needs 2+ CUDA GPUs, {gpus} visible"))
    if wrong:
        raise pytest.UsageError(
            "each test needs exactly one of the markers "
            + ", ".join(TIERS)
            + " (module `pytestmark` or a decorator):\n"
            + "\n".join(wrong)
        )


_COMPOSED: dict[tuple, DictConfig] = {}
_CHOSEN: dict[tuple, DictConfig] = {}  # the config of a set of group choices, before any value override


def compose_cfg(overrides: list[str] = (), config_name: str = "config", hydra_keys: bool = False) -> DictConfig:
    """The config `python -m hybridrec.train <overrides>` would see (``config_name="evaluate"``:
    `python -m hybridrec.evaluate`'s; ``hydra_keys``: with the ``hydra`` node, launcher included).

    Hydra is initialized once per process and kept (not as a context manager): its config
    repository then caches the parsed YAML, and the suite composes several hundred configs.
    Each distinct command line is composed once per process and handed out as a copy (a test
    may change its copy). Composing is mostly choosing the defaults tree (a fifth of a second
    each), which depends on the group choices only (``+experiment=ctr``, ``model=dcn``): each
    set of choices is composed once, and the value overrides (``train.steps=10``) are then
    applied to a copy of it by Hydra's own step (``ConfigLoaderImpl._apply_overrides_to_config``,
    which a full compose runs after the tree, in struct mode, as here), with its errors."""
    key = (tuple(overrides), config_name, hydra_keys)
    if key not in _COMPOSED:
        if not GlobalHydra.instance().is_initialized():
            initialize_config_dir(config_dir=os.path.abspath(CONF_DIR), version_base="1.3")
        if hydra_keys:
            _COMPOSED[key] = compose(config_name=config_name, overrides=list(overrides), return_hydra_config=True)
        else:
            _COMPOSED[key] = _compose_by_choices(list(overrides), config_name)
    return copy.deepcopy(_COMPOSED[key])


def _compose_by_choices(overrides: list[str], config_name: str) -> DictConfig:
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.override_parser.overrides_parser import OverridesParser

    repo = GlobalHydra.instance().hydra.config_loader.repository
    choices, values = [], []
    for o in OverridesParser.create().parse_overrides(overrides):
        if o.is_sweep_override() or o.key_or_group.lstrip("~+").startswith("hydra"):
            choices.append(o)  # as a full compose takes them (the hydra node is dropped after)
        elif isinstance(o.value(), dict) or not repo.group_exists(o.key_or_group):  # Hydra's own rule
            values.append(o)
        else:
            choices.append(o)
    key = (tuple(o.input_line for o in choices), config_name)
    if key not in _CHOSEN:
        _CHOSEN[key] = compose(config_name=config_name, overrides=list(key[0]))
    cfg = copy.deepcopy(_CHOSEN[key])
    ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
    return cfg


@pytest.fixture
def cfg_factory():
    return compose_cfg


@pytest.fixture(scope="module")
def ml400(tmp_path_factory):
    """A MovieLens-100k layout of 400 ratings, written once per test module."""
    from hybridrec.data.fetch_movielens import write_layout

    out = tmp_path_factory.mktemp("ml") / "ml"
    write_layout(tables(n_ratings=400), str(out))
    return out


@pytest.fixture
def layout(tmp_path):
    """A tiny MovieLens-100k layout (20 users, 30 movies, 300 ratings) in the official format."""
    from hybridrec.data.fetch_movielens import write_layout

    out = tmp_path / "ml"
    write_layout(tables(), str(out))
    return out


@pytest.fixture(scope="session")
def one_node_losses(tmp_path_factory):
    """Per-step losses of TWO_NODE_RUN on one node with 2 ranks (the elastic launcher), the
    reference of every multi-node launch: trained once per test run, whichever test process
    asks first. Its subject is not the process start-up: forked from the preloaded command
    server."""
    import commands
    from trained import once

    def build(path):
        proc = commands.run(
            "hybridrec.train", *TWO_NODE_RUN, "launcher.nproc_per_node=2", f"hydra.run.dir={path}", timeout=240
        )
        assert proc.returncode == 0, f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-8000:]}"

    run = once(tmp_path_factory, "one-node-losses", build)
    return [r["loss"] for r in map(json.loads, open(run / "metrics.jsonl")) if "loss" in r]


@pytest.fixture(autouse=True)
def _quiet_library_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield


def dry_plan_for(cfg: DictConfig, world: int, local: int, device: str) -> dict:
    """hybridrec.plan's dry plan of ``cfg`` for ``world`` ranks, ``local`` per node."""
    from hybridrec.parallel.parallel_dims import ParallelDims
    from hybridrec.run.preflight import dry_plan

    return dry_plan(cfg, ParallelDims.build(cfg.mesh, world, local, device), detect=False)
