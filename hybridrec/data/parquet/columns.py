"""Arrow columns into what the model reads: the column types, and ParquetSource's conversion
of a table (``_Columns``): labels, sample weights, dense values, each sparse feature's ids,
lengths and id weights, the checks that find bad rows (counted with file and row, or raised)
and the padding that replaces them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from hybridrec.config.schema import ParquetIdMapping
from hybridrec.config.tasks import Task
from hybridrec.data import DataError, FileReport, ReadReport, numeric, portable
from hybridrec.data.parquet.config import _Sparse
from hybridrec.data.parquet.hashing import hash_ints, hash_strings
from hybridrec.data.source import Rows

if TYPE_CHECKING:
    from hybridrec.data.parquet.config import _Dense
    from hybridrec.data.parquet.managed import ManagedIds
    from hybridrec.data.parquet.vocabulary import Vocabulary


# ------------------------------------------------------------------------------ column types
def _kind(t: pa.DataType) -> str:
    """int, str (string or binary), float, bool, decimal, or other; a dictionary is its values'."""
    if pa.types.is_dictionary(t):
        t = t.value_type
    if pa.types.is_integer(t):
        return "int"
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return "str"
    if pa.types.is_floating(t):
        return "float"
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_decimal(t):
        return "decimal"
    return "other"


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


_NUMERIC = ("int", "float", "bool", "decimal")


def _plain_array(column) -> pa.Array:
    """One array (chunks combined), dictionaries decoded: the chunks of a slice that spans
    row groups may carry different dictionaries."""
    if isinstance(column, pa.ChunkedArray):
        if pa.types.is_dictionary(column.type):
            column = pa.chunked_array([c.dictionary_decode() for c in column.chunks], column.type.value_type)
        column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    if pa.types.is_dictionary(column.type):
        column = column.dictionary_decode()
    if pa.types.is_fixed_size_list(column.type):
        column = column.cast(pa.list_(column.type.value_type))
    return column


def _floats(array: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """float64 values (NaN where null) and the null mask."""
    values = pc.cast(array, pa.float64())
    nulls = np.asarray(values.is_null()) if values.null_count else np.zeros(len(values), bool)
    return np.asarray(pc.fill_null(values, np.nan) if values.null_count else values, dtype=np.float64), nulls


@dataclass
class _Part:
    """Converted rows of one file range; bad rows already padding."""

    dense: np.ndarray
    labels: np.ndarray
    weights: np.ndarray
    ids: list[tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]]
    real: np.ndarray
    keys: Optional[list[Optional[np.ndarray]]] = None
    """Sampling: each mapped feature's 64-bit id keys before the modulo (None elsewhere)."""


_Check = tuple[np.ndarray, Callable[[int], str]]


