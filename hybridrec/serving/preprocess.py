"""Raw rows into an export's program inputs, from the export directory alone:

    from hybridrec.serving import Preprocessor
    prep = Preprocessor.load("ckpt/step_00000400/export")
    program = torch.export.load("ckpt/step_00000400/export/model.pt2").module()
    scores = program(*prep(rows))    # rows: a pyarrow Table, a Parquet file, or {column: values}

``preprocessing.json`` (written by ``hybridrec.export``, described in
``hybridrec.data.raw_inputs``) says, per feature, which raw column is read and how it becomes
what the program takes; the files it names (vocabularies, join tables, the managed ids) sit
beside it, with their sha256. Nothing of the training run is read (not its config.yaml, not
its data folder): the ids are mapped by the very functions training maps them with
(``hybridrec.data.parquet``'s hashes and vocabulary lookup), so the inputs are the ones the
model was trained and evaluated on.

A row that training would have refused or made padding (a null dense value, an id outside
its table, a list longer than its limit, weights that do not match the ids) is refused here,
with the column and the row: a server must not score a row the model never saw the like of
as if it were one.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from hybridrec.config import IdMapping
from hybridrec.data import numeric, portable
from hybridrec.data.criteo.common import map_ids
from hybridrec.data.parquet.columns import _is_list, _kind, _plain_array
from hybridrec.data.parquet.hashing import hash_ints, hash_strings
from hybridrec.data.parquet.vocabulary import Vocabulary
from hybridrec.data.raw_inputs import FORMAT, Malformed, check_description, sha256

PREPROCESSING = "preprocessing.json"
Rows = Union[pa.Table, pa.RecordBatch, str, os.PathLike, Mapping[str, Any]]
"""Raw rows: a pyarrow Table or RecordBatch, a Parquet file's path, or {column: list of values}."""


def _refuse(message: str) -> ValueError:
    return ValueError(f"hybridrec: {message}")


@dataclass(frozen=True)
class _Join:
    keys: np.ndarray
    """The join's keys (its ``on`` column), sorted."""
    table: pa.Table
    """Its rows in the keys' order."""
    on: str
    missing: dict[str, Any]


def inputs(export_dir: str, rows: Rows) -> tuple[torch.Tensor, ...]:
    """The exported program's positional inputs for ``rows`` (``program(*inputs(...))``);
    ``Preprocessor.load(export_dir)`` once and call it per request when serving."""
    return Preprocessor.load(export_dir)(rows)


