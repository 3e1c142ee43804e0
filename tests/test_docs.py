"""The README and the guides in docs/ stay true: every `python -m hybridrec.train` /
`hybridrec.plan` / `hybridrec.evaluate` command in their code blocks composes with today's
configs and passes validation (a renamed key or option fails here), every error sample they
show for a config is the line the code prints, every link reaches a page and a heading that
exist, the guides build as a site without a warning, and the quick start is what `make demo`
runs."""

from __future__ import annotations

import importlib.util
import itertools
import os
import re
import shlex
import subprocess
import sys

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import IntervalSweep
from hydra.errors import HydraException
from omegaconf import open_dict

from conftest import compose_cfg
from shared import benchmark_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
DOCS = os.path.join(ROOT, "docs")
PAGES = [README] + sorted(os.path.join(DOCS, n) for n in os.listdir(DOCS) if n.endswith(".md"))
APPS = ("hybridrec.train", "hybridrec.plan", "hybridrec.evaluate")
# Samples whose line depends on files or checkpoints: tests/test_failures.py and
# tests/test_checkpoint.py write those and check the same lines.
NEEDS_FILES = ("data.train_path=", "checkpoint.", "data.bad_rows=fail")


def code_blocks(path: str) -> list[str]:
    return re.findall(r"^ *```[a-z]*\n(.*?)^ *```", open(path).read(), flags=re.S | re.M)


def readme_commands() -> list[tuple[str, list[str], str]]:
    """(app, arguments, the first output line shown after a `$ ` command, or "") of every page."""
    found = []
    for block in [b for page in PAGES for b in code_blocks(page)]:
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
    choices = [
        [o.input_line]
        if not o.is_sweep_override()
        else [f"{o.get_key_element()}={v}" for v in (o.value().start, o.value().end)]
        if isinstance(o.value(), IntervalSweep)
        else [f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()]
        for o in parsed
    ]
    return [list(job) for job in itertools.product(*choices)]


def _check(app: str, overrides: list[str]) -> None:
    """Compose as the command does, and validate for the ranks it would start (raises the
    ValueError whose message the command prints)."""
    from hybridrec.config import overrides as command_line
    from hybridrec.run.validation import validate

    config_name = "evaluate" if app == "hybridrec.evaluate" else "config"
    hydra_keys = any(o.startswith("hydra") for o in overrides)
    try:
        cfg = compose_cfg(overrides, config_name=config_name, hydra_keys=hydra_keys)
    except HydraException:
        # The command checks its overrides before Hydra composes them (and says what a mistyped
        # key or option should be); it composes them only to find why they fail, so it is
        # asked here only then: its line, or Hydra's own error.
        command_line.check(overrides, config_name)
        raise
    if app == "hybridrec.evaluate":  # its own config; the checkpoint's is read at run time
        return
    world = cfg.launcher.nproc_per_node
    if app == "hybridrec.plan" and cfg.topology.world_size is not None:
        world = cfg.topology.world_size
    if hydra_keys:  # a submitit sweep: nodes x ranks per node, as hybridrec.run.launch counts them
        world *= cfg.hydra.launcher.get("nodes", 1) or 1
        with open_dict(cfg):
            del cfg["hydra"]
    validate(cfg, world)


CONFIG_ERRORS = [c for c in COMMANDS if c[2] and not any(k in " ".join(c[1]) for k in NEEDS_FILES)]


def _tier(args: list[str]):
    """unit, or slow for a sweep of more than 4 jobs (each composed: seconds)."""
    return pytest.mark.slow if len(_jobs(args)) > 4 else pytest.mark.unit


@pytest.mark.parametrize(
    "app,args", [pytest.param(*c[:2], marks=_tier(c[1]), id=" ".join(c[1])[:90]) for c in COMMANDS if not c[2]]
)
def test_readme_commands_compose_and_validate(app, args):
    for job in _jobs(args):
        _check(app, job)


@pytest.mark.unit
@pytest.mark.parametrize("app,args,shown", CONFIG_ERRORS, ids=[" ".join(c[1])[:90] for c in CONFIG_ERRORS])
def test_readme_error_samples_are_the_lines_printed(app, args, shown):
    from hybridrec.run.errors import user_message

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


