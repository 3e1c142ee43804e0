"""The converter's output files (``python -m hybridrec.data.convert``): what each input file
becomes (``Target``: TorchRec's .npy layout, or Parquet of the Criteo columns,
``PARQUET_SCHEMA``), the writers that fill an output block by block under a ``.partial``
name (``_NpyWriter``, ``_ParquetWriter``), the output files of a prefix (``outputs``) and the
removal of a partial one (``remove_partial``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional, cast

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from hybridrec.base.atomic import fresh, replace_file
from hybridrec.config import CRITEO_KAGGLE_CAPPED, IdMapping
from hybridrec.data.criteo import CAT_FEATURES, INT_FEATURES, map_ids

# Part, dtype, columns. The dtypes are those TorchRec's tsv_to_npys writes, so that its own
# tools read the files too.
PARTS = (("dense", np.float32, INT_FEATURES), ("sparse", np.int64, CAT_FEATURES), ("labels", np.int32, 1))
_PARTIAL = ".partial"  # not *_dense.npy: a directory glob of days never picks up an unfinished file
ROW_GROUP_SIZE = 65536
# The Parquet columns: the names Criteo's own documentation gives its fields.
DENSE_COLUMNS = [f"I{j + 1}" for j in range(INT_FEATURES)]
SPARSE_COLUMNS = [f"C{j + 1}" for j in range(CAT_FEATURES)]
PARQUET_SCHEMA = pa.schema(
    [pa.field("label", pa.int8(), nullable=False)]
    + [pa.field(c, pa.float32(), nullable=False) for c in DENSE_COLUMNS]
    + [pa.field(c, pa.int64(), nullable=False) for c in SPARSE_COLUMNS]
)


@dataclass(frozen=True)
class Target:
    """What each input file becomes: the .npy layout (raw ids), or Parquet whose ids are
    already table rows (``sizes``, mapped by ``id_mapping``)."""

    format: str = "npy"
    sizes: tuple[int, ...] = tuple(CRITEO_KAGGLE_CAPPED)
    id_mapping: IdMapping = IdMapping.modulo
    row_group_size: int = ROW_GROUP_SIZE


NPY = Target()


class _NpyWriter:
    """An .npy file written block by block, in one pass, never holding more than a block.

    The row count is known only at the end (bad rows are dropped), so the header is written
    first with 0 rows and rewritten in place with the real count once the rows are in. NumPy
    pads the header of a row-major array so that its length does not depend on the row count
    (room for 21 digits), and the length is checked. The alternatives cost more: open_memmap
    needs the count up front (a counting pass parses every file twice, since only the parser
    knows which rows are valid), and accumulating a file's blocks holds the whole file in
    memory (~260 bytes per row, ~50 GB for a 200M-row day of the 1TB logs)."""

    def __init__(self, path: str, dtype: Any, width: int) -> None:
        self.path, self.partial = path, path + _PARTIAL
        self.dtype, self.width, self.rows = np.dtype(dtype), width, 0
        self.file = open(fresh(self.partial), "xb")
        self.header = self._write_header()

    def _write_header(self) -> int:
        np.lib.format.write_array_header_1_0(
            self.file, {"descr": self.dtype.str, "fortran_order": False, "shape": (self.rows, self.width)}
        )
        return self.file.tell()

    def append(self, block: np.ndarray) -> None:
        block = np.ascontiguousarray(block, dtype=self.dtype).reshape(-1, self.width)
        self.file.write(block.data)
        self.rows += len(block)

    def finish(self) -> None:
        """The real row count in the header, and the bytes on disk (before the rename that
        makes the file look complete)."""
        end = self.file.tell()
        self.file.seek(0)
        if self._write_header() != self.header:
            raise RuntimeError(f"{self.path}: the .npy header changed length with the row count")
        self.file.seek(end)
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()

    def commit(self) -> None:
        os.replace(self.partial, self.path)

    def discard(self) -> None:
        self.file.close()
        remove_partial(self.path)


class _ParquetWriter:
    """A Parquet file of the Criteo columns, written row group by row group: whole groups of
    ``row_group_size`` rows (the last one shorter) whatever the input's block sizes, so the
    file's layout, like its rows, depends only on the input."""

    def __init__(self, path: str, target: Target) -> None:
        self.path, self.partial = path, path + _PARTIAL
        self.sizes = np.array(target.sizes, dtype=np.int64)
        self.id_mapping, self.group = target.id_mapping, target.row_group_size
        self.parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.buffered = 0
        self.writer: Optional[pq.ParquetWriter] = pq.ParquetWriter(fresh(self.partial), PARQUET_SCHEMA)

    def append(self, dense: np.ndarray, raw: np.ndarray, labels: np.ndarray) -> None:
        self.parts.append((dense, map_ids(raw, self.sizes, self.id_mapping), labels))
        self.buffered += len(labels)
        while self.buffered >= self.group:
            self._write(self.group)

    def _write(self, n: int) -> None:
        rows = [np.concatenate(cols) for cols in zip(*self.parts)]
        dense, ids, labels = (a[:n] for a in rows)
        rest = cast("tuple[np.ndarray, np.ndarray, np.ndarray]", tuple(a[n:] for a in rows))
        self.parts, self.buffered = ([rest] if len(rest[2]) else []), len(rest[2])
        dense, ids = np.ascontiguousarray(dense.T, np.float32), np.ascontiguousarray(ids.T, np.int64)
        columns = [pa.array(labels.astype(np.int8))] + [pa.array(c) for c in dense] + [pa.array(c) for c in ids]
        assert self.writer is not None  # (None only once finished)
        self.writer.write_table(pa.Table.from_arrays(columns, schema=PARQUET_SCHEMA), row_group_size=n)

    def finish(self) -> None:
        if self.buffered:
            self._write(self.buffered)
        assert self.writer is not None  # (None only once finished)
        self.writer.close()
        self.writer = None
        fd = os.open(self.partial, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def commit(self) -> None:
        os.replace(self.partial, self.path)

    def discard(self) -> None:
        if self.writer is not None:
            try:
                self.writer.close()
            except Exception:  # the file goes anyway: a close that fails must not hide the first error
                pass
        remove_partial(self.path)


def outputs(prefix: str, target: Target = NPY) -> list[str]:
    if target.format == "parquet":
        return [f"{prefix}.parquet"]
    return [f"{prefix}_{part}.npy" for part, _, _ in PARTS]


def remove_partial(path: str) -> None:
    try:
        os.remove(path + _PARTIAL)
    except FileNotFoundError:
        pass


class Refused(Exception):
    """Input or output the converter refuses before converting anything (exit code 2)."""


# -- the data config of the Parquet files --------------------------------------------------
def config_path(out: str, name: str) -> str:
    """Where the data config goes: a config group directory (``data/``) under ``<out>/conf``,
    which ``--config-dir <out>/conf`` adds to Hydra's search path."""
    return os.path.join(out, "conf", "data", f"{name}.yaml")


def data_config(target: Target, out: str, name: str) -> str:
    """The ``data=parquet`` config of the converted files' columns. Its comments name ``out``;
    the rest depends on the table sizes and the id mapping only."""
    conf = os.path.join(out, "conf")
    lines = [
        "# data=parquet over Criteo converted by `python -m hybridrec.data.convert --format parquet`:",
        "# label int8 0/1; I1..I13 float32, log(x + 1) of the counts with negatives clamped to 0 (what",
        "# data=criteo computes: transform none); C1..C26 int64, table rows already mapped",
        f"# ({target.id_mapping.value}) into the tables below (id_mapping none). The features are named",
        "# cat_0..cat_25 as data=criteo names them: both sources build the same model.",
        "# The splits are files of the conversion, set when training:",
        f"#   python -m hybridrec.train --config-dir {conf} +experiment=ctr data={name} \\",
        "#       data.train_path=<training .parquet: a file or a glob> data.eval_path=<test .parquet>",
        "defaults:",
        "  - /schema/data/parquet@_here_",
        "  - _self_",
        "",
        "label: {column: label, threshold: null}",
        "dense:",
        *[f"  - {{column: {c}, transform: none}}" for c in DENSE_COLUMNS],
        "sparse:",
        *[
            f"  - {{name: cat_{j}, column: {c}, num_embeddings: {n}, id_mapping: none}}"
            for j, (c, n) in enumerate(zip(SPARSE_COLUMNS, target.sizes))
        ],
    ]
    return "\n".join(lines) + "\n"


def _settings(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def check_config(out: str, name: str, target: Target, overwrite: bool) -> None:
    """Refuse to convert into a directory whose data config maps ids into other tables (an
    earlier conversion of other days): its files and the new ones would disagree."""
    path = config_path(out, name)
    try:
        with open(path) as f:
            old = f.read()
    except FileNotFoundError:
        return
    except OSError as e:
        raise Refused(f"{path}: cannot read it ({e.strerror or e})") from None
    if _settings(old) != _settings(data_config(target, out, name)) and not overwrite:
        raise Refused(
            f"{path} describes other columns (table sizes or id mapping) than this conversion's: "
            f"files converted both ways would disagree. Use another --out, or --overwrite to replace it"
        )


def write_config(out: str, name: str, target: Target) -> str:
    path = config_path(out, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    replace_file(path, lambda temp: write_text(temp, data_config(target, out, name)))
    return path


def write_text(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