class Preprocessor:
    """An export's preprocessing, loaded and checked once (``load``); calling it turns raw
    rows into the program's positional inputs: ``(dense, values, lengths)``, and
    ``weights`` after them when a feature is weighted (``program_inputs``)."""

    def __init__(
        self,
        export_dir: str,
        spec: dict[str, Any],
        joins: dict[str, _Join],
        vocabularies: dict[str, Vocabulary],
        managed: Optional[pa.Table],
    ) -> None:
        self.export_dir, self.spec = export_dir, spec
        self._joins, self._vocabularies, self._managed = joins, vocabularies, managed
        self.program_inputs: list[str] = list(spec["program_inputs"])
        self.weighted = "weights" in self.program_inputs

    @classmethod
    def load(cls, export_dir: str, managed_ids: Optional[str] = None) -> "Preprocessor":
        """Read ``preprocessing.json`` and the files it names, each checked against its
        sha256: a missing or damaged file is one ``hybridrec: ...`` ValueError naming it.
        ``managed_ids``: the managed ids' file to map with instead of the export's own, for
        weights with deltas applied (``hybridrec.serving.delta.load``): the last applied delta's
        ``deltas/managed_ids_NNNNN.parquet``, which the ids' rows of those weights are."""
        path = os.path.join(export_dir, PREPROCESSING)
        if not os.path.isfile(path):
            model = os.path.join(export_dir, "model.json")
            why = ""
            if os.path.isfile(model):
                why = json.load(open(model)).get("preprocessing_missing", "")
            raise _refuse(
                f"{path} is missing: {why or 'an export of this hybridrec writes it beside model.json'}; "
                f"export the checkpoint again (python -m hybridrec.export checkpoint=<dir>)"
            )
        try:
            with open(path) as f:
                spec = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise _refuse(f"{path} cannot be read ({e}): export the checkpoint again") from None
        if not isinstance(spec, dict) or spec.get("format") != FORMAT:
            raise _refuse(
                f"{path} has format {spec.get('format') if isinstance(spec, dict) else None!r}; this "
                f"hybridrec reads format {FORMAT}: export the checkpoint again with it"
            )
        try:
            named = check_description(spec)
        except Malformed as e:
            raise _refuse(f"{path} is damaged or was edited: {e}; export the checkpoint again") from None
        if unlisted := [n for n in named if n not in spec["files"]]:
            raise _refuse(
                f"{path} is damaged or was edited: it reads {unlisted[0]} but its 'files' records no sha256 "
                f"for it (every file an export reads is listed); export the checkpoint again"
            )
        for name, digest in spec["files"].items():
            file = _inside(export_dir, name, path)
            if not os.path.isfile(file):
                raise _refuse(f"{file} is missing: {PREPROCESSING} needs it; copy the whole export directory")
            if sha256(file) != digest:
                raise _refuse(
                    f"{file} is damaged (its sha256 is not the one {PREPROCESSING} records): copy the "
                    f"export directory again from where it was written"
                )
        if managed_ids is not None:
            managed_ids = _delta_managed_ids(export_dir, managed_ids)
        joins = {j["name"]: _load_join(export_dir, j, path) for j in spec["joins"]}
        vocabularies = {}
        managed = None
        for f in spec["sparse"]:
            ids = f["ids"]
            if ids["kind"] == "vocabulary" and ids["file"] not in vocabularies:
                try:
                    vocabularies[ids["file"]] = Vocabulary(
                        _inside(export_dir, ids["file"], path), f"feature {f['name']}'s vocabulary"
                    )
                except ValueError as e:
                    raise _refuse(str(e)) from None
            elif ids["kind"] == "managed" and managed is None:
                managed = _read_parquet(managed_ids or _inside(export_dir, ids["file"], path), "the managed ids' file")
        return cls(export_dir, spec, joins, vocabularies, managed)

    @property
    def columns(self) -> list[str]:
        """The raw columns a row must have."""
        cols = [d["column"] for d in self.spec["dense"] if d["column"] and not d["join"]]
        cols += [c for f in self.spec["sparse"] if not f["join"] for c in (f["column"], f["weights_column"]) if c]
        cols += [j["on"] for j in self.spec["joins"]]
        return list(dict.fromkeys(cols))

    def __call__(self, rows: Rows) -> tuple[torch.Tensor, ...]:
        table = self._table(rows)
        if missing := [c for c in self.columns if c not in table.column_names]:
            raise _refuse(
                f"the rows have no column {missing[0]!r}"
                + (f" (nor {', '.join(map(repr, missing[1:]))})" if missing[1:] else "")
                + f"; this export reads {', '.join(self.columns)}: {self.spec['rows']}"
            )
        n = table.num_rows
        joined = {name: self._joined(j, table) for name, j in self._joins.items()}

        def column(entry: dict[str, Any], name: str, empty: pa.DataType) -> pa.Array:
            """``name`` of the rows or of the entry's join; a column of nulls only (which a
            {column: values} holding None alone makes, of no type) as ``empty``'s nulls."""
            array = joined[entry["join"]][name] if entry["join"] else _plain_array(table.column(name))
            return array.cast(empty) if pa.types.is_null(array.type) else array

        dense = np.zeros((n, len(self.spec["dense"])), np.float32)
        for j, d in enumerate(self.spec["dense"]):
            dense[:, j] = _dense(d, column(d, d["column"], pa.float64()) if d["column"] else None, n)
        values, lengths, weights = [], [], []
        for f in self.spec["sparse"]:
            ids, length, w = self._sparse(
                f,
                column(f, f["column"], pa.string() if f["ids"]["kind"] == "hex" else pa.int64()),
                column(f, f["weights_column"], pa.float64()) if f["weights_column"] else None,
            )
            values.append(ids)
            lengths.append(length)
            weights.append(w if w is not None else np.ones(len(ids), np.float32))
        out: tuple[torch.Tensor, ...] = (
            torch.from_numpy(dense),
            torch.from_numpy(np.concatenate(values).astype(np.int64)),
            torch.from_numpy(np.concatenate(lengths).astype(np.int32)),
        )
        if self.weighted:
            out = (*out, torch.from_numpy(np.concatenate(weights).astype(np.float32)))
        return out

    # -- the rows --------------------------------------------------------------------------
    @staticmethod
    def _table(rows: Rows) -> pa.Table:
        if isinstance(rows, pa.Table):
            return rows
        if isinstance(rows, pa.RecordBatch):
            return pa.Table.from_batches([rows])
        if isinstance(rows, (str, os.PathLike)):
            return _read_parquet(os.fspath(rows), "the rows")
        if isinstance(rows, Mapping):
            for name, values in rows.items():  # each column alone first: the error names it
                try:
                    pa.array(values)
                except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as e:
                    raise _refuse(
                        f"column {name!r} cannot be read as one array ({str(e).splitlines()[0][:200]}): "
                        f"give values of one type (ids within 64 bits)"
                    ) from None
            try:
                return pa.table(dict(rows))
            except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as e:
                raise _refuse(
                    f"the rows' columns cannot be read as a table ({e}): give one list of values per "
                    f"column, all of the same length"
                ) from None
        raise _refuse(
            f"rows of type {type(rows).__name__}: give a pyarrow Table, a Parquet file's path or {{column: values}}"
        )

    def _joined(self, j: _Join, table: pa.Table) -> dict[str, pa.Array]:
        """The join's columns for each row (its ``missing`` values where the key is not in it)."""
        key = _plain_array(table.column(j.on))
        if _kind(key.type) != "int" or key.null_count:
            raise _refuse(
                f"column {j.on!r} is {key.type}{' with nulls' if key.null_count else ''}: it holds the "
                f"ids the export's {j.on} join is keyed by, integers"
            )
        keys = np.asarray(pc.cast(key, pa.int64()), np.int64)
        at = np.minimum(np.searchsorted(j.keys, keys), len(j.keys) - 1)  # a join holds one row at least (load)
        found = pa.array(j.keys[at] == keys)
        out = {}
        for name in j.table.column_names:
            if name != j.on:
                values = _plain_array(j.table.column(name)).take(pa.array(at))
                out[name] = _plain_array(pc.if_else(found, values, pa.scalar(j.missing[name], values.type)))
        return out

    def _sparse(
        self, f: dict[str, Any], column: pa.Array, weights: Optional[pa.Array]
    ) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
        """Feature ``f``'s table rows (flat), ids per row and id weights."""
        name, n = f"column {f['column']!r} (feature {f['name']})", len(column)
        if f["ids"]["kind"] == "numeric":
            return _numeric(f, column, name)
        if f["ids"]["kind"] == "hex" and column.null_count:  # a missing Criteo id is id 0, as an empty field
            column = pc.fill_null(column, pa.scalar("", column.type))
        if column.null_count and f["null_rows"] == "error":
            raise _refuse(
                f"{name} is null in row {_first(column.is_null())}: training refused such rows "
                f"(null_ids=bad); give an id"
            )
        listed = _is_list(column.type)
        if listed:
            if f["truncate"]:
                column = pc.list_slice(column, 0, f["max_length"])
            lengths = np.asarray(pc.fill_null(pc.list_value_length(column), 0), np.int64)
            flat = _plain_array(pc.list_flatten(column))
            if f["max_length"] is not None and (lengths > f["max_length"]).any():
                i = int(np.argmax(lengths > f["max_length"]))
                raise _refuse(
                    f"{name} has {lengths[i]} ids in row {i}, more than its max_length={f['max_length']}: "
                    f"training refused such rows; cut the list"
                )
            if flat.null_count:
                raise _refuse(
                    f"{name} has a null id in its list (row {_row_of(lengths, _first(flat.is_null()))}): give ids only"
                )
        else:
            lengths = (~np.asarray(column.is_null())).astype(np.int64) if column.null_count else np.ones(n, np.int64)
            flat = pc.drop_null(column) if column.null_count else column
        rows = self._rows(f, flat, name, lengths)
        w = None
        if weights is not None:
            w = _id_weights(f, weights, listed, lengths)
        return rows, lengths.astype(np.int32), w

    def _rows(self, f: dict[str, Any], flat: pa.Array, name: str, lengths: np.ndarray) -> np.ndarray:
        """Table rows of the ids ``flat``, by the feature's mapping."""
        ids, kind = f["ids"], _kind(flat.type)
        accepted = {
            "row": ("int",),
            "hash": ("int", "str"),
            "managed": ("int", "str"),
            "hex": ("str",),
            "vocabulary": (self._vocabularies[ids["file"]].kind,) if ids["kind"] == "vocabulary" else (),
        }
        if kind not in accepted[ids["kind"]] and len(flat):
            wanted = " or ".join("integers" if k == "int" else "strings" for k in accepted[ids["kind"]])
            raise _refuse(f"{name} holds {flat.type} ids; its ids are {wanted} (or lists of them), as in training")
        if ids["kind"] == "row":
            rows = np.asarray(pc.cast(flat, pa.int64(), safe=False), np.int64)
            outside = (rows < 0) | (rows >= f["num_embeddings"])
            if outside.any():
                if ids["outside"] != "row_0":
                    i = int(np.argmax(outside))
                    raise _refuse(
                        f"{name}: id {rows[i]} in row {_row_of(lengths, i)} is outside the table's rows "
                        f"0..{f['num_embeddings'] - 1}: training refused such rows"
                    )
                rows = np.where(outside, 0, rows)
            return rows
        if ids["kind"] == "vocabulary":
            return self._vocabularies[ids["file"]].rows(flat)
        if ids["kind"] == "hex":
            mapping = {"splitmix64": IdMapping.hash, "none": IdMapping.modulo}[ids["function"]]
            return map_ids(_hex(flat, name, lengths)[:, None], np.array([ids["modulo"]]), mapping)[:, 0]
        if ids["function"] != "splitmix64":
            raise _refuse(f"feature {f['name']}: id function {ids['function']!r} is not one this hybridrec has")
        keys = _keys(flat, kind, int(ids["seed"]))
        if ids["kind"] == "hash":
            return (keys % np.uint64(ids["modulo"])).astype(np.int64)
        return _managed_rows(self._managed, ids["table"], keys)


