"""Where the test suite spends its time and what it covers: the whole suite (as `make test` runs
it, on pytest-xdist workers) under coverage.py, with pytest's JUnit report for per-test times.

    .venv/bin/python benchmarks/suite_profile.py                   # -> benchmarks/results/SUITE.md, suite.json
    .venv/bin/python benchmarks/suite_profile.py --compare benchmarks/results/suite_baseline.json

Per test file: tests, outcomes and seconds (setup + call + teardown, summed over its tests, as
pytest's JUnit report times them); per module of hybridrec/: statements and covered lines,
counted in every process the suite starts: pytest's workers, the CLI runs they start
(coverage's ``patch = subprocess``), and the ranks the elastic launcher forks
(``concurrency = multiprocessing``). Coverage slows the suite down: its wall time here is
not `make test`'s, which is timed without it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "outputs", "suite")
RESULTS = os.path.join(ROOT, "benchmarks", "results")
# what coverage.py measures, in every process the suite starts
RC = """\
[run]
source = hybridrec
parallel = true
concurrency = multiprocessing,thread
patch = subprocess
sigterm = true
data_file = {data}
"""


def run_suite(workers: int, extra: list[str]) -> dict:
    os.makedirs(OUT, exist_ok=True)
    rc = os.path.join(OUT, "coveragerc")
    with open(rc, "w") as f:
        f.write(RC.format(data=os.path.join(OUT, ".coverage")))
    for name in os.listdir(OUT):
        if name.startswith(".coverage"):
            os.remove(os.path.join(OUT, name))
    junit = os.path.join(OUT, "junit.xml")
    env = {**os.environ, "COVERAGE_RCFILE": rc}
    cmd = [
        sys.executable,
        "-m",
        "coverage",
        "run",
        "-m",
        "pytest",
        "-q",
        "-n",
        str(workers),
        "--dist",
        "loadfile",
        f"--junitxml={junit}",
        "-p",
        "no:cacheprovider",
        *extra,
    ]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env)
    wall = time.monotonic() - start
    subprocess.run([sys.executable, "-m", "coverage", "combine", "-q"], cwd=ROOT, env=env, check=True)
    cov_json = os.path.join(OUT, "coverage.json")
    subprocess.run([sys.executable, "-m", "coverage", "json", "-q", "-o", cov_json], cwd=ROOT, env=env, check=True)
    return {
        "wall_s": round(wall, 1),
        "exit": proc.returncode,
        "files": per_file(junit),
        "tests": per_test(junit),
        "modules": per_module(cov_json),
        "commit": _commit(),
        "cpu": _cpu(),
        "date": time.strftime("%Y-%m-%d"),
    }


def per_file(junit: str) -> dict[str, dict]:
    files: dict[str, dict] = defaultdict(lambda: {"tests": 0, "passed": 0, "failed": 0, "skipped": 0, "seconds": 0.0})
    for case in ET.parse(junit).getroot().iter("testcase"):
        row = files[_split(case)[0]]
        row["tests"] += 1
        row["seconds"] += float(case.get("time", 0))
        if case.find("failure") is not None or case.find("error") is not None:
            row["failed"] += 1
        elif case.find("skipped") is not None:
            row["skipped"] += 1
        else:
            row["passed"] += 1
    return {k: {**v, "seconds": round(v["seconds"], 1)} for k, v in sorted(files.items())}


def _split(case: ET.Element) -> tuple[str, list[str]]:
    """A JUnit test case's file and classes: classname ``tests.test_x.TestY`` is
    tests/test_x.py and [TestY]."""
    parts = (case.get("classname") or "?").split(".")
    last = next((i for i, p in enumerate(parts) if p.startswith("test_")), len(parts) - 1)
    return "/".join(parts[: last + 1]) + ".py", parts[last + 1 :]


def per_test(junit: str) -> dict[str, float]:
    """Every test's seconds (setup + call + teardown), by its id: what --durations=0 lists."""
    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        path, inner = _split(case)
        out["::".join([path, *inner, case.get("name", "?")])] = round(float(case.get("time", 0)), 2)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def per_module(cov_json: str) -> dict[str, dict]:
    data = json.load(open(cov_json))["files"]
    out = {}
    for path, f in sorted(data.items()):
        rel = os.path.relpath(path, ROOT) if os.path.isabs(path) else path
        s = f["summary"]
        out[rel] = {"statements": s["num_statements"], "covered": s["covered_lines"]}
    return out


