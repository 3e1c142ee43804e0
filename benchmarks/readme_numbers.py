"""Copies measured tables from benchmarks/results/ into README.md, so that no number in the
README is typed by hand.

    python benchmarks/readme_numbers.py          # rewrite the marked blocks
    python benchmarks/readme_numbers.py --check  # exit 1 if the README is out of date

A block is ``<!-- results:NAME -->`` ... ``<!-- /results:NAME -->`` in README.md; its content
becomes the first markdown table of ``benchmarks/results/NAME.md``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = re.compile(r"(<!-- results:(\w+) -->\n)(.*?)(<!-- /results:\2 -->)", re.S)


def first_table(markdown: str) -> str:
    lines, table = markdown.splitlines(), []
    for line in lines:
        if line.startswith("|"):
            table.append(line)
        elif table:
            break
    if not table:
        raise ValueError("no markdown table")
    return "\n".join(table) + "\n"


def render(readme: str) -> str:
    def fill(m: re.Match) -> str:
        path = os.path.join(ROOT, "benchmarks", "results", f"{m.group(2)}.md")
        with open(path) as f:
            return m.group(1) + first_table(f.read()) + m.group(4)

    return BLOCK.sub(fill, readme)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    path = os.path.join(ROOT, "README.md")
    with open(path) as f:
        text = f.read()
    new = render(text)
    if args.check:
        sys.exit(0 if new == text else "README.md's result blocks differ from benchmarks/results: run "
                                        "python benchmarks/readme_numbers.py")
    with open(path, "w") as f:
        f.write(new)


if __name__ == "__main__":
    main()
