"""The package's layout holds: every module in a package named for its job, each package
importing only the layers below it (as its ``__init__`` says), no import cycle between
hybridrec's modules, no benchmark script that edits sys.path, and TorchRec's and torch's
private attributes only in compat.py."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

pytestmark = pytest.mark.unit

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hybridrec"


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _imports(path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The hybridrec modules ``path`` imports anywhere (a function's import too: an import
    deferred to run time is still a cycle), except under ``if TYPE_CHECKING``."""
    found = set()
    tree = ast.parse(path.read_text())
    skip = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hybridrec"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("hybridrec")}
    return found & modules.keys()


def test_no_import_cycles():
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for m, p in modules.items():
        targets = set()
        for t in _imports(p, modules) - {m}:
            targets.add(t)
            # Importing a.b.c runs a/__init__ and a/b/__init__ first: an edge to each package,
            # except the packages the importer is inside (already being imported; a package's
            # __init__ importing its own modules is how it re-exports them).
            parts = t.split(".")
            for i in range(2, len(parts)):
                package = ".".join(parts[:i])
                if package in modules and not m.startswith(package + "."):
                    targets.add(package)
        graph[m] = {t for t in targets if t != m and not m.startswith(t + ".")}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycle = path[path.index(t) :] + [t]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if t not in state:
                visit(t)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


# hybridrec's layers, lowest first: a package imports only the packages before it. The
# entry points (python -m hybridrec.<name>, and the install check run as a file) sit on top.
LAYERS = ["base", "config", "data", "models", "parallel", "reports", "checkpoint", "serving", "training", "run"]
ENTRY_POINTS = {"train", "evaluate", "export", "plan", "install_check"}


def _layer(module: str) -> int:
    part = module.split(".")[1]
    return LAYERS.index(part) if part in LAYERS else len(LAYERS)


def test_every_module_is_in_a_package_named_for_its_job():
    top = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    assert top == ENTRY_POINTS, f"modules outside the packages: {sorted(top - ENTRY_POINTS)}"
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert packages == set(LAYERS), sorted(packages ^ set(LAYERS))


def test_each_layer_imports_only_the_layers_below_it():
    """Run-time imports (a function's too); ``if TYPE_CHECKING`` ones are annotations only."""
    modules = _modules()
    upward = [
        f"{m} -> {t}"
        for m, p in sorted(modules.items())
        if m != "hybridrec"
        for t in sorted(_imports(p, modules))
        if t != "hybridrec" and _layer(t) > _layer(m)
    ]
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_each_package_says_what_it_may_import():
    """Each package's docstring ends its job's description with ``May import:`` and the
    layers below it, as LAYERS orders them (what README's and extending.md's tables say)."""
    for i, name in enumerate(LAYERS):
        doc = ast.get_docstring(ast.parse((PACKAGE / name / "__init__.py").read_text()))
        line = re.search(r"^May import: (.*)\.$", doc, re.M)
        assert line, f"hybridrec/{name}/__init__.py: no 'May import:' line"
        assert line.group(1) == (", ".join(LAYERS[:i]) or "nothing of hybridrec"), (name, line.group(1))


def test_no_module_over_600_lines():
    """A module that grows past this is split by job (a package's modules each do one thing)."""
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 600}
    assert not long, long


def test_each_suppressed_finding_says_why():
    """A ``# noqa`` names its rule and a reason; a ``# type: ignore`` names its error code and
    a reason (make lint's checks are silenced only where the code says why)."""
    noqa = re.compile(r"# noqa: [A-Z0-9, ]+ {2}\S")
    ignore = re.compile(r"# type: ignore\[[a-z-, ]+\] {2}#? ?\S")
    bare = [
        f"{p.relative_to(ROOT)}:{i}"
        for folder in ("hybridrec", "tests", "benchmarks")
        for p in (ROOT / folder).rglob("*.py")
        if p.name != "test_layout.py"  # (this test's own patterns)
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if ("# noqa" in line and not noqa.search(line)) or ("# type: ignore" in line and not ignore.search(line))
    ]
    assert not bare, bare


def test_benchmarks_do_not_edit_sys_path():
    edits = [
        f"{p.name}:{i}"
        for p in (ROOT / "benchmarks").glob("*.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"sys\.path\.(insert|append)", line)
    ]
    assert not edits, edits


# The private names hybridrec reaches for in TorchRec's and torch's objects.
PRIVATE = re.compile(
    r"\.(_model|_dmp_wrapped_module|_topology|_enumerator|_storage_reservation|_remaining_restarts|"
    r"_monitor_workers|_start_workers|_return_value|_get_post_forward_mesh_info)\b"
)


def test_private_attributes_only_in_compat():
    uses = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in PACKAGE.rglob("*.py")
        if p.name != "compat.py"
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if PRIVATE.search(line)
    ]
    assert not uses, uses