def _inside(export_dir: str, name: str, described_in: str) -> str:
    """The path of a file the export's description names, which must be a file of the export
    itself: a name that is absolute, climbs out (``..``) or resolves outside through a link
    is refused (an edited description must not make serving read another file)."""
    parts = name.replace("\\", "/").split("/")
    full = os.path.join(export_dir, name)
    home = os.path.realpath(export_dir)
    if os.path.isabs(name) or ".." in parts or os.path.commonpath([os.path.realpath(full), home]) != home:
        raise _refuse(
            f"{described_in} is damaged or was edited: it names {name!r}, which is not a file of the export "
            f"{export_dir}; export the checkpoint again"
        )
    return full


def _delta_managed_ids(export_dir: str, path: str) -> str:
    """A delta's managed ids (``deltas/managed_ids_NNNNN.parquet``), checked against the sha256
    its delta (``deltas/delta_NNNNN.pt``) records for it."""
    from hybridrec.serving import delta

    home = os.path.realpath(os.path.join(export_dir, delta.DELTAS))
    m = re.fullmatch(r"managed_ids_(\d{5})\.parquet", os.path.basename(path))
    if not m or os.path.commonpath([os.path.realpath(path), home]) != home:
        raise _refuse(
            f"managed_ids={path}: give one of {os.path.join(export_dir, delta.DELTAS)}'s "
            f"managed_ids_NNNNN.parquet (the ids of the weights its delta of the same number gives)"
        )
    named = os.path.join(export_dir, delta.DELTAS, f"delta_{m.group(1)}.pt")
    if not os.path.isfile(named) or not os.path.isfile(path):
        raise _refuse(f"{path if not os.path.isfile(path) else named} is missing: copy the export's deltas again")
    recorded = delta.read(named).get("managed_ids_sha256")
    if recorded is None:
        raise _refuse(
            f"{named} records no sha256 of {os.path.basename(path)} (written by an older hybridrec): its ids "
            f"cannot be verified; write the export and its deltas again"
        )
    if sha256(path) != recorded:
        raise _refuse(
            f"{path} is damaged or was edited (its sha256 is not the one {named} records): copy the "
            f"export's deltas again"
        )
    return path


