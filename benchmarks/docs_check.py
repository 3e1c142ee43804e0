"""Every guide followed in order, as a new user would: a fresh clone, `make demo`, then each
`bash` block's commands of the README and of every guide (in the order the README lists
them), one after the other, in the clone, in its activated virtualenv.

    python benchmarks/docs_check.py                  # -> outputs/docs-check/DOCS_CHECK.md
    python benchmarks/docs_check.py --results        # also benchmarks/results/DOCS_CHECK.md
    python benchmarks/docs_check.py --pages docs/serving.md --clone /tmp/c   # reuse a clone

A command passes when it exits 0, or, where its comment says ``refused`` (the guide shows
the refusal), when it exits non-zero with hybridrec's own one-line message (``hybridrec...:``). The few that need what only a user has (a Criteo copy,
their own logs, a Slurm cluster) or that are the test suite itself are skipped, each with its
reason (``SKIP``): the test suite composes and validates those (tests/test_docs.py), and
tests/test_convert.py and tests/test_launchers.py run the conversion and render the Slurm
script. Each command's output goes to its own log beside the report; a failed command's last
lines are in the report. The clone is committed ``HEAD``: uncommitted changes are not in it.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

from common import ROOT, LoadAverage, machine, write_markdown

# (pattern in the command, why it is not run here)
SKIP = [
    (r"data=criteo\b|data=criteo_binary|data=criteo_parquet", "needs a Criteo copy (the guide's own paths)"),
    (r"hybridrec\.data\.convert 'logs/", "needs the user's Criteo logs"),
    (r"hydra/launcher=slurm", "needs a Slurm cluster (tests/test_launchers.py renders the job script)"),
    (r"^make test$", "the whole suite: CI runs it on every change (about 10 min)"),
]


def pages() -> list[str]:
    """The README, then each guide in the order the README's Guides section links them, then
    any guide it does not link."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    guides = readme.split("## Guides", 1)[1].split("\n## ", 1)[0]
    linked = list(dict.fromkeys(re.findall(r"\((docs/[\w-]+\.md)", guides)))
    rest = sorted(f"docs/{n}" for n in os.listdir(os.path.join(ROOT, "docs")) if n.endswith(".md"))
    return ["README.md"] + linked + [p for p in rest if p not in linked]