def _slugs(path: str) -> set[str]:
    """The anchors of a page's headings, as mkdocs makes them (Python-Markdown's toc slugify;
    GitHub's agrees on these headings: lower case, punctuation dropped, spaces to hyphens)."""
    from markdown.extensions.toc import slugify

    text = re.sub(r"^ *```.*?^ *```", "", open(path).read(), flags=re.S | re.M)  # '#' lines in code are not headings
    return {slugify(re.sub(r"[`*]", "", h), "-") for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def _links(path: str) -> list[str]:
    text = re.sub(r"^ *```.*?^ *```", "", open(path).read(), flags=re.S | re.M)
    text = re.sub(r"`[^`\n]*`", "", text)  # a link inside inline code is text
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.unit
@pytest.mark.parametrize("page", PAGES, ids=[os.path.relpath(p, ROOT) for p in PAGES])
def test_links_reach_a_file_and_a_heading(page):
    dead = []
    for link in _links(page):
        if re.match(r"[a-z]+://", link):
            continue  # the web is not checked here
        target, _, anchor = link.partition("#")
        file = os.path.normpath(os.path.join(os.path.dirname(page), target)) if target else page
        if not os.path.exists(file):
            dead.append(f"{link}: no file {os.path.relpath(file, ROOT)}")
        elif anchor and anchor not in _slugs(file):
            dead.append(f"{link}: no heading #{anchor} in {os.path.relpath(file, ROOT)}")
    assert not dead, dead


@pytest.mark.unit
def test_every_guide_is_in_the_site_and_linked_from_the_readme():
    import yaml

    nav = [list(entry.values())[0] for entry in yaml.safe_load(open(os.path.join(ROOT, "mkdocs.yml")))["nav"]]
    guides = sorted(os.path.basename(p) for p in PAGES[1:])
    assert sorted(nav) == guides
    linked = {os.path.basename(link.partition("#")[0]) for link in _links(README) if link.startswith("docs/")}
    assert set(guides) - {"index.md"} <= linked, set(guides) - linked


@pytest.mark.unit
def test_the_readme_is_a_front_page():
    assert len(open(README).read().splitlines()) <= 300


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="mkdocs is not installed (make install adds it)")
def test_the_guides_build_as_a_site_without_a_warning(tmp_path):
    """mkdocs --strict fails on a link to a missing page or heading, and on a page left out
    of the navigation; the site opens from disk, offline."""
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # it works from disk and offline: pages are files, and nothing is fetched from the network
    assert os.path.isfile(tmp_path / "continuous.html")
    pages = {p: open(tmp_path / p).read() for p in os.listdir(tmp_path) if p.endswith(".html")}
    remote = {p: re.findall(r'(?:src|href)="(https?://[^"]+\.(?:js|css)[^"]*)"', html) for p, html in pages.items()}
    assert not any(remote.values()), {p: r for p, r in remote.items() if r}
    assert 'href="install.html"' in pages["index.html"]


@pytest.mark.unit
def test_the_quick_start_is_what_make_demo_runs():
    benchmark_script("common")  # what demo.py imports by name
    demo = benchmark_script("demo")
    quick = open(README).read().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    steps = re.findall(r"```bash\n(.*?)```", quick, flags=re.S)[1]  # the block after `make demo`'s
    shown = [line.split("  #")[0].strip() for line in steps.splitlines()]
    # the same commands, into a directory of their own (typed after the demo, they start afresh)
    assert shown == [command.replace(demo.DEMO, "outputs/quickstart") for _, command, _ in demo.COMMANDS]
    assert "demo: install" in open(os.path.join(ROOT, "Makefile")).read()


@pytest.mark.unit
def test_the_config_group_table_lists_every_option_help_lists():
    """training.md's table of config groups names every option of each group, as
    ``python -m hybridrec.train --help`` lists them (Hydra's config loader, the help's source)."""
    from hydra.core.global_hydra import GlobalHydra

    compose_cfg([])  # Hydra initialized over hybridrec's config tree
    loader = GlobalHydra.instance().config_loader()
    text = open(os.path.join(DOCS, "training.md")).read()
    rows = dict(re.findall(r"^\| `([a-z/_]+)` \| (.*)$", text, flags=re.M))
    groups = [
        "model",
        "loss",
        "data",
        "sharding",
        "optimizer",
        "optimizer/sparse",
        "optimizer/dense",
        "mesh",
        "topology",
        "hydra/launcher",
        "experiment",
    ]
    missing = {}
    for group in groups:
        row = rows.get(group) or rows.get(group.split("/")[0], "")  # optimizer's sub-groups share its row
        named = set(re.findall(r"`([a-z0-9_]+)`", row))
        if gone := sorted(set(loader.get_group_options(group)) - named):
            missing[group] = gone
    assert not missing, f"docs/training.md's config group table lacks {missing}"


@pytest.mark.unit
def test_make_docs_check_runs_every_guide_command_or_says_why_not():
    """benchmarks/docs_check.py (``make docs-check``) finds every page's bash commands, in the
    README's order of the guides, and skips only commands its SKIP list names a reason for;
    each of those reasons still matches a command (none stale), and no quick-start command is
    skipped."""
    benchmark_script("common")  # what docs_check.py imports by name
    check = benchmark_script("docs_check")
    pages = check.pages()
    assert pages[0] == "README.md" and sorted(pages) == sorted(os.path.relpath(p, ROOT) for p in PAGES)
    commands = [(p, c) for p in pages for c in check.commands(p)]
    assert len(commands) > 40 and not any(c.lstrip().startswith("#") or c.endswith("\\") for _, c in commands)
    skipped = [c for _, c in commands if check.skip_reason(c)]
    for pattern, _ in check.SKIP:
        assert any(re.search(pattern, re.split(r"\s+#", c)[0]) for c in skipped), f"stale skip: {pattern}"
    assert not any(check.skip_reason(c) for c in check.commands("README.md")[:4])