class _Columns:
    """ParquetSource's conversion of the tables it reads into rows (a mixin of ParquetSource:
    it reads the source's settings: label_column, threshold_value, weight_column, dense,
    sparse, vocabularies, hash_seed, fail and weighted)."""

    if TYPE_CHECKING:  # what ParquetSource (and its _Partitioned side) gives this mixin, for the type checker
        label_column: str
        threshold_value: Optional[float]
        tasks: Sequence[Task]
        weight_column: Optional[str]
        dense: list[_Dense]
        sparse: list[_Sparse]
        vocabularies: dict[int, Vocabulary]
        hash_seed: int
        fail: bool
        managed: Optional[ManagedIds]

        @property
        def weighted(self) -> bool: ...

        def _version(self) -> int: ...

    def _convert(
        self, table: pa.Table, spans: list[tuple[str, int, int]], report: Optional[ReadReport], sample: bool = False
    ) -> _Part:
        """The rows of ``table``, which are ``spans`` (file, first row, rows) end to end, as
        arrays, every column checked at once; bad rows become padding, counted in ``report``
        (or raised with bad_rows=fail) with their file and row.
        ``sample``: nothing is counted or raised, and id keys are kept for the estimates."""
        n = table.num_rows
        checks: list[_Check] = []
        if self.tasks:  # several tasks: a label column each, [n, T] (one task: [n])
            parts = [
                self._labels(
                    _plain_array(table.column(t.column)), t.column, t.threshold, t.kind, f"data.labels[{i}]", t.levels
                )
                for i, t in enumerate(self.tasks)
            ]
            labels = np.stack([p[0] for p in parts], 1) if len(parts) > 1 else parts[0][0]
            checks += [c for _, cs in parts for c in cs]
        else:
            labels, label_checks = self._labels(
                _plain_array(table.column(self.label_column)), self.label_column, self.threshold_value
            )
            checks += label_checks
        weights = np.ones(n, np.float32)
        if self.weight_column:
            w, nulls = _floats(_plain_array(table.column(self.weight_column)))
            bad = ~nulls & ~(np.isfinite(w) & (w >= 0))

            def weight_not_finite(i: int, w: np.ndarray = w) -> str:
                return f"sample weight {self.weight_column} {w[i]:g} is not a finite number >= 0"

            checks += [(nulls, lambda i: f"sample weight {self.weight_column} is null"), (bad, weight_not_finite)]
            weights = np.where(nulls | bad, 0, w).astype(np.float32)
        dense = np.zeros((n, sum(d.scalar for d in self.dense)), np.float32)
        encoded: list[tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]] = []
        j = 0
        for d in self.dense:
            x, nulls = _floats(_plain_array(table.column(d.column)))
            if not d.scalar:  # ids of its own table; a null or non-finite number is a bad row, as for scalars
                bad_number = nulls | ~np.isfinite(x)

                def number_bad(i: int, c: str = d.column, x: np.ndarray = x, nulls: np.ndarray = nulls) -> str:
                    return f"{c} is null" if nulls[i] else f"{c} {x[i]} is not finite"

                checks.append((bad_number, number_bad))
                assert d.knots is not None  # given, or fitted at build
                encoded.append(numeric.encode(np.where(bad_number, d.knots[0], x), d.encoding, list(d.knots)))
                continue
            with np.errstate(all="ignore"):
                if d.transform == "log1p":
                    y = portable.log1p(np.maximum(x, 0))
                elif d.transform == "standardize":
                    assert d.mean is not None and d.std is not None  # given, or fitted at build (_fit_dense)
                    y = (x - d.mean) / d.std
                else:
                    y = x
                y = y.astype(np.float32)
            raw_bad = ~nulls & ~np.isfinite(x)
            over = ~nulls & ~raw_bad & ~np.isfinite(y)

            def dense_null(i: int, c: str = d.column) -> str:
                return f"{c} is null"

            def dense_not_finite(i: int, c: str = d.column, x: np.ndarray = x) -> str:
                return f"{c} {x[i]} is not finite"

            def dense_over(i: int, c: str = d.column, x: np.ndarray = x, t: str = d.transform) -> str:
                return f"{c} {x[i]:g} is out of float32's range after {t}"

            checks += [(nulls, dense_null), (raw_bad, dense_not_finite), (over, dense_over)]
            dense[:, j] = np.where(nulls | raw_bad | over, 0, y)
            j += 1
        ids, keys, null_rows = [], [], []
        for f in self.sparse:
            values, lengths, id_weights, key, sparse_checks = self._ids(f, table, sample)
            ids.append((values, lengths, id_weights))
            keys.append(key)
            checks += sparse_checks
            column = table.column(f.column)
            if column.null_count:  # rows whose column is null (not an id inside a list)
                nulls = np.asarray(column.is_null())
                if f.null_ids == "bad":

                    def null_row(i: int, c: str = f.column, k: int = f.index) -> str:
                        return f"{c} is null (data.sparse[{k}].null_ids=bad)"

                    checks.append((nulls, null_row))
                else:
                    null_rows.append((f, nulls))
        ids += encoded
        keys += [None] * len(encoded)
        bad = np.zeros(n, bool)
        for mask, _ in checks:
            bad |= mask
        if bad.any() and not sample:
            self._bad_rows(bad, checks, spans, report)
        if report is not None:
            at = 0
            for path, _, count in spans:
                report.good(path, int(count - bad[at : at + count].sum()))
                at += count
            for f, nulls in null_rows:  # rows kept without ids: counted, said once at the end
                if kept := int((nulls & ~bad).sum()):
                    report.null_ids[f"{f.column} (data.sparse[{f.index}])"] = (
                        report.null_ids.get(f"{f.column} (data.sparse[{f.index}])", 0) + kept
                    )
        if bad.any() and not sample:  # a sample keeps its ids as read: the estimates filter by ``real``
            dense[bad] = 0
            labels = np.where(bad.reshape(-1, *[1] * (labels.ndim - 1)), 0, labels).astype(np.float32)
            weights = np.where(bad, 0, weights).astype(np.float32)
            ids = [_as_padding(values, lengths, w, bad) for values, lengths, w in ids]
        return _Part(dense, labels, weights, ids, ~bad, keys if sample else None)

    def _bad_rows(
        self, bad: np.ndarray, checks: list[_Check], spans: list[tuple[str, int, int]], report: Optional[ReadReport]
    ) -> None:
        starts = np.cumsum([0] + [count for _, _, count in spans])
        where = np.flatnonzero(bad)
        reason = lambda i: next(why(int(i)) for mask, why in checks if mask[i])

        def located(i: int) -> tuple[str, int]:
            j = int(np.searchsorted(starts, i, side="right")) - 1
            return spans[j][0], spans[j][1] + i - int(starts[j])

        if self.fail:
            path, row = located(int(where[0]))
            raise DataError(f"{path}:{row}: {reason(where[0])} (data.bad_rows=fail)")
        if report is None:
            return
        kept = where[: report.max_errors]  # only the first few are kept with their reason
        for i in kept:
            report.bad(*located(int(i)), reason(i))
        rest = np.searchsorted(starts, where[len(kept) :], side="right") - 1  # the rest are counted, by file
        for j, count in zip(*np.unique(rest, return_counts=True)):
            report.files.setdefault(spans[int(j)][0], FileReport()).bad_rows += int(count)

    def _labels(
        self,
        column: pa.Array,
        c: str,
        threshold: Optional[float],
        kind: str = "binary",
        key: str = "data.label",
        levels: Optional[int] = None,
    ) -> tuple[np.ndarray, list[_Check]]:
        """Label column ``c``'s values and the checks that make a row bad: a null; for a binary
        label, a value that is not 0 or 1 (with ``threshold``: value > threshold, and NaN is bad);
        for a regression label (a task of data.labels), a value that is not finite; for an
        ordinal one, a value that is not a grade 0 .. levels - 1."""
        x, nulls = _floats(column)
        checks: list[_Check] = [(nulls, lambda i: f"label {c} is null")]
        if kind == "ordinal":
            assert levels is not None  # check_tasks: an ordinal task has its levels
            with np.errstate(invalid="ignore"):
                wrong = ~nulls & ~((x >= 0) & (x <= levels - 1) & (x == np.floor(x)))
            checks.append((wrong, lambda i: f"label {c} {x[i]:g} is not a grade 0 .. {levels - 1} ({key}.levels)"))
            return np.where(nulls | wrong, 0, x).astype(np.float32), checks
        if kind != "binary":
            wrong = ~nulls & ~np.isfinite(x)
            checks.append((wrong, lambda i: f"label {c} {x[i]:g} is not a finite number"))
            return np.where(nulls | wrong, 0, x).astype(np.float32), checks
        if threshold is not None:
            nan = ~nulls & np.isnan(x)
            checks.append((nan, lambda i: f"label {c} is NaN"))
            return np.where(nulls | nan, 0, x > threshold).astype(np.float32), checks
        wrong = ~nulls & (x != 0) & (x != 1)
        checks.append((wrong, lambda i: f"label {c} {x[i]:g} is not 0 or 1 (or set {key}.threshold)"))
        return np.where(nulls | wrong, 0, x).astype(np.float32), checks

    def _ids(
        self, f: _Sparse, table: pa.Table, sample: bool
    ) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray], Optional[np.ndarray], list[_Check]]:
        """Feature ``f`` of the rows: table rows of its ids (flat), ids per row, each id's
        weight (weighted features), the ids' 64-bit keys (``sample``) and its checks."""
        column = _plain_array(table.column(f.column))
        n = len(column)
        checks: list[_Check] = []
        listed = _is_list(column.type)
        if (
            not listed
            and not column.null_count
            and f.id_mapping == ParquetIdMapping.none.value
            and not f.weights_column
            and _kind(column.type) == "int"
        ):
            # One id per row that is already a table row (converted Criteo, say): no list
            # offsets to build and no cast, the column's own buffer checked as it is.
            values = column.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
            outside = (values < 0) | (values >= f.num_embeddings)
            if outside.any():

                def row_outside(i: int, v: np.ndarray = values) -> str:
                    return (
                        f"{f.column}: id {v[i]} is outside the table's rows 0..{f.num_embeddings - 1} (id_mapping=none)"
                    )

                checks.append((outside, row_outside))
                values = np.where(outside, 0, values)
            return values, np.ones(n, np.int32), None, None, checks
        if listed:
            if f.truncate:
                column = pc.list_slice(column, 0, f.max_length)
            lengths = np.asarray(pc.fill_null(pc.list_value_length(column), 0), dtype=np.int64)
            flat = _plain_array(pc.list_flatten(column))
            if f.max_length is not None and not f.truncate:
                checks.append(
                    (
                        lengths > f.max_length,
                        lambda i: (
                            f"{f.column} has {lengths[i]} ids, more than "
                            f"data.sparse[{f.index}].max_length={f.max_length}"
                        ),
                    )
                )
        else:  # a null: a row without ids
            lengths = (~np.asarray(column.is_null())).astype(np.int64) if column.null_count else np.ones(n, np.int64)
            flat = pc.drop_null(column) if column.null_count else column
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        row_of = np.repeat(np.arange(n), lengths)
        kind = _kind(flat.type)
        if flat.null_count:
            nulls = np.asarray(flat.is_null())
            checks.append((_rows_of(row_of, nulls, n), lambda i: f"{f.column} has a null id in its list"))
            fill = (
                0
                if kind == "int"
                else ("" if pa.types.is_string(flat.type) or pa.types.is_large_string(flat.type) else b"")
            )
            flat = pc.fill_null(flat, pa.scalar(fill, flat.type))
        key = None
        if f.id_mapping == ParquetIdMapping.none.value:
            values = np.asarray(pc.cast(flat, pa.int64(), safe=False), dtype=np.int64)
            outside = (values < 0) | (values >= f.num_embeddings)
            if outside.any():

                def why(i: int, ids=flat, outside=outside) -> str:
                    k = offsets[i] + int(np.argmax(outside[offsets[i] : offsets[i + 1]]))
                    return (
                        f"{f.column}: id {ids[int(k)].as_py()} is outside the table's rows "
                        f"0..{f.num_embeddings - 1} (id_mapping=none)"
                    )

                checks.append((_rows_of(row_of, outside, n), why))
                values = np.where(outside, 0, values)
        elif f.id_mapping in (ParquetIdMapping.hash.value, ParquetIdMapping.managed.value):
            key = self._keys(flat, kind)
            if f.id_mapping == ParquetIdMapping.hash.value:
                values = (key % np.uint64(f.num_embeddings)).astype(np.int64)
            else:  # the rows of the version the read is made with (ParquetSource._version); none to sample
                assert self.managed is not None  # a managed feature gives the source its ManagedIds
                values = (
                    np.zeros(len(key), np.int64) if sample else self.managed.rows(f.table_name, key, self._version())
                )
        else:
            values = self.vocabularies[f.index].rows(flat)
            key = values.astype(np.uint64)
        weights = self._id_weights(f, table, listed, lengths, offsets, row_of, checks) if f.weights_column else None
        return values, lengths.astype(np.int32), weights, key if sample else None, checks

    def _keys(self, flat: pa.Array, kind: str) -> np.ndarray:
        """64-bit keys of ids (hash and managed mapping), under data.hash_seed."""
        if kind == "int":
            return hash_ints(np.asarray(pc.cast(flat, pa.int64(), safe=False), dtype=np.int64), self.hash_seed)
        if len(flat):
            encoded = pc.dictionary_encode(flat)
            return hash_strings(encoded.dictionary, self.hash_seed)[np.asarray(encoded.indices, dtype=np.int64)]
        return np.zeros(0, np.uint64)

    def _id_weights(
        self,
        f: _Sparse,
        table: pa.Table,
        listed: bool,
        lengths: np.ndarray,
        offsets: np.ndarray,
        row_of: np.ndarray,
        checks: list[_Check],
    ) -> np.ndarray:
        """The weight of each id of ``f`` (1.0 for ids of rows whose weights do not fit:
        those rows are bad, and become padding)."""
        column = _plain_array(table.column(f.weights_column))
        n, c = len(lengths), f.weights_column
        if listed:
            if f.truncate:
                column = pc.list_slice(column, 0, f.max_length)
            counts = np.asarray(pc.fill_null(pc.list_value_length(column), 0), dtype=np.int64)
            w, _ = _floats(_plain_array(pc.list_flatten(column)))
            mismatch = counts != lengths
            checks.append((mismatch, lambda i: f"{c} has {counts[i]} weights for {lengths[i]} ids of {f.column}"))
            start = np.concatenate([[0], np.cumsum(counts)])[row_of] + (np.arange(len(row_of)) - offsets[row_of])
            fits = ~mismatch[row_of]
            weights = np.where(fits, w[np.where(fits, start, 0)] if len(w) else 1.0, 1.0)
            nonfinite = ~np.isfinite(w)
            checks.append(
                (
                    _rows_of(np.repeat(np.arange(n), counts), nonfinite, n),
                    lambda i: f"{c} has a null or non-finite weight",
                )
            )
        else:
            w, nulls = _floats(column)
            has_id = lengths == 1
            checks.append((has_id & nulls, lambda i: f"{c} is null where {f.column} has an id"))
            checks.append((has_id & ~nulls & ~np.isfinite(w), lambda i: f"{c} {w[i]} is not finite"))
            weights = w[has_id]
        return np.where(np.isfinite(weights), weights, 1.0).astype(np.float32)

    def _rows(self, parts: list[_Part]) -> Rows:
        """The parts' rows end to end, as ``Rows``: one-hot (``[F, n]`` ids, filled column by
        column) when every feature has one id in every row, else values and lengths."""
        features = len(self.sparse) + sum(not d.scalar for d in self.dense)
        if not parts:
            empty = np.zeros(0, np.int64)
            parts = [
                _Part(
                    np.zeros((0, sum(d.scalar for d in self.dense)), np.float32),
                    np.zeros(0, np.float32),
                    np.zeros(0, np.float32),
                    [(empty, np.zeros(0, np.int32), None)] * features,
                    np.zeros(0, bool),
                )
            ]
        cat = lambda arrays: arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
        real = cat([p.real for p in parts])
        n = len(real)
        extra = {"weights": cat([p.weights for p in parts])}
        dense, labels = cat([p.dense for p in parts]), cat([p.labels for p in parts])
        one_hot = not self.weighted and all(bool((p.ids[f][1] == 1).all()) for p in parts for f in range(features))
        if one_hot:
            ids = np.empty((features, n), np.int64)
            for f in range(features):
                ids[f] = cat([p.ids[f][0] for p in parts])
            rows = Rows.one_hot(dense, ids, labels, extra)
        else:
            weights = None
            if self.weighted:
                weights = [
                    cat(
                        [
                            (w if w is not None else np.ones(len(v), np.float32)).astype(np.float32)
                            for v, _, w in (p.ids[f] for p in parts)
                        ]
                    )
                    for f in range(features)
                ]
            rows = Rows.of(
                dense,
                [(cat([p.ids[f][0] for p in parts]), cat([p.ids[f][1] for p in parts])) for f in range(features)],
                labels,
                extra,
                weights,
            )
        rows.real = None if real.all() else torch.from_numpy(real)
        return rows


def _rows_of(row_of: np.ndarray, flagged: np.ndarray, n: int) -> np.ndarray:
    """The rows (mask of n) holding a flagged id."""
    mask = np.zeros(n, bool)
    mask[row_of[flagged]] = True
    return mask


def _as_padding(
    values: np.ndarray, lengths: np.ndarray, weights: Optional[np.ndarray], bad: np.ndarray
) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
    """A feature's ids with each bad row's replaced by padding's: one id 0 of weight 1."""
    n = len(lengths)
    row_of = np.repeat(np.arange(n), lengths)
    keep = ~bad[row_of]
    new_lengths = np.where(bad, 1, lengths).astype(np.int32)
    new_offsets = np.concatenate([[0], np.cumsum(new_lengths)]).astype(np.int64)
    old_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    at = new_offsets[row_of[keep]] + (np.arange(len(values)) - old_offsets[row_of])[keep]
    out = np.zeros(new_offsets[-1], np.int64)
    out[at] = values[keep]
    out_weights = None
    if weights is not None:
        out_weights = np.ones(new_offsets[-1], np.float32)
        out_weights[at] = weights[keep]
    return out, new_lengths, out_weights
