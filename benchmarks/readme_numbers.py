"""Copies measured tables from benchmarks/results/ into README.md and the guides in docs/, so
that no number in them is typed by hand.

    python benchmarks/readme_numbers.py          # rewrite the marked blocks
    python benchmarks/readme_numbers.py --check  # exit 1 if a page is out of date

A block is ``<!-- results:NAME -->`` ... ``<!-- /results:NAME -->`` in a page; its content
becomes the first markdown table of ``benchmarks/results/NAME.md``. ``NAME#heading-slug`` takes
the section ``## Heading`` of that file instead: its first table, or its first bullet list
when it has no table (REPORT.md's "Answers").
"""

from __future__ import annotations

import argparse
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = re.compile(r"(<!-- results:([\w#-]+) -->\n)(.*?)(<!-- /results:\2 -->)", re.S)


def first_block(markdown: str, kind: str) -> str:
    """The first markdown ``table`` (lines starting with ``|``) or bullet ``list`` (``- ``
    items and their indented continuations) of ``markdown``."""
    starts = (
        (lambda line, block: line.startswith("|"))
        if kind == "table"
        else (lambda line, block: line.startswith("- ") or bool(block) and line.startswith("  "))
    )
    block: list[str] = []
    for line in markdown.splitlines():
        if starts(line, block):
            block.append(line)
        elif block:
            break
    if not block:
        raise ValueError(f"no markdown {kind}")
    return "\n".join(block) + "\n"


def slug(heading: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", heading.lower()).strip("-")


def section(markdown: str, heading_slug: str) -> str:
    """The lines under the ``## `` heading whose slug is ``heading_slug`` (``Where the time
    goes (profiled)`` -> ``where-the-time-goes-profiled``), up to the next such heading."""
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("## ") and slug(line[3:]) == heading_slug) + 1
    end = next((i for i in range(start, len(lines)) if re.match(r"#{1,2} ", lines[i])), len(lines))
    return "\n".join(lines[start:end])


def render(readme: str) -> str:
    def fill(m: re.Match) -> str:
        name, _, heading = m.group(2).partition("#")
        with open(os.path.join(ROOT, "benchmarks", "results", f"{name}.md")) as f:
            text = f.read()
        if heading:
            text = section(text, heading)
            kind = "table" if "\n|" in "\n" + text else "list"
            return m.group(1) + first_block(text, kind) + m.group(4)
        return m.group(1) + first_block(text, "table") + m.group(4)

    return BLOCK.sub(fill, readme)


def pages() -> list[str]:
    """README.md and every guide under docs/."""
    docs = os.path.join(ROOT, "docs")
    return [os.path.join(ROOT, "README.md")] + sorted(
        os.path.join(docs, name) for name in os.listdir(docs) if name.endswith(".md")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    stale = []
    for path in pages():
        with open(path) as f:
            text = f.read()
        new = render(text)
        if new == text:
            continue
        stale.append(os.path.relpath(path, ROOT))
        if not args.check:
            with open(path, "w") as f:
                f.write(new)
    if args.check and stale:
        sys.exit(
            f"{', '.join(stale)}: result blocks differ from benchmarks/results: run python benchmarks/readme_numbers.py"
        )
    for name in stale:
        print(f"updated {name}")


if __name__ == "__main__":
    main()