def commands(page: str) -> list[str]:
    """The commands of ``page``'s ```bash blocks, in order: continuation lines joined, lines
    that are only a comment dropped (bash itself strips the trailing comments)."""
    text = open(os.path.join(ROOT, page)).read()
    found = []
    for block in re.findall(r"^ *```bash\n(.*?)^ *```", text, flags=re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip() and not line.strip().startswith("#"):
                found.append(line.strip())
    return found


def skip_reason(command: str) -> str | None:
    bare = re.split(r"\s+#", command)[0].strip()
    return next((why for pattern, why in SKIP if re.search(pattern, bare)), None)


def run(command: str, clone: str, log: str, timeout: float) -> tuple[int, float]:
    """Run ``command`` with bash in the clone, its virtualenv first on PATH (an activated
    shell); (exit code, seconds). A command past ``timeout`` is killed and counts as 124."""
    env = dict(os.environ, VIRTUAL_ENV=os.path.join(clone, ".venv"))
    env["PATH"] = os.path.join(clone, ".venv", "bin") + os.pathsep + env["PATH"]
    env.pop("PYTHONPATH", None)
    start = time.perf_counter()
    with open(log, "w") as out:
        out.write(f"$ {command}\n")
        out.flush()
        try:
            rc = subprocess.run(
                ["bash", "-c", command], cwd=clone, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, time.perf_counter() - start


def tail(path: str, n: int = 6) -> list[str]:
    with open(path, errors="replace") as f:
        return [line.rstrip() for line in f.readlines()[-n:]]


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {seconds % 60:.0f} s" if seconds >= 60 else f"{seconds:.0f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(ROOT, "outputs", "docs-check"))
    parser.add_argument("--clone", help="an existing clone to run in (default: a fresh one, removed at the end)")
    parser.add_argument("--pages", nargs="+", help="only these pages (paths from the repository root)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per command")
    parser.add_argument("--results", action="store_true", help="also write benchmarks/results/DOCS_CHECK.md")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    clone = args.clone or tempfile.mkdtemp(prefix="hybridrec-docs-check-")
    if not args.clone:
        subprocess.run(["git", "clone", "--quiet", ROOT, clone], check=True)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=clone, capture_output=True, text=True).stdout
    steps = [("(setup)", "make demo")] + [(p, c) for p in (args.pages or pages()) for c in commands(p)]
    rows, failed, start = [], 0, time.perf_counter()
    with LoadAverage() as load:  # what else shared the cores: every time here depends on it
        for i, (page, command) in enumerate(steps):
            why = skip_reason(command)
            if why or (page != "(setup)" and command == "make demo"):  # the setup ran it
                rows.append((page, command, "skipped", why or "the setup ran it", None, None))
                continue
            log = os.path.join(args.out, f"{i:03d}.log")
            print(f"[{minutes(time.perf_counter() - start)}] {page}: {command}", flush=True)
            rc, seconds = run(command, clone, log, args.timeout)
            if re.search(r"#.*\brefused\b", command):  # the guide shows it refused: in hybridrec's words
                refused = rc not in (0, 124) and any(line.startswith("hybridrec") for line in tail(log, 40))
                result = "refused, as the guide says" if refused else f"not refused as the guide says (exit {rc})"
            else:
                result = "ok" if rc == 0 else f"failed (exit {rc})"
            ok = result == "ok" or result.startswith("refused")
            failed += not ok
            rows.append((page, command, result, "", seconds, log))
            if not ok:
                print("\n".join(f"    {line}" for line in tail(log)), flush=True)
    total = time.perf_counter() - start
    loads = load.samples or [os.getloadavg()[0]]
    disk = subprocess.run(
        "du -sch outputs multirun 2>/dev/null | tail -1 | cut -f1",
        shell=True,
        cwd=clone,
        capture_output=True,
        text=True,
    ).stdout.strip()
    m = machine()
    ran = sum(r[4] is not None for r in rows)  # passed: ok or refused as shown
    lines = [
        "# The guides, followed in order",
        "",
        "`make docs-check` (`benchmarks/docs_check.py`): a fresh clone, `make demo`, then every command of the "
        "README's and the guides' `bash` blocks in order, in the clone's virtualenv.",
        "",
        "## Summary",
        "",
        "| commands | passed | failed | skipped | wall time |",
        "|---:|---:|---:|---:|---:|",
        f"| {len(rows)} | {ran - failed} | {failed} | {len(rows) - ran} | {minutes(total)} |",
        "",
        f"- {m['cpu']}, {m['cores']} cores; torch {m['torch']}; commit {head.strip()}; "
        f"{datetime.date.today().isoformat()}. The wall time includes `make demo`'s install.",
        f"- The machine's 1-minute load average meanwhile: median {sorted(loads)[len(loads) // 2]:.1f}, max "
        f"{max(loads):.1f} (a command on both cores accounts for about {m['cores']}).",
        f"- Left on disk by all of them: {disk or '0'} under `outputs/` and `multirun/` (`make clean` removes both).",
        "",
        "## Commands",
        "",
        "| page | command | result | time |",
        "|---|---|---|---:|",
    ]
    for page, command, result, why, seconds, log in rows:
        shown = command.replace("|", "\\|")
        detail = f"{result}: {why}" if why else result
        if log and not (result == "ok" or result.startswith("refused")):
            detail += " (`" + " / ".join(t.replace("|", "\\|")[:160] for t in tail(log, 2)) + "`)"
        lines.append(f"| {page} | `{shown}` | {detail} | {minutes(seconds) if seconds is not None else '-'} |")
    write_markdown(os.path.join(args.out, "DOCS_CHECK.md"), lines, "docs-check")
    if args.results:
        write_markdown(os.path.join(ROOT, "benchmarks", "results", "DOCS_CHECK.md"), lines, "results")
    if not args.clone:
        shutil.rmtree(clone, ignore_errors=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