def _first(mask: Any) -> int:
    return int(np.argmax(np.asarray(mask)))


def _row_of(lengths: np.ndarray, k: int) -> int:
    """The row holding flat id ``k``."""
    return int(np.searchsorted(np.cumsum(lengths), k, side="right"))


def _read_parquet(path: str, what: str) -> pa.Table:
    try:
        return pq.read_table(path)
    except (OSError, pa.ArrowInvalid) as e:
        raise _refuse(f"{path} ({what}) is not a readable Parquet file ({str(e).splitlines()[0]})") from None


def _load_join(export_dir: str, spec: dict[str, Any], described_in: str) -> _Join:
    table = _read_parquet(_inside(export_dir, spec["file"], described_in), f"the {spec['name']} join")
    if spec["on"] not in table.column_names:
        raise _refuse(
            f"{os.path.join(export_dir, spec['file'])} (the {spec['name']} join) has no column "
            f"{spec['on']!r}: export again"
        )
    keys = np.asarray(table.column(spec["on"]), np.int64)
    if not len(keys):
        raise _refuse(f"{os.path.join(export_dir, spec['file'])} (the {spec['name']} join) has no rows: export again")
    values = sorted(c for c in table.column_names if c != spec["on"])
    if sorted(spec["missing"]) != values:  # a row whose key is not in the join takes these
        raise _refuse(
            f"{described_in} is damaged or was edited: joins {spec['name']!r} has 'missing' values for "
            f"{sorted(spec['missing'])}, and its file's columns are {values}; export the checkpoint again"
        )
    order = np.argsort(keys, kind="stable")
    return _Join(keys[order], table.take(pa.array(order)), spec["on"], spec["missing"])


