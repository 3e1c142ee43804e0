"""Command-line overrides checked before Hydra composes them, for the mistakes Hydra answers
with the wrong advice: a mistyped key (``train.stpes=100``: Hydra suggests appending it with
``+train.stpes=100``, which only moves the error) and a mistyped group option
(``sharding=rowwise``: Hydra lists the options among its config search path). Each becomes
one line with the nearest name (``difflib``, as ``retype.refuse_key`` words unknown keys). A
value its schema refuses (``loss.average=tokens``, ``train.steps=abc``: Hydra prints
OmegaConf's error over several lines, with the schema's class names) becomes one line with
what the key accepts.

``check(overrides)`` composes the config the way the entry point will (Hydra's compose API:
the same config tree, the same grammar), and only when that fails looks at why; anything it
does not recognize is left to Hydra's own report.
"""

from __future__ import annotations

import os
import re
from typing import Optional

from omegaconf import DictConfig

from hybridrec.config.retype import nearest, refuse_key

_KEY = re.compile(r"Could not override '([^']+)'")
_OPTION = re.compile(r"Could not find '([^']+)/([^'/]+)'")
_VALUE = re.compile(r"^Error merging override ([^=\s]+)=(.*)$")


def check(overrides: list[str], config_name: str = "config") -> None:
    """Raise a ValueError (one line, the nearest name) when ``overrides`` mistype a key or a
    group option; return quietly otherwise, whatever else Hydra may say about them."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException

    from hybridrec.config.schema import CONF_DIR

    # hydra.* overrides are Hydra's, except the search path: it adds the places group options
    # come from (a converted dataset's conf/data/), and without it those options look unknown
    mine = [
        o for o in overrides if not o.lstrip("+~").startswith("hydra") or o.lstrip("+~").startswith("hydra.searchpath")
    ]
    if GlobalHydra.instance().is_initialized():  # a test's, or a caller's: composed in it
        _explain(compose, config_name, mine, HydraException, CONF_DIR)
    else:
        with initialize_config_dir(config_dir=os.path.abspath(CONF_DIR), version_base="1.3"):
            _explain(compose, config_name, mine, HydraException, CONF_DIR)


def _explain(compose, config_name: str, mine: list[str], errors: type[BaseException], conf_dir: str) -> None:
    error = _compose(compose, config_name, mine, errors)
    if error is None:
        return
    if m := _KEY.search(error):
        key = m.group(1)
        parent, _, name = key.rpartition(".")
        rest = [o for o in mine if o.split("=", 1)[0] != key]
        node = _node(compose, config_name, rest, parent, errors)
        if isinstance(node, DictConfig):
            refuse_key(name, [str(k) for k in node.keys()], parent)
    elif (m := _VALUE.match(error.split("\n", 1)[0])) and "\n" in error:
        why = error.split("\n", 2)[1].strip()  # OmegaConf's first line: the value and what is accepted
        raise ValueError(f"{m.group(1)}={m.group(2)}: {why[:1].lower()}{why[1:]}")
    elif m := _OPTION.search(error):
        group, option = m.group(1), m.group(2)
        folders = [os.path.join(d, group) for d in [conf_dir, *_search_path(mine)]]
        if os.path.isdir(folders[0]) and not group.startswith(
            ("schema", "experiment_")  # the experiment_<group> specializations: internal
        ):
            options = sorted(
                {f[:-5] for d in folders if os.path.isdir(d) for f in os.listdir(d) if f.endswith(".yaml")}
            )
            near = [n] if (n := nearest(option, options)) else []
            key = group.replace("/", ".") if group != "experiment" else "+experiment"
            raise ValueError(
                f"{key}={option} is not an option of {group}"
                + (f" (did you mean {key}={near[0]}?)" if near else "")
                + f": the options are {', '.join(options)}"
            )


def _search_path(overrides: list[str]) -> list[str]:
    """The folders a ``hydra.searchpath=[file://...]`` override adds."""
    out = []
    for o in overrides:
        key, _, value = o.lstrip("+~").partition("=")
        if key == "hydra.searchpath":
            out += [
                p.strip()[len("file://") :] for p in value.strip("[]").split(",") if p.strip().startswith("file://")
            ]
    return out


def _compose(compose, config_name: str, overrides: list[str], errors: type[BaseException]) -> Optional[str]:
    try:
        compose(config_name=config_name, overrides=overrides)
    except errors as e:  # with the cause's message: a refused value's reason is there
        return str(e) + (f"\n{e.__cause__}" if e.__cause__ is not None else "")
    return None


def _node(compose, config_name: str, overrides: list[str], path: str, errors: type[BaseException]) -> Optional[object]:
    """The node at ``path`` of the config composed with ``overrides`` (None if that fails)."""
    try:
        cfg = compose(config_name=config_name, overrides=overrides)
    except errors:
        return None
    node = cfg
    for part in [p for p in path.split(".") if p]:
        if not isinstance(node, DictConfig) or part not in node:
            return None
        node = node[part]
    return node
