"""How a source turns its raw rows into model inputs, written as data: what a source declares
(``Source.raw_inputs``) and ``hybridrec.export`` writes into ``preprocessing.json``, so that
``hybridrec.serving`` can rebuild the program's inputs from raw rows with the export
directory alone.

A raw row is a row as the training data holds it (a feature log's columns, a rating's user
and item, a synthetic row's generated values). Each dense feature is a column (or a
constant) and a list of steps; each sparse feature is a column of one id or a list of ids
per row and a mapping of ids to table rows. The steps and mappings are a closed vocabulary
(``DENSE_OPS``, ``ID_MAPPINGS``), each with its parameters, never code: the export is read
without running anything from it.

Dense steps, applied in order on float64 values (the result is cast to float32, as every
source casts its dense array):

- ``{"op": "fill_null", "value": v}``: a missing value becomes ``v`` (without it, a missing
  value is refused);
- ``{"op": "clamp", "min": m}``: ``max(x, m)``;
- ``{"op": "log1p"}``: ``log(1 + x)``;
- ``{"op": "standardize", "mean": m, "std": s}``: ``(x - m) / s``, the fitted values;
- ``{"op": "constant", "value": v}``: every row ``v``, no column read (a bias input).

Id mappings (``ids``), from a raw id to a table row:

- ``{"kind": "row", "outside": "error" | "row_0"}``: the id is the row; an id outside the
  table is refused, or reads row 0 (the source's row for ids it has never seen);
- ``{"kind": "hash", "function": "splitmix64", "seed": s, "modulo": n}``: the id's 64-bit
  key (``hybridrec.data.parquet.hash_ints`` for integers, ``hash_strings`` for strings,
  under seed ``s``) modulo the table's rows;
- ``{"kind": "hex", "function": "splitmix64" | "none", "modulo": n}``: a hex string of at
  most 8 digits (null or empty: 0) read as an integer, mixed by splitmix64's finalizer or
  not, modulo the table's rows (Criteo's ``data.id_mapping``: ``hybridrec.data.criteo.map_ids``);
- ``{"kind": "vocabulary", "file": f}``: the id's position in the vocabulary file ``f``
  (column ``id``) plus 1; row 0 for an id not in it;
- ``{"kind": "managed", "file": "managed_ids.parquet", "table": t, "function": "splitmix64",
  "seed": s}``: the row the id's 64-bit key holds in table ``t`` of the managed ids' file;
  row 0 for a key without one;
- ``{"kind": "numeric", "encoding": "bucketized" | "piecewise_linear", "knots": [k0, ...]}``:
  the column holds one number per row, which ``hybridrec.data.numeric.encode`` turns into
  the id of its bucket, or two ids weighted by its place between two knots (no weights
  column: the weights come from the number).

A feature or dense column may be read from a join instead of the raw row (``"join": name``):
the join's file holds one row per key (its ``on`` column, which the raw rows carry too);
a key that is not in it takes the join's ``missing`` values (a list column: no ids).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import pyarrow as pa

from hybridrec.data.numeric import check_knots, rows_of

FORMAT = 1
"""preprocessing.json's format version: a reader refuses another one."""
DENSE_OPS = ("fill_null", "clamp", "log1p", "standardize", "constant")
ID_MAPPINGS = ("row", "hash", "hex", "vocabulary", "managed", "numeric")
LAYOUTS = ("one id", "list", "one id or list")
MANAGED_FILE = "managed_ids.parquet"
"""The managed ids' file of an export (``hybridrec.serving.exported.write_managed_ids`` writes it)."""


@dataclass(frozen=True)
class RawInputs:
    """What ``Source.raw_inputs`` returns: the raw rows' description and the files it names."""

    doc: str
    """What a raw row of this source is, in a sentence."""
    dense: list[dict[str, Any]]
    """One entry per dense feature, in the model's order (``dense_input``)."""
    sparse: list[dict[str, Any]]
    """One entry per sparse feature, in the model's order (``sparse_input``)."""
    joins: list[dict[str, Any]] = field(default_factory=list)
    """Tables the rows are joined with (``join``)."""
    copies: dict[str, str] = field(default_factory=dict)
    """File name in the export -> the file copied there (a vocabulary)."""
    tables: dict[str, pa.Table] = field(default_factory=dict)
    """File name in the export -> a table written there as Parquet (a join's)."""


def dense_input(column: Optional[str], steps: list[dict[str, Any]], join: Optional[str] = None) -> dict[str, Any]:
    """A dense feature: ``column`` of the raw row (or of ``join``'s file) through ``steps``."""
    for step in steps:
        if step["op"] not in DENSE_OPS:
            raise ValueError(f"dense step {step}: the op is one of {DENSE_OPS}")
    return {"column": column, "join": join, "steps": steps}


