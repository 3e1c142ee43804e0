"""The README stays true: every `python -m hybridrec.train` / `hybridrec.plan` command in its
code blocks composes with today's configs and passes validation (a renamed key or option fails
here), and every error sample it shows for a config is the line the code prints."""

from __future__ import annotations

import itertools
import os
import re
import shlex

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import IntervalSweep
from hydra.errors import HydraException
from omegaconf import open_dict

from conftest import compose_cfg

README = os.path.join(os.path.dirname(__file__), "..", "README.md")
APPS = ("hybridrec.train", "hybridrec.plan", "hybridrec.evaluate")
# Samples whose line depends on files or checkpoints: tests/test_failures.py and
# tests/test_checkpoint.py write those and check the same lines.
NEEDS_FILES = ("data.train_path=", "checkpoint.", "data.bad_rows=fail")


def readme_commands() -> list[tuple[str, list[str], str]]:
    """(app, arguments, the first output line shown after a `$ ` command, or "")."""
    found = []
    for block in re.findall(r"^ *```[a-z]*\n(.*?)^ *```", open(README).read(), flags=re.S | re.M):
        lines = block.replace("\\\n", " ").splitlines()
        for i, line in enumerate(lines):
            m = re.search(r"python -m (hybridrec\.\w+)(.*)", line)
            command = re.split(r"\s+#", m.group(2))[0] if m else ""
            if not m or m.group(1) not in APPS or "<" in command:  # <placeholders> are not commands
                continue
            if "--config-dir" in command:  # options in a directory a conversion writes: tests/test_convert.py runs it
                continue
            args = shlex.split(command)
            after = lines[i + 1].strip() if i + 1 < len(lines) and line.lstrip().startswith("$ ") else ""
            found.append((m.group(1), args, "" if after.startswith("$ ") else after))
    return found


COMMANDS = readme_commands()


def _jobs(args: list[str]) -> list[list[str]]:
    """The overrides of each job a command runs (a -m sweep runs one per combination)."""
    overrides = [a for a in args if a not in ("-m", "--multirun") and not a.startswith("--")]
    parsed = OverridesParser.create().parse_overrides(overrides)
    # a search sweeper's interval has no values to list: its two ends stand for it
    choices = [[o.input_line] if not o.is_sweep_override() else
               [f"{o.get_key_element()}={v}" for v in (o.value().start, o.value().end)]
               if isinstance(o.value(), IntervalSweep) else
               [f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()] for o in parsed]
    return [list(job) for job in itertools.product(*choices)]


def _check(app: str, overrides: list[str]) -> None:
    """Compose as the command does, and validate for the ranks it would start (raises the
    ValueError whose message the command prints)."""
    from hybridrec.config import overrides as command_line
    from hybridrec.config.validation import validate

    command_line.check(overrides, "evaluate" if app == "hybridrec.evaluate" else "config")  # before Hydra, as the CLI
    hydra_keys = any(o.startswith("hydra") for o in overrides)
    if app == "hybridrec.evaluate":  # its own config; the checkpoint's is read at run time
        compose_cfg(overrides, config_name="evaluate")
        return
    cfg = compose_cfg(overrides, hydra_keys=hydra_keys)
    world = cfg.launcher.nproc_per_node
    if app == "hybridrec.plan" and cfg.topology.world_size is not None:
        world = cfg.topology.world_size
    if hydra_keys:  # a submitit sweep: nodes x ranks per node, as hybridrec.launch counts them
        world *= cfg.hydra.launcher.get("nodes", 1) or 1
        with open_dict(cfg):
            del cfg["hydra"]
    validate(cfg, world)


CONFIG_ERRORS = [c for c in COMMANDS if c[2] and not any(k in " ".join(c[1]) for k in NEEDS_FILES)]


@pytest.mark.unit
@pytest.mark.parametrize("app,args", [c[:2] for c in COMMANDS if not c[2]],
                         ids=[" ".join(c[1])[:90] for c in COMMANDS if not c[2]])
def test_readme_commands_compose_and_validate(app, args):
    for job in _jobs(args):
        _check(app, job)


@pytest.mark.unit
@pytest.mark.parametrize("app,args,shown", CONFIG_ERRORS, ids=[" ".join(c[1])[:90] for c in CONFIG_ERRORS])
def test_readme_error_samples_are_the_lines_printed(app, args, shown):
    from hybridrec.errors import user_message

    with pytest.raises((ValueError, HydraException)) as e:
        for job in _jobs(args):
            _check(app, job)
    if shown.startswith("hybridrec: invalid launcher config:"):  # the submitit callback's wording
        assert shown == f"hybridrec: invalid launcher config: {e.value}"
    elif shown.startswith("hybridrec:"):
        assert shown == user_message(e.value)
    else:  # Hydra's own composition error: its first line
        assert str(e.value).splitlines()[0].strip() == shown or shown in str(e.value)


@pytest.mark.unit
def test_the_readme_has_commands_and_error_samples():
    assert len(COMMANDS) > 30 and len(CONFIG_ERRORS) >= 4