def _dense(d: dict[str, Any], column: Optional[pa.Array], n: int) -> np.ndarray:
    """One dense input: the column through its steps, in float64, then float32 (as the
    sources compute it)."""
    steps = d["steps"]
    if column is None:  # a constant input
        return np.full(n, steps[0]["value"], np.float32)
    name = f"column {d['column']!r} (a dense feature)"
    if _kind(column.type) not in ("int", "float", "bool", "decimal"):
        raise _refuse(f"{name} is {column.type}: give numbers")
    fill = next((s["value"] for s in steps if s["op"] == "fill_null"), None)
    if column.null_count:
        if fill is None:
            raise _refuse(f"{name} is null in row {_first(column.is_null())}: training refused such rows; give a value")
        column = pc.fill_null(column, fill)
    x = np.asarray(pc.cast(column, pa.float64()), np.float64)
    if not np.isfinite(x).all():
        i = int(np.argmax(~np.isfinite(x)))
        raise _refuse(f"{name} is {x[i]} in row {i}: training refused rows whose value is not finite")
    with np.errstate(all="ignore"):
        for s in steps:
            if s["op"] == "clamp":
                x = np.maximum(x, s["min"])
            elif s["op"] == "log1p":
                x = portable.log1p(x)  # what training's readers compute
            elif s["op"] == "standardize":
                x = (x - s["mean"]) / s["std"]
            elif s["op"] != "fill_null":
                raise _refuse(f"{name}: step {s['op']!r} is not one this hybridrec has")
    y = x.astype(np.float32)
    if not np.isfinite(y).all():
        i = int(np.argmax(~np.isfinite(y)))
        raise _refuse(f"{name}: row {i}'s value is out of float32's range after its steps: training refused it")
    return y


def _numeric(f: dict[str, Any], column: pa.Array, name: str) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
    """An encoded number per row as its table rows, ids per row and id weights, as
    training's reader encodes it (``hybridrec.data.numeric``)."""
    if _kind(column.type) not in ("int", "float", "bool", "decimal"):
        raise _refuse(f"{name} is {column.type}: give one number per row")
    if column.null_count:
        raise _refuse(f"{name} is null in row {_first(column.is_null())}: training refused such rows; give a value")
    x = np.asarray(pc.cast(column, pa.float64()), np.float64)
    if not np.isfinite(x).all():
        i = int(np.argmax(~np.isfinite(x)))
        raise _refuse(f"{name} is {x[i]} in row {i}: training refused rows whose value is not finite")
    return numeric.encode(x, f["ids"]["encoding"], f["ids"]["knots"])


