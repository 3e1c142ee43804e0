"""Vocabularies of id columns, for ``id_mapping: vocabulary`` in ``data=parquet``.

    python -m hybridrec.data.vocab data/logs/train --column item_id --column user_id --min-count 5 --out data/logs/vocab

reads the Parquet files (a file, a directory of *.parquet, or a glob; several allowed) once,
one record batch at a time: each batch's ids are counted with PyArrow (``value_counts``; a
list column's lists are flattened first), and the counts are merged by a group-by sum. Ids
seen at least ``--min-count`` times are written to ``<out>/<column>.parquet`` with columns
``id`` and ``count``, most frequent first, ties by id: the same files give the same file,
byte for byte. Row i (0-based) of the file is table row i + 1 of the feature; row 0 is every
id not in it (``hybridrec.data.parquet.Vocabulary``).

Parquet rather than JSON: it keeps the ids' type (an int64 id stays an integer, the string
"123" stays a string; JSON readers turn ids above 2**53 into floats), reads back as one
column without parsing millions of tokens, and is the format of the data beside it.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from hybridrec.base.atomic import replace_file
from hybridrec.data import DataError
from hybridrec.data.criteo import resolve_paths

_BATCH_ROWS = 65_536
_MERGE_EVERY = 32  # partial counts held before they are merged into one table


def _ids(column: pa.Array, path: str, name: str) -> pa.Array:
    """The column's non-null ids, flat, as int64 or large_string (one type whatever the file's)."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if pa.types.is_dictionary(column.type):
        column = column.dictionary_decode()
    listed = lambda t: pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
    while listed(column.type):
        column = pc.list_flatten(column)
        if pa.types.is_dictionary(column.type):
            column = column.dictionary_decode()
    t = column.type
    if pa.types.is_integer(t):
        target = pa.int64()
    elif pa.types.is_string(t) or pa.types.is_large_string(t):
        target = pa.large_string()
    else:
        raise DataError(f"{path}: column {name!r} is {t}: a vocabulary holds integer or string ids")
    try:
        return pc.drop_null(column).cast(target)
    except pa.ArrowInvalid as e:  # uint64 ids above int64's range
        raise DataError(f"{path}: column {name!r}: {str(e).splitlines()[0]}") from None


def _merge(parts: list[pa.Table]) -> pa.Table:
    summed = pa.concat_tables(parts).group_by("id").aggregate([("count", "sum")])
    return pa.table({"id": summed.column("id"), "count": summed.column("count_sum")})


def count_ids(paths: Sequence[str], columns: Sequence[str]) -> dict[str, pa.Table]:
    """Per column, every distinct id of the files and how often it occurs (id, count)."""
    parts: dict[str, list[pa.Table]] = {c: [] for c in columns}
    kinds: dict[str, tuple[str, pa.DataType]] = {}
    for path in paths:
        try:
            handle = pq.ParquetFile(path)
        except (OSError, pa.ArrowInvalid) as e:
            raise DataError(f"{path}: not a readable Parquet file ({str(e).splitlines()[0]})") from None
        missing = [c for c in columns if c not in handle.schema_arrow.names]
        if missing:
            raise DataError(
                f"{path}: no column {', '.join(map(repr, missing))}; its columns: "
                f"{', '.join(handle.schema_arrow.names)}"
            )
        with handle:
            for batch in handle.iter_batches(batch_size=_BATCH_ROWS, columns=list(columns)):
                for c in columns:
                    ids = _ids(batch.column(c), path, c)
                    first = kinds.setdefault(c, (path, ids.type))
                    if first[1] != ids.type:
                        kind = lambda t: "integers" if t == pa.int64() else "strings"
                        raise DataError(
                            f"{path}: column {c!r} holds {kind(ids.type)}, {first[0]} holds {kind(first[1])}"
                        )
                    if not len(ids):
                        continue
                    counted = pc.value_counts(ids)
                    parts[c].append(
                        pa.table({"id": counted.field("values"), "count": counted.field("counts").cast(pa.int64())})
                    )
                    if len(parts[c]) >= _MERGE_EVERY:
                        parts[c] = [_merge(parts[c])]
    out = {}
    for c in columns:
        empty = pa.table({"id": pa.array([], kinds.get(c, (None, pa.int64()))[1]), "count": pa.array([], pa.int64())})
        out[c] = _merge(parts[c]) if parts[c] else empty
    return out


def build(paths: Sequence[str], columns: Sequence[str], min_count: int, out: str) -> dict[str, str]:
    """Write ``<out>/<column>.parquet`` for each column; returns the files written."""
    if min_count < 1:
        raise DataError(f"--min-count must be >= 1, got {min_count}")
    for column in columns:
        # The vocabulary is <out>/<column>.parquet: a name with a separator or a leading dot
        # would write elsewhere (--column ../../x) or hide the file.
        if not column or column.startswith(".") or "/" in column or os.sep in column or "\0" in column:
            raise DataError(
                f"--column {column!r}: its vocabulary would be written to <out>/{column}.parquet, and "
                f"that is not a plain file name in --out (no '/', no leading '.'); nothing was written"
            )
    files = []
    for spec in paths:
        files += resolve_paths(spec, "the data paths", "*.parquet")
    files = sorted(dict.fromkeys(files))
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise DataError(f"--out {out}: cannot create the directory ({e.strerror})") from None
    written = {}
    for column, counts in count_ids(files, columns).items():
        kept = counts.filter(pc.greater_equal(counts.column("count"), min_count))
        kept = kept.sort_by([("count", "descending"), ("id", "ascending")])
        if kept.column("id").type == pa.large_string():
            kept = kept.set_column(0, "id", kept.column("id").cast(pa.string()))
        kept = kept.replace_schema_metadata(
            {"hybridrec.vocabulary.column": column, "hybridrec.vocabulary.min_count": str(min_count)}
        )
        target = os.path.join(out, f"{column}.parquet")
        try:
            # a reader never sees half a vocabulary, and a link planted at the target is replaced
            replace_file(target, lambda path: pq.write_table(kept, path))
        except OSError as e:  # a full disk, a read-only directory: the previous vocabulary stays
            raise DataError(f"{target}: cannot be written ({e.strerror or e}); nothing was replaced") from None
        written[column] = target
        print(
            f"{target}: {kept.num_rows:,} ids seen >= {min_count} times "
            f"(of {counts.num_rows:,} distinct); num_embeddings >= {kept.num_rows + 1}"
        )
    return written


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybridrec.data.vocab", description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", help="Parquet files, directories (their *.parquet) or globs")
    parser.add_argument("--column", action="append", required=True, help="an id column (repeat for several)")
    parser.add_argument("--min-count", type=int, default=1, help="keep ids seen at least this often (default 1)")
    parser.add_argument("--out", required=True, help="directory of the vocabularies: <out>/<column>.parquet")
    args = parser.parse_args(argv)
    try:
        build(args.paths, list(dict.fromkeys(args.column)), args.min_count, args.out)
    except DataError as e:
        print(f"hybridrec.data.vocab: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