def sparse_input(
    name: str,
    column: str,
    table: str,
    num_embeddings: int,
    pooling: str,
    ids: dict[str, Any],
    layout: str,
    *,
    weights_column: Optional[str] = None,
    max_length: Optional[int] = None,
    truncate: bool = False,
    null_rows: str = "empty",
    join: Optional[str] = None,
) -> dict[str, Any]:
    """A sparse feature: the ids of ``column`` (``layout``: "one id" per row, a "list" per
    row, or "one id or list" as the training files had it: the reader takes either, both
    read the same; ``null_rows``: a null is a row without ids, "empty", or refused, "error"), cut to ``max_length`` when
    ``truncate`` (refused when longer otherwise), mapped by ``ids``; ``weights_column``: one
    weight per id, in the same layout."""
    if ids["kind"] not in ID_MAPPINGS:
        raise ValueError(f"sparse feature {name}: ids {ids}: the kind is one of {ID_MAPPINGS}")
    if layout not in LAYOUTS:
        raise ValueError(f"sparse feature {name}: layout={layout!r}, expected one of {LAYOUTS}")
    if null_rows not in ("empty", "error"):
        raise ValueError(f"sparse feature {name}: null_rows={null_rows!r}, expected empty or error")
    return {
        "name": name,
        "column": column,
        "join": join,
        "table": table,
        "num_embeddings": int(num_embeddings),
        "pooling": pooling,
        "layout": layout,
        "weights_column": weights_column,
        "max_length": max_length,
        "truncate": truncate,
        "null_rows": null_rows,
        "ids": ids,
    }


def join(name: str, file: str, on: str, missing: dict[str, Any]) -> dict[str, Any]:
    """A join: ``file`` (in the export) holds one row per value of its column ``on``;
    ``missing``: the values of its other columns for a key it does not hold (None: no ids)."""
    return {"name": name, "file": file, "on": on, "missing": missing}


# ------------------------------------------------------------- reading a written description
_NUMBER = (int, float)
_STEP_FIELDS = {
    "fill_null": {"value": _NUMBER},
    "clamp": {"min": _NUMBER},
    "log1p": {},
    "standardize": {"mean": _NUMBER, "std": _NUMBER},
    "constant": {"value": _NUMBER},
}
_ID_FIELDS: dict[str, dict[str, Union[tuple[str, ...], type]]] = {
    "row": {"outside": ("error", "row_0")},
    "hash": {"function": ("splitmix64",), "seed": int, "modulo": int},
    "hex": {"function": ("splitmix64", "none"), "modulo": int},
    "vocabulary": {"file": str},
    "managed": {"file": str, "table": str, "function": ("splitmix64",), "seed": int},
    "numeric": {"encoding": ("bucketized", "piecewise_linear"), "knots": list},
}


class Malformed(ValueError):
    """A field of a written description that is not what ``hybridrec.export`` writes."""