def _keys(flat: pa.Array, kind: str, seed: int) -> np.ndarray:
    """The ids' 64-bit keys: the hashes training maps ids with (``_Columns._keys``)."""
    if kind == "int":
        return hash_ints(np.asarray(pc.cast(flat, pa.int64(), safe=False), np.int64), seed)
    if not len(flat):
        return np.zeros(0, np.uint64)
    encoded = pc.dictionary_encode(flat)
    return hash_strings(encoded.dictionary, seed)[np.asarray(encoded.indices, np.int64)]


def _hex(flat: pa.Array, name: str, lengths: np.ndarray) -> np.ndarray:
    """Hex ids of at most 8 digits (empty: 0) as integers, as the Criteo reader parses them."""
    if not len(flat):
        return np.zeros(0, np.uint64)
    ok = np.asarray(pc.match_substring_regex(flat, r"^[0-9a-fA-F]{0,8}$"))
    if not ok.all():
        i = int(np.argmax(~ok))
        raise _refuse(
            f"{name}: {flat[i].as_py()!r} in row {_row_of(lengths, i)} is not a hex id of at most 8 "
            f"digits: training refused such rows"
        )
    encoded = pc.dictionary_encode(flat)
    distinct = np.array([int(v or "0", 16) for v in encoded.dictionary.to_pylist()], np.uint64)
    return distinct[np.asarray(encoded.indices, np.int64)]


def _managed_rows(managed: pa.Table, table: str, keys: np.ndarray) -> np.ndarray:
    """The rows ``keys`` hold in ``table`` of the managed ids' file; 0 for a key without one."""
    mine = managed.filter(pc.equal(managed.column("table"), table))
    known = np.asarray(mine.column("key"), np.uint64)
    rows = np.asarray(mine.column("row"), np.int64)
    if not len(known):
        return np.zeros(len(keys), np.int64)
    order = np.argsort(known)
    known, rows = known[order], rows[order]
    at = np.minimum(np.searchsorted(known, keys), len(known) - 1)
    return np.where(known[at] == keys, rows[at], 0)


def _id_weights(f: dict[str, Any], column: pa.Array, listed: bool, lengths: np.ndarray) -> np.ndarray:
    """The weight of each id of feature ``f``, from its weights column (the ids' layout)."""
    name = f"column {f['weights_column']!r} (the weights of feature {f['name']})"
    if _is_list(column.type) != listed:
        raise _refuse(
            f"{name} is {column.type} but the ids are {'lists' if listed else 'one per row'}: give one "
            f"weight per id, in the ids' layout"
        )
    if listed:
        if f["truncate"]:
            column = pc.list_slice(column, 0, f["max_length"])
        counts = np.asarray(pc.fill_null(pc.list_value_length(column), 0), np.int64)
        if (counts != lengths).any():
            i = int(np.argmax(counts != lengths))
            raise _refuse(f"{name} has {counts[i]} weights for {lengths[i]} ids in row {i}: give one per id")
        column = _plain_array(pc.list_flatten(column))
        if column.null_count:
            raise _refuse(f"{name} has a null weight: training refused such rows; give one number per id")
    elif column.null_count and (np.asarray(column.is_null()) & (lengths == 1)).any():
        raise _refuse(
            f"{name} is null in row {_first(np.asarray(column.is_null()) & (lengths == 1))} where the "
            f"feature has an id: give its weight"
        )
    if _kind(column.type) not in ("int", "float", "decimal"):
        raise _refuse(f"{name} is {column.type}: give numbers")
    w = np.asarray(pc.cast(pc.fill_null(column, 0) if column.null_count else column, pa.float64()), np.float64)
    w = w if listed else w[lengths == 1]
    if not np.isfinite(w).all():
        raise _refuse(f"{name} has a non-finite weight: training refused such rows")
    return w.astype(np.float32)