def _commit() -> str:
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()


def _cpu() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    return "unknown CPU"


def _pct(covered: int, statements: int) -> str:
    return f"{100 * covered / statements:.1f}%" if statements else "-"


def markdown(now: dict, before: dict | None) -> str:
    lines = [
        "# The test suite: time per file, coverage per module",
        "",
        f"Measured by `benchmarks/suite_profile.py` on {now['date']} at commit {now['commit']} ({now['cpu']}): "
        f"the whole suite under coverage.py on 2 pytest-xdist workers, {now['wall_s'] / 60:.1f} min "
        f"(coverage slows it down; `make test`'s own time is in docs/install.md).",
        "",
    ]
    tests = sum(r["tests"] for r in now["files"].values())
    secs = sum(r["seconds"] for r in now["files"].values())
    head = "| test file | tests | passed | failed | skipped | seconds |" + (
        " before: tests | before: seconds |" if before else ""
    )
    lines += [
        f"## Per test file ({tests} tests, {secs / 60:.1f} min of test time over the workers)",
        "",
        head,
        "|---|---:|---:|---:|---:|---:|" + ("---:|---:|" if before else ""),
    ]
    names = sorted(
        set(now["files"]) | set(before["files"] if before else ()),
        key=lambda n: -(now["files"].get(n, {}).get("seconds", 0)),
    )
    for n in names:
        r = now["files"].get(n, {"tests": 0, "passed": 0, "failed": 0, "skipped": 0, "seconds": 0})
        row = f"| {n} | {r['tests']} | {r['passed']} | {r['failed']} | {r['skipped']} | {r['seconds']:.1f} |"
        if before:
            b = before["files"].get(n)
            row += f" {b['tests']} | {b['seconds']:.1f} |" if b else " - | - |"
        lines.append(row)
    slowest = list(now.get("tests", {}).items())[:25]
    if slowest:
        lines += ["", "## The 25 slowest tests", "", "| test | seconds |", "|---|---:|"]
        lines += [f"| {name} | {secs:.1f} |" for name, secs in slowest]
    st = sum(m["statements"] for m in now["modules"].values())
    cv = sum(m["covered"] for m in now["modules"].values())
    lines += [
        "",
        f"## Per module of hybridrec/ ({cv} of {st} statements covered, {_pct(cv, st)})",
        "",
        "| module | statements | covered | covered % |" + (" before: covered % |" if before else ""),
        "|---|---:|---:|---:|" + ("---:|" if before else ""),
    ]
    for n in sorted(set(now["modules"]) | set(before["modules"] if before else ())):
        m = now["modules"].get(n, {"statements": 0, "covered": 0})
        row = f"| {n} | {m['statements']} | {m['covered']} | {_pct(m['covered'], m['statements'])} |"
        if before:
            b = before["modules"].get(n)
            row += f" {_pct(b['covered'], b['statements'])} |" if b else " - |"
        lines.append(row)
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--compare", help="an earlier suite.json to show beside this run")
    p.add_argument("--out", default=os.path.join(RESULTS, "suite.json"))
    p.add_argument("--report", default=os.path.join(RESULTS, "SUITE.md"))
    p.add_argument("--from-json", help="write the report from this suite.json without running the suite")
    p.add_argument("pytest_args", nargs="*")
    a = p.parse_args()
    now = json.load(open(a.from_json)) if a.from_json else run_suite(a.workers, a.pytest_args)
    if not a.from_json:
        with open(a.out, "w") as f:
            json.dump(now, f, indent=1)
    before = json.load(open(a.compare)) if a.compare else None
    with open(a.report, "w") as f:
        f.write(markdown(now, before))
    print(f"suite: exit {now['exit']}, {now['wall_s'] / 60:.1f} min -> {a.report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