def check_description(spec: Any) -> list[str]:
    """That ``spec`` (preprocessing.json's content) has every field ``hybridrec.export`` writes,
    of its type and in its range, before anything is computed from it: an edited or damaged
    file is a ``Malformed`` error naming the field, not a NumPy error far from it. Returns the
    files the description reads (vocabularies, joins, the managed ids), each of which its
    ``files`` must list with a sha256."""

    def need(ok: bool, key: str, value: Any, expected: str) -> None:
        if not ok:
            raise Malformed(f"field {key} is {str(value)[:80]!r} (a {type(value).__name__}), expected {expected}")

    def number(value: Any) -> bool:
        return (
            isinstance(value, _NUMBER) and not isinstance(value, bool) and value == value and abs(value) != float("inf")
        )

    need(isinstance(spec, dict), "(the file)", spec, "an object of fields")
    for key in ("dense", "sparse", "joins"):
        need(
            isinstance(spec.get(key), list) and all(isinstance(e, dict) for e in spec[key]),
            key,
            spec.get(key),
            "a list of objects",
        )
    files = spec.get("files")
    need(
        isinstance(files, dict)
        and all(isinstance(k, str) and isinstance(v, str) and len(v) == 64 for k, v in files.items()),
        "files",
        files,
        "file names and sha256 digests",
    )
    need(isinstance(spec.get("program_inputs"), list), "program_inputs", spec.get("program_inputs"), "a list")
    need(isinstance(spec.get("rows"), str), "rows", spec.get("rows"), "a description of the rows")
    for key, entries in (("dense", spec["dense"]), ("sparse", spec["sparse"])):
        for i, e in enumerate(entries):  # a key left out is as malformed as a wrong value (serving reads each)
            for needed in ("column", "join") + (("weights_column",) if key == "sparse" else ()):
                need(needed in e, f"{key}[{i}].{needed}", "(missing)", "present (null where it does not apply)")
    named = []
    for i, d in enumerate(spec["dense"]):
        at = f"dense[{i}]"
        need(d.get("column") is None or isinstance(d["column"], str), f"{at}.column", d.get("column"), "a column name")
        need(
            isinstance(d.get("steps"), list) and all(isinstance(s, dict) for s in d["steps"]),
            f"{at}.steps",
            d.get("steps"),
            "a list of steps",
        )
        for k, s in enumerate(d["steps"]):
            need(
                isinstance(s.get("op"), str) and s["op"] in _STEP_FIELDS,
                f"{at}.steps[{k}].op",
                s.get("op"),
                f"one of {', '.join(DENSE_OPS)}",
            )
            for field_ in _STEP_FIELDS[s["op"]]:
                need(number(s.get(field_)), f"{at}.steps[{k}].{field_}", s.get(field_), "a finite number")
            if s["op"] == "standardize":
                need(s["std"] > 0, f"{at}.steps[{k}].std", s["std"], "a number > 0")
        need(
            d["column"] is not None or (d["steps"] and d["steps"][0]["op"] == "constant"),
            f"{at}.column",
            None,
            "a column name (only a constant reads none)",
        )
    for i, f in enumerate(spec["sparse"]):
        at = f"sparse[{i}]"
        for key, kind in (("name", str), ("column", str), ("table", str)):
            need(isinstance(f.get(key), kind), f"{at}.{key}", f.get(key), "a name")
        n = f.get("num_embeddings")
        need(isinstance(n, int) and not isinstance(n, bool) and n >= 1, f"{at}.num_embeddings", n, "an integer >= 1")
        m = f.get("max_length")
        need(
            m is None or isinstance(m, int) and not isinstance(m, bool) and m >= 1,
            f"{at}.max_length",
            m,
            "an integer >= 1 or null",
        )
        need(isinstance(f.get("truncate"), bool), f"{at}.truncate", f.get("truncate"), "true or false")
        need(f.get("null_rows") in ("empty", "error"), f"{at}.null_rows", f.get("null_rows"), "empty or error")
        need(
            f.get("weights_column") is None or isinstance(f["weights_column"], str),
            f"{at}.weights_column",
            f.get("weights_column"),
            "a column name or null",
        )
        ids = f.get("ids")
        need(
            isinstance(ids, dict) and isinstance(ids.get("kind"), str) and ids["kind"] in _ID_FIELDS,
            f"{at}.ids.kind",
            ids.get("kind") if isinstance(ids, dict) else ids,
            f"one of {', '.join(ID_MAPPINGS)}",
        )
        for key, rule in _ID_FIELDS[ids["kind"]].items():
            value = ids.get(key)
            if isinstance(rule, tuple):
                need(value in rule, f"{at}.ids.{key}", value, f"one of {', '.join(rule)}")
            elif rule is list:  # a numeric column's knots, which size its table
                why = check_knots(value)
                need(why is None, f"{at}.ids.{key}", value, str(why))
                rows = rows_of(ids["encoding"], value)
                need(n == rows, f"{at}.num_embeddings", n, f"{rows}, the rows its {len(value)} knots make")
            elif rule is int:  # a modulo is the table's rows; a seed a 64-bit key
                low, high = (1, n) if key == "modulo" else (0, (1 << 64) - 1)
                need(
                    isinstance(value, int) and not isinstance(value, bool) and low <= value <= high,
                    f"{at}.ids.{key}",
                    value,
                    f"an integer in [{low}, {high}]",
                )
            else:
                need(
                    isinstance(value, str) and bool(value),
                    f"{at}.ids.{key}",
                    value,
                    "a file name" if key == "file" else "a name",
                )
        if "file" in ids:
            named.append(ids["file"])
    for i, j in enumerate(spec["joins"]):
        for key in ("name", "file", "on"):
            need(isinstance(j.get(key), str) and j[key], f"joins[{i}].{key}", j.get(key), "a name")
        need(isinstance(j.get("missing"), dict), f"joins[{i}].missing", j.get("missing"), "an object of values")
        named.append(j["file"])
    names = {j["name"] for j in spec["joins"]}
    for key, entries in (("dense", spec["dense"]), ("sparse", spec["sparse"])):
        for i, e in enumerate(entries):
            need(
                e["join"] is None or isinstance(e["join"], str) and e["join"] in names,
                f"{key}[{i}].join",
                e["join"],
                "null or the name of one of its joins",
            )
    return list(dict.fromkeys(named))


def sha256(path: str) -> str:
    """The sha256 of a file an export brings (``files`` of preprocessing.json, a delta's
    managed ids): the digest a serving fleet's own tools can check too."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
