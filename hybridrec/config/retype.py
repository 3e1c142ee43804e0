"""A config saved as plain YAML (a checkpoint's ``config.yaml``) under hybridrec's schemas
again, and the classes such a config may name in a ``_target_`` (``shipped_targets``)."""

from __future__ import annotations

import difflib
import glob
import os
from dataclasses import fields
from typing import NoReturn, Optional, cast

import yaml
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ValidationError

from hybridrec.config.schema import (
    CONF_DIR,
    CheckpointConfig,
    Device,
    HybridrecConfig,
    OptimizerConfig,
    register_configs,
)

# Config groups whose node names the class it configures (`_target_`): a config saved as
# plain YAML is typed again by the schema registered for that class (``typed``).
TARGET_GROUPS = {
    "model": "model",
    "loss": "loss",
    "data": "data",
    "optimizer.sparse": "optimizer/sparse",
    "optimizer.dense": "optimizer/dense",
}
# Classes that moved: a config saved before the move names them by their old module. Only
# these exact prefixes are rewritten, at the loss node only (where the losses moved from
# ``hybridrec.losses`` into the models package); the result is checked like any target.
MOVED_TARGETS = {"loss": {"hybridrec.losses.": "hybridrec.models.losses."}}


def renamed_targets(saved: DictConfig) -> DictConfig:
    """``saved`` with each ``_target_`` of a moved class (``MOVED_TARGETS``) named by its
    module now, in place; returns ``saved``."""
    for path, moves in MOVED_TARGETS.items():
        target = OmegaConf.select(saved, f"{path}._target_")
        for old, new in moves.items():
            if isinstance(target, str) and target.startswith(old):
                OmegaConf.update(saved, f"{path}._target_", new + target[len(old) :])
    return saved


def shipped_targets() -> dict[str, frozenset[str]]:
    """For each ``_target_`` node of a config (``TARGET_GROUPS``), the classes hybridrec's
    config groups offer there: every registered schema's ``_target_`` and every option
    YAML's (a loss option has the generic schema and names its class in YAML). What a
    checkpoint's ``config.yaml`` may instantiate without the user trusting more."""
    register_configs()
    cs = ConfigStore.instance()
    shipped = {}
    for path, group in TARGET_GROUPS.items():
        names = set()
        for name in cs.list(f"schema/{group}"):
            node = cs.load(f"schema/{group}/{name}").node
            if not OmegaConf.is_missing(node, "_target_"):
                names.add(str(node._target_))
        for file in glob.glob(os.path.join(CONF_DIR, *group.split("/"), "*.yaml")):
            with open(file) as f:
                option = yaml.safe_load(f) or {}
            if isinstance(option.get("_target_"), str):
                names.add(option["_target_"])
        shipped[path] = frozenset(names)
    return shipped


def group_schema(group: str, target: Optional[str]) -> Optional[DictConfig]:
    """The schema registered under ``schema/<group>`` (ConfigStore) for the class ``target``:
    a loss without fields of its own gets the generic ``loss`` schema; None when no schema
    names that class (the node then stays untyped)."""
    cs = ConfigStore.instance()
    generic = None
    for name in cs.list(f"schema/{group}"):
        node = cs.load(f"schema/{group}/{name}").node
        if OmegaConf.is_missing(node, "_target_"):
            generic = node
        elif node._target_ == target:
            return node
    return generic


def typed(saved: DictConfig) -> DictConfig:
    """A config saved as plain YAML (a checkpoint's ``config.yaml``) under hybridrec's schemas
    again: enums, optional fields and types as the run that saved it had them.

    ``config.yaml`` holds values, not the group choices that typed them (``data=criteo``),
    so each node of ``TARGET_GROUPS`` takes the schema registered for the class its
    ``_target_`` names. A ValueError names a key that no schema knows (with the nearest
    known key) or a value that does not fit its type."""
    schema = OmegaConf.structured(HybridrecConfig)
    schema.optimizer = OptimizerConfig()  # (MISSING in the schema: the parent of two typed nodes)
    for path, group in TARGET_GROUPS.items():
        node = OmegaConf.select(saved, path)
        if isinstance(node, DictConfig) and "_target_" in node:
            OmegaConf.update(schema, path, typed_node(group_schema(group, node._target_), node, path), merge=False)
    # a config's keys are strings (OmegaConf types a key as any DictKeyType)
    rest = OmegaConf.masked_copy(
        saved, cast("list[str]", [k for k in saved if k not in ("model", "loss", "data", "optimizer")])
    )
    if "optimizer" in saved:
        rest.optimizer = {k: v for k, v in saved.optimizer.items() if k not in ("sparse", "dense")}
    return _merge(schema, rest, "")


def evaluation_config(saved: DictConfig, ev: DictConfig, data_option: bool) -> DictConfig:
    """The config the ranks of ``python -m hybridrec.evaluate`` run: the checkpoint's
    ``saved`` config, typed again, with the evaluation's data and launcher.

    Data: the checkpoint's data config changed by the keys of ``ev.data``, or with
    ``data_option`` (``data=<option>`` given) that option's config as composed. The training
    job's topology (topology.world_size, local_world_size, compute_device) is unset: the
    evaluation plans the tables for its own ranks. Nothing is saved or resumed."""
    cfg = typed(saved)
    data = ev.data if data_option else cast(DictConfig, OmegaConf.merge(saved.data, ev.data))  # two mappings merged
    if "_target_" not in data:
        raise ValueError("data._target_ is not set: data=<option> names a source, or leave data as the checkpoint's")
    cfg.data = typed_node(group_schema("data", data._target_), data, "data")
    cfg.launcher = ev.launcher
    cfg.topology.world_size = cfg.topology.local_world_size = None
    cfg.topology.compute_device = Device.auto
    cfg.checkpoint = CheckpointConfig(dir=None, resume="never")
    cfg.profile.enabled = False
    return cfg


def typed_node(schema: Optional[DictConfig], values: DictConfig, path: str) -> DictConfig:
    """``values`` merged onto ``schema`` (None: left untyped), each key checked first."""
    if schema is None:
        return values
    schema_type = OmegaConf.get_type(schema)
    assert schema_type is not None  # a registered schema is a structured config: its dataclass
    known = [f.name for f in fields(schema_type)]
    for key in values:
        if key not in known:
            refuse_key(str(key), known, path)
    return _merge(schema, values, path)


def _merge(schema: DictConfig, values: DictConfig, path: str) -> DictConfig:
    try:
        return cast(DictConfig, OmegaConf.merge(schema, values))  # mappings merged: a mapping
    except ValidationError as e:  # a value of the wrong type: OmegaConf names the key
        where = ".".join(k for k in (path, str(e.full_key or e.key or "")) if k)
        raise ValueError(f"{where}: {str(e).splitlines()[0]}") from None


def nearest(name: str, names: list[str]) -> Optional[str]:
    """The closest of ``names`` to a mistyped ``name``, case aside (``DLRM`` is ``dlrm``)."""
    lower = {n.lower(): n for n in names}
    near = difflib.get_close_matches(name.lower(), list(lower), n=1)
    return lower[near[0]] if near else None


def refuse_key(key: str, names: list[str], path: str) -> NoReturn:
    near = [n] if (n := nearest(key, names)) else []
    where = f"{path}." if path else ""
    raise ValueError(
        f"unknown key {where}{key}{f' (did you mean {where}{near[0]}?)' if near else ''}: "
        f"the keys of {path or 'the top level'} are {', '.join(n for n in names if not n.startswith('_'))}"
    )
