"""Parquet feature logs (``data=parquet``): a team's own rows (Spark, a feature store),
described entirely by the data config: which column is the label, the sample weight, each
dense feature and each sparse feature (one-hot or multi-hot, weighted or not, sharing tables
or not), and how ids become table rows.

A split is its files' rows in order (files sorted by name, row groups in file order), minus
the held-out validation runs when ``valid_fraction`` carves validation out of the training
files. Global batch k is rows [k*B, (k+1)*B) of the split, so the batches are the same for
every world size; rank r reads only its rows of each batch, from the row groups that cover
them (an index of cumulative row counts per file and row group, from the Parquet footers),
with ``ParquetFile.read_row_group``: never a whole file, so files larger than memory work.
The last row groups read are kept, so consecutive batches do not decode a group again. Every
value is converted by column (PyArrow compute and NumPy over a row group's slice): no Python
loop over rows, ids or values (strings are hashed by their distinct values, all at once).

Bad rows (a null or non-0/1 label, a null or non-finite dense value or sample weight, a list
longer than ``max_length``, a null id in a list, an id outside the table with
``id_mapping=none``, id weights that do not match the ids): a random-access source cannot
drop a row without shifting every later batch, which would make batches depend on who read
what before. So a bad row keeps its place and becomes padding: dense 0, one id 0 per
feature, label 0, not real (``Rows.real``), which gives it weight 0 in the loss and keeps it
out of every metric and of the predictions. It is counted with file and row (0-based, as
PyArrow and pandas index a file's rows); ``bad_rows=fail`` stops at the first one instead.

Rows and bad rows are counted on a split's first pass only; each rank counts the rows it
read (``per_rank_report``), and the run's report is the ranks' sum (the training tail that
fills no global batch is reported by the rank whose slice starts the last batch). Pooling
factors and, per hashed feature, the share of ids that collide (per vocabulary feature, the
share of ids outside it) are estimated on the first training rows when the source is built.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Iterator, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from hybridrec.config.schema import BadRows, DenseTransform, ParquetIdMapping
from hybridrec.data import (DataError, FileReport, ReadReport, SparseFeature, check_disjoint, holdout, shorten,
                            splitmix64)
from hybridrec.data.criteo import resolve_paths, validation_fraction
from hybridrec.data.source import Rows, Source

log = logging.getLogger(__name__)

HOLDOUT_RUN = 4096
"""valid_fraction holds out runs of this many consecutive rows of a file: a read stays a few
contiguous ranges of a row group."""
SAMPLE_ROWS = 100_000
"""Training rows (the first ones) on which pooling factors and collisions are estimated."""
_CACHED_GROUPS = 2  # per reader: a rank's slice (or one shard's chunk) can straddle two row groups
_OPEN_FILES = 8  # open ParquetFile handles kept per process, per reader

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_STRING_SALT = np.uint64(0xD1B54A32D192ED03)
_LENGTH_SALT = np.uint64(0x8CB92BA72F3D8DD7)
_VOCABULARY_SEED = 0  # the hash that finds strings in a vocabulary: internal, any value works


# ------------------------------------------------------------------------------------- hashing
def _salt(seed: int) -> np.uint64:
    # seed + 1: splitmix64(0) = 0, so seed 0 must not leave id 0 unmixed
    return np.uint64(((seed + 1) * int(_GOLDEN)) % 2**64)


def hash_ints(values: np.ndarray, seed: int) -> np.ndarray:
    """64-bit keys of int64 ids."""
    with np.errstate(over="ignore"):
        return splitmix64(values.astype(np.int64).view(np.uint64) + _salt(seed))


def hash_strings(array: pa.Array, seed: int) -> np.ndarray:
    """64-bit keys of strings (or binary), all at once: each (position, byte) pair is mixed
    on its own and the mixes are summed per string (a tabulation hash), then mixed with the
    length. Nulls hash as empty strings (callers drop or refuse them first)."""
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    n = len(array)
    if n == 0:
        return np.zeros(0, np.uint64)
    large = pa.types.is_large_string(array.type) or pa.types.is_large_binary(array.type)
    buffers = array.buffers()
    offsets = np.frombuffer(buffers[1], np.int64 if large else np.int32)[array.offset: array.offset + n + 1]
    offsets = offsets.astype(np.int64)
    data = np.frombuffer(buffers[2], np.uint8) if buffers[2] is not None else np.zeros(0, np.uint8)
    spans = np.diff(offsets)  # a null's span may hold bytes: they are skipped, not summed into a neighbour
    starts = offsets[:-1] - offsets[0]
    body = data[offsets[0]: offsets[-1]]
    salt = _salt(seed)
    sums = np.zeros(n, np.uint64)
    with np.errstate(over="ignore"):
        if len(body):
            position = np.arange(len(body), dtype=np.int64) - np.repeat(starts, spans)
            mixed = splitmix64(((position.astype(np.uint64) << np.uint64(8)) | body.astype(np.uint64))
                               + salt + _STRING_SALT)
            nonempty = np.flatnonzero(spans > 0)
            if len(nonempty):
                sums[nonempty] = np.add.reduceat(mixed, starts[nonempty])
        lengths = spans
        if array.null_count:
            nulls = np.asarray(array.is_null())
            sums[nulls], lengths = 0, np.where(nulls, 0, spans)
        return splitmix64(sums ^ splitmix64(lengths.astype(np.uint64) + salt + _LENGTH_SALT))


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


def _value(v: Any) -> Any:
    return v.value if isinstance(v, Enum) else v


def _plain(node: Any) -> Any:
    """A config node (DictConfig, ListConfig, dict, list) as plain Python, enums as their values."""
    if isinstance(node, (DictConfig, ListConfig)):
        node = OmegaConf.to_container(node, resolve=True)
    if isinstance(node, dict):
        return {k: _plain(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return [_plain(v) for v in node]
    return _value(node)


# ---------------------------------------------------------------------------- the config
@dataclass(frozen=True)
class _Dense:
    column: str
    transform: str
    mean: Optional[float]
    std: Optional[float]


@dataclass(frozen=True)
class _Sparse:
    index: int
    name: str
    column: str
    num_embeddings: int
    table: Optional[str]
    pooling: str
    weights_column: Optional[str]
    max_length: Optional[int]
    truncate: bool
    id_mapping: str
    vocabulary: Optional[str]

    @property
    def table_name(self) -> str:
        return self.table if self.table else f"t_{self.name}"


def _sparse_list(sparse: Any) -> list[_Sparse]:
    out = []
    for i, f in enumerate(_plain(sparse) or []):
        out.append(_Sparse(i, f["name"], f["column"], int(f["num_embeddings"]), f.get("table"),
                           f.get("pooling") or "sum", f.get("weights_column"), f.get("max_length"),
                           bool(f.get("truncate", False)), f.get("id_mapping") or "none", f.get("vocabulary")))
    return out


def _dense_list(dense: Any) -> list[_Dense]:
    return [_Dense(d["column"], d.get("transform") or "none", d.get("mean"), d.get("std")) for d in _plain(dense) or []]


# -------------------------------------------------------------------------- vocabularies
class Vocabulary:
    """A vocabulary file (``python -m hybridrec.data.vocab``): id i of the file (0-based, the
    file's order) is table row i + 1; row 0 is every id not in it. Looked up by binary search
    over sorted 64-bit keys (integers themselves; strings hashed, then compared), so no hash
    table of the whole vocabulary is built per read."""

    def __init__(self, path: str, key: str) -> None:
        try:
            ids = pq.read_table(path, columns=["id"]).column("id")
        except (OSError, pa.ArrowInvalid, KeyError) as e:
            raise DataError(f"{key}={path}: not a vocabulary file written by `python -m hybridrec.data.vocab` "
                            f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
        ids = _plain_array(ids)
        self.path, self.kind, self.size = path, _kind(ids.type), len(ids)
        if self.kind not in ("int", "str") or ids.null_count:
            raise DataError(f"{key}={path}: its ids are {ids.type}{' with nulls' if ids.null_count else ''}; "
                            f"a vocabulary holds integers or strings")
        if self.kind == "int":
            keys = np.asarray(pc.cast(ids, pa.int64()), dtype=np.int64)
        else:
            self.ids = ids.cast(pa.large_binary()) if pa.types.is_large_string(ids.type) or pa.types.is_large_binary(
                ids.type) else ids.cast(pa.binary())
            keys = hash_strings(ids, _VOCABULARY_SEED)
        self.order = np.argsort(keys, kind="stable")
        self.keys = keys[self.order]
        same = np.flatnonzero(self.keys[1:] == self.keys[:-1])
        if len(same):
            first = ids[int(self.order[same[0]])].as_py()
            raise DataError(f"{key}={path}: id {shorten(first)} is in it twice (or two strings share a 64-bit "
                            f"hash): write it again with `python -m hybridrec.data.vocab`")

    def rows(self, values: pa.Array) -> np.ndarray:
        """Table rows of non-null ids (1 + position in the file; 0 = not in the vocabulary)."""
        if len(values) == 0 or self.size == 0:
            return np.zeros(len(values), np.int64)
        if self.kind == "int":
            keys = np.asarray(pc.cast(values, pa.int64(), safe=False), dtype=np.int64)  # uint64 ids wrap: unknown
            at = np.minimum(np.searchsorted(self.keys, keys), self.size - 1)
            return np.where(self.keys[at] == keys, self.order[at] + 1, 0)
        encoded = pc.dictionary_encode(values)
        distinct = encoded.dictionary
        keys = hash_strings(distinct, _VOCABULARY_SEED)
        at = np.minimum(np.searchsorted(self.keys, keys), self.size - 1)
        hit = self.keys[at] == keys
        position = self.order[at]
        if hit.any():  # the hashes agree: the strings must too
            same = pc.equal(distinct.cast(self.ids.type), self.ids.take(pa.array(position)))
            hit &= np.asarray(pc.fill_null(same, False))
        rows = np.where(hit, position + 1, 0)
        return rows[np.asarray(encoded.indices, dtype=np.int64)]


# ------------------------------------------------------------------------------ the layout
@dataclass
class _File:
    path: str
    rows: int
    groups: np.ndarray
    """Cumulative rows at each row group's start, and the file's rows last (len = groups + 1)."""
    stream: int
    """The holdout stream of the file's rows (a hash of its name)."""


class _Split:
    """A split's rows: segments (file, first row, rows) laid end to end."""

    def __init__(self, files: list[_File], seg_file: np.ndarray, seg_start: np.ndarray, seg_count: np.ndarray) -> None:
        keep = seg_count > 0
        self.files = files
        self.seg_file, self.seg_start, self.seg_count = seg_file[keep], seg_start[keep], seg_count[keep]
        self.cum = np.concatenate([[0], np.cumsum(self.seg_count)]).astype(np.int64)
        self.total = int(self.cum[-1])

    def pieces(self, a: int, b: int) -> Iterator[tuple[int, int, int]]:
        """(file index, first row in the file, rows) of split rows [a, b), adjacent ranges of
        a file merged."""
        if a >= b:
            return
        i = int(np.searchsorted(self.cum, a, side="right")) - 1
        last = None
        while a < b:
            take = min(b, int(self.cum[i + 1])) - a
            f, start = int(self.seg_file[i]), int(self.seg_start[i]) + a - int(self.cum[i])
            if last is not None and last[0] == f and last[1] + last[2] == start:
                last = (f, last[1], last[2] + take)
            else:
                if last is not None:
                    yield last
                last = (f, start, take)
            a += take
            i += 1
        yield last

    def locate(self, row: int) -> tuple[str, int]:
        """The file and row in it of split row ``row``."""
        i = int(np.searchsorted(self.cum, row, side="right")) - 1
        return self.files[int(self.seg_file[i])].path, int(self.seg_start[i]) + row - int(self.cum[i])


class _Open:
    """What one process holds open: ParquetFile handles and the last decoded row groups.
    Never shared across fork: a worker process opens its own (``ParquetSource._state``)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.files: OrderedDict[str, pq.ParquetFile] = OrderedDict()
        self.groups: OrderedDict[tuple[str, int], tuple[frozenset[str], pa.Table]] = OrderedDict()
        self.lock = threading.Lock()


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


class ParquetSource(Source):
    """Rows of Parquet files, read by random access (see the module docstring)."""

    per_rank_report = True  # a rank reads, and counts, only its slice of each batch
    extra_fields = ("weights",)  # the sample weight; 0 for bad rows and padding

    @classmethod
    def check_config(cls, cfg: DictConfig, world_size: int) -> None:
        c = _plain(cfg)
        shards = c.get("shards")
        if shards is not None and (shards < 1 or shards % world_size or c["batch_size"] % shards):
            raise ValueError(
                f"data.shards={shards} must be a multiple of the world size ({world_size}) and divide "
                f"data.batch_size={c['batch_size']}: each rank reads whole shards. Set data.shards to a "
                f"multiple of {world_size} (it changes which rows make a batch), or unset it")
        fraction = c.get("valid_fraction") or 0.0
        if not 0 <= fraction < 1:
            raise ValueError(f"data.valid_fraction must be in [0, 1), got {fraction}")
        if fraction and c.get("valid_path"):
            raise ValueError("data.valid_path and data.valid_fraction are both set: choose one source of "
                             "validation rows")
        label = c.get("label") or {}
        if not label.get("column"):
            raise ValueError("data.label.column is not set: name the label column")
        if c.get("weight") is not None and c.get("weight") in ("", label["column"]):
            raise ValueError(f"data.weight={c.get('weight')!r} must name a sample weight column other than the label's")
        dense = _dense_list(c.get("dense"))
        seen: set[str] = set()
        for i, d in enumerate(dense):
            key = f"data.dense[{i}]"
            if d.column in seen:
                raise ValueError(f"{key}.column={d.column!r} is listed twice in data.dense")
            seen.add(d.column)
            given = (d.mean is not None, d.std is not None)
            if d.transform != DenseTransform.standardize.value and any(given):
                raise ValueError(f"{key}: mean and std belong to transform=standardize, not transform={d.transform}")
            if given[0] != given[1]:
                raise ValueError(f"{key}: set both mean and std, or neither (both are then fitted on the train split)")
            if d.std is not None and not d.std > 0:
                raise ValueError(f"{key}.std must be > 0, got {d.std}")
        sparse = _sparse_list(c.get("sparse"))
        if not sparse:
            raise ValueError("data.sparse lists no feature: give at least one (name, column, num_embeddings)")
        names: set[str] = set()
        tables: dict[str, _Sparse] = {}
        for f in sparse:
            key = f"data.sparse[{f.index}]"
            if not f.name or f.name in names:
                raise ValueError(f"{key}.name={f.name!r} is " + ("empty" if not f.name else "used twice")
                                 + ": feature names are the batch's keys and must be unique")
            names.add(f.name)
            if f.num_embeddings < 1:
                raise ValueError(f"{key}.num_embeddings must be >= 1, got {f.num_embeddings}")
            if f.max_length is not None and f.max_length < 1:
                raise ValueError(f"{key}.max_length must be >= 1 (or unset: any length), got {f.max_length}")
            if f.truncate and f.max_length is None:
                raise ValueError(f"{key}.truncate=true cuts lists to max_length: set {key}.max_length")
            if (f.id_mapping == ParquetIdMapping.vocabulary.value) != bool(f.vocabulary):
                raise ValueError(f"{key}: id_mapping=vocabulary and a vocabulary file go together "
                                 f"(id_mapping={f.id_mapping}, vocabulary={f.vocabulary})")
            if f.weights_column is not None and f.weights_column in ("", f.column):
                raise ValueError(f"{key}.weights_column={f.weights_column!r} must name a column other than its ids'")
            if f.table is not None and (not f.table or "." in f.table or hasattr(torch.nn.ModuleDict, f.table)):
                # TorchRec keeps the tables in an nn.ModuleDict keyed by name, which refuses these
                raise ValueError(f"{key}.table={f.table!r} cannot name a table: " + (
                    "leave it unset for a table of its own" if not f.table else "a name holds no '.'" if "." in f.table
                    else "it is an attribute of torch's ModuleDict, which holds the tables") + "; choose another name")
            other = tables.setdefault(f.table_name, f)
            for attr in ("num_embeddings", "pooling", "id_mapping", "vocabulary"):
                if getattr(other, attr) != getattr(f, attr):
                    raise ValueError(
                        f"data.sparse: {other.name} and {f.name} share table {f.table_name} but differ in {attr} "
                        f"({getattr(other, attr)} vs {getattr(f, attr)}): features of one table must agree on "
                        f"num_embeddings, pooling, id_mapping and vocabulary")

    def __init__(
        self,
        batch_size: int,
        train_path: str,
        eval_path: str,
        label: Any,
        sparse: Any,
        seed: int,
        dense: Any = (),
        weight: Optional[str] = None,
        valid_path: Optional[str] = None,
        valid_fraction: float = 0.0,
        hash_seed: int = 0,
        bad_rows: BadRows = BadRows.skip,
        eval_batches: Optional[int] = None,
        shards: Optional[int] = None,
    ) -> None:
        self.batch_size, self.seed, self.eval_batches = batch_size, seed, eval_batches
        self.shards = shards
        self.hash_seed = int(hash_seed)
        self.fail = _value(bad_rows) == BadRows.fail.value
        label = _plain(label)
        self.label_column, self.threshold_value = label["column"], label.get("threshold")
        self.weight_column = weight
        self.dense = _dense_list(dense)
        self.sparse = _sparse_list(sparse)
        self.num_dense_features = len(self.dense)
        self.valid_fraction = validation_fraction(valid_path, valid_fraction)
        specs = {"train": train_path, "eval": eval_path, **({"valid": valid_path} if valid_path else {})}
        paths = {split: resolve_paths(spec, f"data.{split}_path", "*.parquet") for split, spec in specs.items()}
        check_disjoint({f"data.{split}_path": p for split, p in paths.items()})
        self.splits = ("train", "valid", "eval") if valid_path or self.valid_fraction else ("train", "eval")
        self.columns = list(dict.fromkeys(
            [self.label_column] + ([weight] if weight else []) + [d.column for d in self.dense]
            + [c for f in self.sparse for c in (f.column, f.weights_column) if c]))
        self.vocabularies = {f.index: Vocabulary(f.vocabulary, f"data.sparse[{f.index}].vocabulary")
                             for f in self.sparse if f.id_mapping == ParquetIdMapping.vocabulary.value}
        for i, vocab in self.vocabularies.items():
            f = self.sparse[i]
            if f.num_embeddings < vocab.size + 1:
                raise DataError(f"data.sparse[{i}].num_embeddings={f.num_embeddings} is too small for "
                                f"{f.vocabulary} ({vocab.size} ids): it needs {vocab.size + 1} rows "
                                f"(row 0 is every id not in the vocabulary)")
        self._splits: dict[str, _Split] = {}
        files = {split: [self._index(p, f"data.{split}_path") for p in ps] for split, ps in paths.items()}
        for split, fs in files.items():
            self._splits[split] = self._layout(fs, None)
        if self.valid_fraction:
            self._splits["train"] = self._layout(files["train"], False)
            self._splits["valid"] = self._layout(files["train"], True)
        for split, sp in self._splits.items():
            if (sp.total < batch_size) if split == "train" else sp.total == 0:
                carved = split != "eval" and self.valid_fraction
                raise DataError(f"the {split} split has {sp.total} rows" + (
                    f" (data.train_path less data.valid_fraction={self.valid_fraction})" if carved else "")
                    + (f": fewer than one global batch (data.batch_size={batch_size})" if split == "train"
                       else ": nothing to evaluate"))
        self._open: Optional[_Open] = None
        self._report = ReadReport()
        self._counting: dict[str, Optional[int]] = {}  # the epoch a split's rows are counted in
        self._fitted = self._fit_dense()
        self.features = self._features()
        self._release()  # worker processes fork from here: they open their own files

    # -- building --------------------------------------------------------------------------
    def _index(self, path: str, key: str) -> _File:
        """The file's row groups and its columns, checked against the config."""
        try:
            meta = pq.read_metadata(path)
            schema = meta.schema.to_arrow_schema()
        except (OSError, pa.ArrowInvalid) as e:
            raise DataError(f"{path} ({key}): not a readable Parquet file ({str(e).splitlines()[0]})") from None
        types = {name: schema.field(name).type for name in schema.names}

        def need(column: str, what: str, ok: Callable[[pa.DataType], bool], expected: str) -> pa.DataType:
            if column not in types:
                raise DataError(f"{path}: no column {column!r} ({what}); its columns: {', '.join(schema.names)}")
            if not ok(types[column]):
                raise DataError(f"{path}: column {column!r} ({what}) is {types[column]}, expected {expected}")
            return types[column]

        numeric = lambda t: _kind(t) in _NUMERIC
        need(self.label_column, "data.label.column", numeric, "numbers or booleans")
        if self.weight_column:
            need(self.weight_column, "data.weight", lambda t: _kind(t) in ("int", "float", "decimal"), "numbers")
        for i, d in enumerate(self.dense):
            need(d.column, f"data.dense[{i}].column", numeric, "numbers or booleans")
        for f in self.sparse:
            key_ = f"data.sparse[{f.index}].column"
            kinds = {"none": ("int",), "hash": ("int", "str")}.get(
                f.id_mapping, (self.vocabularies[f.index].kind,) if f.index in self.vocabularies else ())
            element = lambda t: t.value_type if _is_list(t) else t
            t = need(f.column, key_, lambda t: _kind(element(t)) in kinds,
                     f"{' or '.join('integers' if k == 'int' else 'strings' for k in kinds)} (or lists of them)"
                     + (f": the vocabulary's ids are {'integers' if kinds == ('int',) else 'strings'}"
                        if f.id_mapping == "vocabulary" else ""))
            if f.weights_column:
                shape = _is_list(t)
                need(f.weights_column, f"data.sparse[{f.index}].weights_column",
                     lambda w: _is_list(w) == shape and _kind(element(w)) in ("int", "float", "decimal"),
                     "lists of numbers, like its ids" if shape else "numbers, like its ids (one per row)")
            if f.max_length is not None and not _is_list(t):
                raise DataError(f"{path}: data.sparse[{f.index}].max_length is set but column {f.column!r} is "
                                f"{t}, one id per row")
        starts = np.concatenate([[0], np.cumsum([meta.row_group(g).num_rows for g in range(meta.num_row_groups)])])
        return _File(path, int(meta.num_rows), starts.astype(np.int64), zlib.crc32(os.path.basename(path).encode()))

    def _layout(self, files: list[_File], held: Optional[bool]) -> _Split:
        """The split of ``files``: every row (held None), or the runs the holdout keeps
        (held False: training) or holds out (True: validation)."""
        seg_file, seg_start, seg_count = [], [], []
        for i, f in enumerate(files):
            if held is None:
                runs = np.zeros(1, np.int64)
                starts, counts = runs, np.array([f.rows], np.int64)
            else:
                runs = np.arange(-(-f.rows // HOLDOUT_RUN), dtype=np.int64)
                keep = holdout(self.seed, f.stream, runs, self.valid_fraction) == held
                starts = runs[keep] * HOLDOUT_RUN
                counts = np.minimum(HOLDOUT_RUN, f.rows - starts)
            seg_file.append(np.full(len(starts), i, np.int64))
            seg_start.append(starts)
            seg_count.append(counts)
        cat = lambda parts: np.concatenate(parts) if parts else np.zeros(0, np.int64)
        return _Split(files, cat(seg_file), cat(seg_start), cat(seg_count))

    def _fit_dense(self) -> bool:
        """Mean and std of each standardize column that left them unset, over the train
        split's rows, one row group at a time (Chan's parallel update: the same numbers
        whatever the row groups' sizes). Nulls and non-finite values (bad rows) are left out."""
        todo = [i for i, d in enumerate(self.dense)
                if d.transform == "standardize" and (d.mean is None or d.std is None)]
        if not todo:
            return False
        columns = list(dict.fromkeys(self.dense[i].column for i in todo))
        stats = {c: (0, 0.0, 0.0) for c in columns}
        for _, _, table in self._ranges("train", 0, self._splits["train"].total, columns):
            for c in columns:
                x, _ = _floats(_plain_array(table.column(c)))
                x = x[np.isfinite(x)]
                if not len(x):
                    continue
                n, mean, m2 = stats[c]
                k, mk = len(x), float(x.mean())
                m2k = float(((x - mk) ** 2).sum())
                total = n + k
                delta = mk - mean
                stats[c] = (total, mean + delta * k / total, m2 + m2k + delta * delta * n * k / total)
        for i in todo:
            d = self.dense[i]
            n, mean, m2 = stats[d.column]
            std = math.sqrt(m2 / n) if n else 0.0
            if not n or not std > 0:
                raise DataError(f"data.dense[{i}] ({d.column}): " + (
                    "no finite value in the train split to fit its mean and std" if not n else
                    f"every training value is {mean:g}: a constant feature cannot be standardized (drop it, or set "
                    f"data.dense[{i}].mean and std)"))
            self.dense[i] = _Dense(d.column, d.transform, mean, std)
        return True

    def fitted(self) -> dict[str, Any]:
        """The data-config keys this source computed at build, as config values: ``{"dense":
        [...]}`` (every dense entry, standardize's mean and std filled in) when some were
        fitted on the train split, else {}. Merged into the data config before launch, they
        travel with the run (ranks, run directory, a checkpoint's config.yaml), so the same
        numbers standardize serving inputs and no rank fits them again."""
        if not self._fitted:
            return {}
        return {"dense": [{"column": d.column, "transform": d.transform, "mean": d.mean, "std": d.std}
                          for d in self.dense]}

    def _features(self) -> list[SparseFeature]:
        """The features, with pooling factors (mean ids per row) and collisions estimated on
        the first SAMPLE_ROWS training rows; a table where most ids collide is warned about."""
        n = min(SAMPLE_ROWS, self._splits["train"].total)
        lengths = [[] for _ in self.sparse]
        keys: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in self.sparse]
        for file, first, table in self._ranges("train", 0, n, self.columns):
            part = self._convert(table, [(file, first, table.num_rows)], None, sample=True)
            for f in self.sparse:
                values, length, _ = part.ids[f.index]
                lengths[f.index].append(length[part.real])
                if part.keys[f.index] is not None:
                    keep = np.repeat(part.real, length)
                    keys[f.index].append((part.keys[f.index][keep], values[keep]))
        collisions = {}
        for f in self.sparse:
            if not keys[f.index]:
                continue
            raw, rows = (np.concatenate(a) for a in zip(*keys[f.index]))
            if f.id_mapping == "hash":
                pairs = np.unique(np.stack([rows.astype(np.uint64), raw]), axis=1)
                _, per_row = np.unique(pairs[0], return_counts=True)
                if pairs.shape[1] > len(per_row):
                    collisions[f.name] = {"distinct_ids": int(pairs.shape[1]), "distinct_rows": len(per_row),
                                          "sample_rows": n, "colliding_share": round(float(
                                              per_row[per_row > 1].sum()) / pairs.shape[1], 4)}
            elif len(rows):  # vocabulary: every unknown id shares row 0
                collisions[f.name] = {"sample_ids": len(rows), "oov_share": round(float((rows == 0).mean()), 4)}
        self._report.collisions = collisions
        crowded = {name: c for name, c in collisions.items() if c.get("colliding_share", 0) > 0.5}
        if crowded:
            log.warning("data: most ids collide in " + "; ".join(
                f"{name} ({c['distinct_ids']:,} ids on {c['distinct_rows']:,} rows over the first {n:,} training rows)"
                for name, c in crowded.items()) + ": raise their data.sparse[i].num_embeddings")
        features = []
        for f in self.sparse:
            seen = np.concatenate(lengths[f.index]) if lengths[f.index] else np.zeros(0)
            pooling_factor = round(float(seen.mean()), 4) if len(seen) else 1.0
            features.append(SparseFeature(f.name, f.num_embeddings, max(pooling_factor, 0.01), table=f.table,
                                          pooling=f.pooling, weighted=f.weights_column is not None))
        return features

    # -- the Source contract ---------------------------------------------------------------
    def num_batches(self, split: str) -> int:
        """Train: full global batches (the partial last one is dropped, and counted); evaluated
        splits: every row, the last batch padded by the loader."""
        total = self._splits[split].total
        if self.shards:  # per shard: its rows in chunks of B/S (the shortest shard bounds training)
            chunk, shortest, longest = self.batch_size // self.shards, total // self.shards, -(-total // self.shards)
            return shortest // chunk if split == "train" else -(-longest // chunk)
        return total // self.batch_size if split == "train" else -(-total // self.batch_size)

    def _spans(self, split: str, index: int, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """The split rows [a, b) that rows [lo, hi) of global batch ``index`` are, with the
        rows each range would hold before the split's end (b - a, but at the end). Without
        shards, one range. With S shards (shard s: the split's rows [s * total // S,
        (s + 1) * total // S); batch k takes its rows k*B/S .. (k+1)*B/S), one per shard the
        rank's rows cover, read in one call: a call per shard would convert every column once
        per shard, which costs more than the rows at small world sizes."""
        total = self._splits[split].total
        if not self.shards:
            return [(min(index * self.batch_size + lo, total), min(index * self.batch_size + hi, total), hi - lo)]
        chunk, out = self.batch_size // self.shards, []
        for s in range(lo // chunk, -(-hi // chunk)):
            first, end = s * total // self.shards, (s + 1) * total // self.shards
            a = first + index * chunk + max(lo - s * chunk, 0)
            b = first + index * chunk + min(hi - s * chunk, chunk)
            out.append((min(a, end), min(b, end), b - a))
        return out

    def begin_pass(self, split: str, epoch: int) -> None:
        # Count rows and bad rows on a split's first pass only (evaluations repeat; training
        # goes on into later epochs within one pass). Worker processes fork after this.
        self._counting[split] = None if split in self._counting else epoch

    def report(self) -> dict:
        return self._report.to_dict()

    def merge_report(self, part: ReadReport) -> None:
        self._report.merge(part)

    def read(self, split: str, epoch: int, index: int, lo: int, hi: int) -> Rows:
        """Rows [lo, hi) of global batch ``index``: split rows index * B + [lo, hi), fewer at
        the end of an evaluated split. The same rows every epoch (the files' order)."""
        sp = self._splits[split]
        counting = self._counting.get(split, epoch) == epoch
        report = ReadReport() if counting else None
        spans = self._spans(split, index, lo, hi)
        if len(spans) > 1 and any(b - a < want for a, b, want in spans):
            # The end of an evaluated split, shard by shard: each shard's rows padded in place,
            # so that every row keeps its position in the global batch whoever reads it.
            rows = Rows.cat([self._rows(self._convert_all(list(self._ranges(split, a, b, self.columns)), report))
                             .padded(want) for a, b, want in spans])
        else:
            ranges = [r for a, b, _ in spans for r in self._ranges(split, a, b, self.columns)]
            rows = self._rows(self._convert_all(ranges, report))
        if counting and split == "train" and lo == 0 and index == self.num_batches(split) - 1:
            # reported once per run: by the rank whose slice starts the batch (the report is a sum over ranks)
            report.dropped_tail_rows["train"] = sp.total - self.num_batches(split) * self.batch_size
        rows.report = report
        return rows

    # -- reading ---------------------------------------------------------------------------
    def _state(self) -> _Open:
        if self._open is None or self._open.pid != os.getpid():
            self._open = _Open()
        return self._open

    def _release(self) -> None:
        if self._open is not None and self._open.pid == os.getpid():
            for handle in self._open.files.values():
                handle.close()
        self._open = None

    def _ranges(self, split: str, a: int, b: int, columns: list[str]) -> Iterator[tuple[str, int, pa.Table]]:
        """Split rows [a, b) as (file, first row in it, table of ``columns``), one per row group
        range read. The decoded row groups are kept (the last few) for the next read."""
        sp = self._splits[split]
        state = self._state()
        for f, start, count in sp.pieces(a, b):
            file = sp.files[f]
            end = start + count
            g = int(np.searchsorted(file.groups, start, side="right")) - 1
            while start < end:
                group_start, group_end = int(file.groups[g]), int(file.groups[g + 1])
                take = min(end, group_end) - start
                if take > 0:
                    with state.lock:
                        table = self._group(state, file, g, columns)
                    yield file.path, start, table.slice(start - group_start, take)
                start += max(take, 0)
                g += 1

    def _group(self, state: _Open, file: _File, g: int, columns: list[str]) -> pa.Table:
        key = (file.path, g)
        cached = state.groups.get(key)
        # (the columns as a set, kept beside the table: ``column_names`` builds a new list per call)
        if cached is not None and cached[0].issuperset(columns):
            state.groups.move_to_end(key)
            return cached[1]
        handle = state.files.get(file.path)
        if handle is None:
            handle = state.files[file.path] = pq.ParquetFile(file.path)
            while len(state.files) > _OPEN_FILES * (self.shards or 1):
                state.files.popitem(last=False)[1].close()
        state.files.move_to_end(file.path)
        try:
            table = handle.read_row_group(g, columns=columns)
        except (OSError, pa.ArrowException) as e:
            raise DataError(f"{file.path}: row group {g} (rows {file.groups[g]}..{file.groups[g + 1] - 1}) cannot be "
                            f"read: {str(e).splitlines()[0]}") from None
        state.groups[key] = (frozenset(table.column_names), table)
        # With data.shards a process reads up to S shards in turn (1 rank: all of them): room for
        # each one's groups, or the shards would evict each other's group at every batch.
        while len(state.groups) > _CACHED_GROUPS * (self.shards or 1):
            state.groups.popitem(last=False)
        return table

    def _convert_all(self, ranges: list[tuple[str, int, pa.Table]], report: Optional[ReadReport]) -> list[_Part]:
        """The ranges (file, first row, rows) converted as one table when their schemas agree:
        converting costs per column more than per row, so a slice made of several row groups,
        files or shards is converted once. Files whose schemas differ (an int32 column in one,
        int64 in another) are converted one by one."""
        if len(ranges) > 1:
            try:
                table = pa.concat_tables([t for _, _, t in ranges])
            except pa.ArrowInvalid:
                pass
            else:
                return [self._convert(table, [(f, first, t.num_rows) for f, first, t in ranges], report)]
        return [self._convert(t, [(f, first, t.num_rows)], report) for f, first, t in ranges]

    def _convert(self, table: pa.Table, spans: list[tuple[str, int, int]], report: Optional[ReadReport],
                 sample: bool = False) -> _Part:
        """The rows of ``table``, which are ``spans`` (file, first row, rows) end to end, as
        arrays, every column checked at once; bad rows become padding, counted in ``report``
        (or raised with bad_rows=fail) with their file and row.
        ``sample``: nothing is counted or raised, and id keys are kept for the estimates."""
        n = table.num_rows
        checks: list[_Check] = []
        labels, label_checks = self._labels(_plain_array(table.column(self.label_column)))
        checks += label_checks
        weights = np.ones(n, np.float32)
        if self.weight_column:
            w, nulls = _floats(_plain_array(table.column(self.weight_column)))
            bad = ~nulls & ~(np.isfinite(w) & (w >= 0))
            checks += [(nulls, lambda i: f"sample weight {self.weight_column} is null"),
                       (bad, lambda i, w=w: f"sample weight {self.weight_column} {w[i]:g} is not a finite number >= 0")]
            weights = np.where(nulls | bad, 0, w).astype(np.float32)
        dense = np.zeros((n, len(self.dense)), np.float32)
        for j, d in enumerate(self.dense):
            x, nulls = _floats(_plain_array(table.column(d.column)))
            with np.errstate(all="ignore"):
                if d.transform == "log1p":
                    y = np.log1p(np.maximum(x, 0))
                elif d.transform == "standardize":
                    y = (x - d.mean) / d.std
                else:
                    y = x
                y = y.astype(np.float32)
            raw_bad = ~nulls & ~np.isfinite(x)
            over = ~nulls & ~raw_bad & ~np.isfinite(y)
            checks += [(nulls, lambda i, c=d.column: f"{c} is null"),
                       (raw_bad, lambda i, c=d.column, x=x: f"{c} {x[i]} is not finite"),
                       (over, lambda i, c=d.column, x=x, t=d.transform:
                        f"{c} {x[i]:g} is out of float32's range after {t}")]
            dense[:, j] = np.where(nulls | raw_bad | over, 0, y)
        ids, keys = [], []
        for f in self.sparse:
            values, lengths, id_weights, key, sparse_checks = self._ids(f, table, sample)
            ids.append((values, lengths, id_weights))
            keys.append(key)
            checks += sparse_checks
        bad = np.zeros(n, bool)
        for mask, _ in checks:
            bad |= mask
        if bad.any() and not sample:
            self._bad_rows(bad, checks, spans, report)
        if report is not None:
            at = 0
            for path, _, count in spans:
                report.good(path, int(count - bad[at: at + count].sum()))
                at += count
        if bad.any() and not sample:  # a sample keeps its ids as read: the estimates filter by ``real``
            dense[bad] = 0
            labels = np.where(bad, 0, labels).astype(np.float32)
            weights = np.where(bad, 0, weights).astype(np.float32)
            ids = [_as_padding(values, lengths, w, bad) for values, lengths, w in ids]
        return _Part(dense, labels, weights, ids, ~bad, keys if sample else None)

    def _bad_rows(self, bad: np.ndarray, checks: list[_Check], spans: list[tuple[str, int, int]],
                  report: Optional[ReadReport]) -> None:
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
        rest = np.searchsorted(starts, where[len(kept):], side="right") - 1  # the rest are counted, by file
        for j, count in zip(*np.unique(rest, return_counts=True)):
            report.files.setdefault(spans[int(j)][0], FileReport()).bad_rows += int(count)

    def _labels(self, column: pa.Array) -> tuple[np.ndarray, list[_Check]]:
        x, nulls = _floats(column)
        c = self.label_column
        checks: list[_Check] = [(nulls, lambda i: f"label {c} is null")]
        if self.threshold_value is not None:
            nan = ~nulls & np.isnan(x)
            checks.append((nan, lambda i: f"label {c} is NaN"))
            return np.where(nulls | nan, 0, x > self.threshold_value).astype(np.float32), checks
        wrong = ~nulls & (x != 0) & (x != 1)
        checks.append((wrong, lambda i: f"label {c} {x[i]:g} is not 0 or 1 (or set data.label.threshold)"))
        return np.where(nulls | wrong, 0, x).astype(np.float32), checks

    def _ids(self, f: _Sparse, table: pa.Table, sample: bool
             ) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray], Optional[np.ndarray], list[_Check]]:
        """Feature ``f`` of the rows: table rows of its ids (flat), ids per row, each id's
        weight (weighted features), the ids' 64-bit keys (``sample``) and its checks."""
        column = _plain_array(table.column(f.column))
        n = len(column)
        checks: list[_Check] = []
        listed = _is_list(column.type)
        if (not listed and not column.null_count and f.id_mapping == ParquetIdMapping.none.value
                and not f.weights_column and _kind(column.type) == "int"):
            # One id per row that is already a table row (converted Criteo, say): no list
            # offsets to build and no cast, the column's own buffer checked as it is.
            values = column.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
            outside = (values < 0) | (values >= f.num_embeddings)
            if outside.any():
                checks.append((outside, lambda i, v=values: f"{f.column}: id {v[i]} is outside the table's rows "
                                                            f"0..{f.num_embeddings - 1} (id_mapping=none)"))
                values = np.where(outside, 0, values)
            return values, np.ones(n, np.int32), None, None, checks
        if listed:
            if f.truncate:
                column = pc.list_slice(column, 0, f.max_length)
            lengths = np.asarray(pc.fill_null(pc.list_value_length(column), 0), dtype=np.int64)
            flat = _plain_array(pc.list_flatten(column))
            if f.max_length is not None and not f.truncate:
                checks.append((lengths > f.max_length, lambda i: f"{f.column} has {lengths[i]} ids, more than "
                                                                 f"data.sparse[{f.index}].max_length={f.max_length}"))
        else:  # a null: a row without ids
            lengths = (~np.asarray(column.is_null())).astype(np.int64) if column.null_count else np.ones(n, np.int64)
            flat = pc.drop_null(column) if column.null_count else column
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        row_of = np.repeat(np.arange(n), lengths)
        kind = _kind(flat.type)
        if flat.null_count:
            nulls = np.asarray(flat.is_null())
            checks.append((_rows_of(row_of, nulls, n), lambda i: f"{f.column} has a null id in its list"))
            fill = 0 if kind == "int" else ("" if pa.types.is_string(flat.type) or pa.types.is_large_string(flat.type)
                                            else b"")
            flat = pc.fill_null(flat, pa.scalar(fill, flat.type))
        key = None
        if f.id_mapping == ParquetIdMapping.none.value:
            values = np.asarray(pc.cast(flat, pa.int64(), safe=False), dtype=np.int64)
            outside = (values < 0) | (values >= f.num_embeddings)
            if outside.any():
                def why(i: int, ids=flat, outside=outside) -> str:
                    k = offsets[i] + int(np.argmax(outside[offsets[i]: offsets[i + 1]]))
                    return (f"{f.column}: id {ids[int(k)].as_py()} is outside the table's rows "
                            f"0..{f.num_embeddings - 1} (id_mapping=none)")
                checks.append((_rows_of(row_of, outside, n), why))
                values = np.where(outside, 0, values)
        elif f.id_mapping == ParquetIdMapping.hash.value:
            if kind == "int":
                key = hash_ints(np.asarray(pc.cast(flat, pa.int64(), safe=False), dtype=np.int64), self.hash_seed)
            elif len(flat):
                encoded = pc.dictionary_encode(flat)
                key = hash_strings(encoded.dictionary, self.hash_seed)[np.asarray(encoded.indices, dtype=np.int64)]
            else:
                key = np.zeros(0, np.uint64)
            values = (key % np.uint64(f.num_embeddings)).astype(np.int64)
        else:
            values = self.vocabularies[f.index].rows(flat)
            key = values.astype(np.uint64)
        weights = self._id_weights(f, table, listed, lengths, offsets, row_of, checks) if f.weights_column else None
        return values, lengths.astype(np.int32), weights, key if sample else None, checks

    def _id_weights(self, f: _Sparse, table: pa.Table, listed: bool, lengths: np.ndarray, offsets: np.ndarray,
                    row_of: np.ndarray, checks: list[_Check]) -> np.ndarray:
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
            checks.append((_rows_of(np.repeat(np.arange(n), counts), nonfinite, n),
                           lambda i: f"{c} has a null or non-finite weight"))
        else:
            w, nulls = _floats(column)
            has_id = lengths == 1
            checks.append((has_id & nulls, lambda i: f"{c} is null where {f.column} has an id"))
            checks.append((has_id & ~nulls & ~np.isfinite(w), lambda i: f"{c} {w[i]} is not finite"))
            weights = w[has_id]
        return np.where(np.isfinite(weights), weights, 1.0).astype(np.float32)

    def _rows(self, parts: list[_Part]) -> Rows:
        features = len(self.sparse)
        if not parts:
            empty = np.zeros(0, np.int64)
            parts = [_Part(np.zeros((0, len(self.dense)), np.float32), np.zeros(0, np.float32), np.zeros(0, np.float32),
                           [(empty, np.zeros(0, np.int32), None)] * features, np.zeros(0, bool))]
        cat = lambda arrays: torch.from_numpy(np.ascontiguousarray(np.concatenate(arrays)))
        real = np.concatenate([p.real for p in parts])
        id_weights = None
        if self.weighted:
            id_weights = [cat([(w if w is not None else np.ones(len(v), np.float32)).astype(np.float32)
                               for v, _, w in (p.ids[f] for p in parts)]) for f in range(features)]
        return Rows(
            cat([p.dense for p in parts]),
            [cat([p.ids[f][0].astype(np.int64) for p in parts]) for f in range(features)],
            [cat([p.ids[f][1].astype(np.int32) for p in parts]) for f in range(features)],
            cat([p.labels for p in parts]),
            {"weights": cat([p.weights for p in parts])},
            None if real.all() else torch.from_numpy(real),
            id_weights=id_weights,
        )


def _rows_of(row_of: np.ndarray, flagged: np.ndarray, n: int) -> np.ndarray:
    """The rows (mask of n) holding a flagged id."""
    mask = np.zeros(n, bool)
    mask[row_of[flagged]] = True
    return mask


def _as_padding(values: np.ndarray, lengths: np.ndarray, weights: Optional[np.ndarray], bad: np.ndarray
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
