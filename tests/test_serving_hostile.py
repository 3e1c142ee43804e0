"""Serving under attack: every column of every kind of export fed what a careless client or an
attacker sends (nulls, NaN, infinities, strings for numbers, ids beyond 64 bits, nested
lists), and export directories whose preprocessing.json was edited (fields of the wrong type,
paths out of the export, a file it reads but does not list, a delta's managed ids changed).
Each is refused in one ``hybridrec: ...`` ValueError naming the column, or the file and the
field; no other exception escapes. The descriptions are written as ``hybridrec.export``
writes them, from the sources themselves: no model is trained here."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from batch_sources import _movielens, _parquet, _synthetic, _tsv
from hybridrec.data.raw_inputs import MANAGED_FILE, RawInputs
from hybridrec.serving.export import PREPROCESSING, write_preprocessing
from hybridrec.serving.preprocess import Preprocessor, sha256

pytestmark = pytest.mark.unit


class _Described:
    """A source's description with one feature's ids managed (what a continuous export's is)."""

    def __init__(self, source, managed_feature: int) -> None:
        self.source, self.managed_feature = source, managed_feature

    def raw_inputs(self) -> RawInputs:
        raw = self.source.raw_inputs()
        f = raw.sparse[self.managed_feature]
        f["ids"] = {"kind": "managed", "file": MANAGED_FILE, "table": f["table"], "function": "splitmix64", "seed": 0}
        return raw


def _managed_ids(out: str) -> None:
    pq.write_table(
        pa.table(
            {"table": ["t_item", "t_item"], "key": pa.array([1, 2], pa.uint64()), "row": pa.array([1, 2], pa.int64())}
        ),
        os.path.join(out, MANAGED_FILE),
    )


KINDS = ["synthetic", "feature log", "feature log, managed ids", "movielens", "criteo tsv"]


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """kind -> (export directory with its preprocessing.json, one valid raw row as {column: [value]})."""
    out = {}
    for kind in KINDS:
        d = str(tmp_path_factory.mktemp(kind.replace(" ", "_").replace(",", "")))
        data = os.path.join(d, "data")
        os.makedirs(data)
        if kind == "synthetic":
            source, weighted = _synthetic(data, multi_hot_sizes=[1, 3, 2, 4]), False
        elif kind.startswith("feature log"):
            source, weighted = _parquet(data), True
        elif kind == "movielens":
            source, weighted = _movielens(data), False
        else:
            source, weighted = _tsv(data), False
        export = os.path.join(d, "export")
        os.makedirs(export)
        described = source
        if kind.endswith("managed ids"):
            _managed_ids(export)
            described = _Described(
                source, next(i for i, f in enumerate(source.raw_inputs().sparse) if f["name"] == "item")
            )
        write_preprocessing(described, weighted, export)
        out[kind] = (export, _valid_row(kind, source))
    return out


def _valid_row(kind: str, source) -> dict:
    if kind == "synthetic":
        row = {f"dense_{j}": [0.5] for j in range(source.num_dense_features)}
        row |= {f.name: [[1] * int(f.pooling_factor)] if f.pooling_factor > 1 else [1] for f in source.features}
        return row
    if kind.startswith("feature log"):
        return {"x": [1.0], "price": [2.0], "item": [3], "user": ["u1"], "tags": [[1, 2]], "tag_w": [[0.5, 1.5]]}
    if kind == "movielens":
        return {"user_id": [1], "item_id": [2]}
    row = {f"int_{j}": [1] for j in range(13)}
    return row | {f"cat_{j}": ["0000000a"] for j in range(26)}


# What a client may send in place of a column's value.
HOSTILE = {
    "null": None,
    "nan": float("nan"),
    "inf": float("inf"),
    "text": "x",
    "beyond 64 bits": 10**20,
    "negative": -1,
    "a bool": True,
    "nested list": [[1, 2]],
    "null in a list": [1, None],
    "empty list": [],
    "a dict": {"a": 1},
}


@pytest.mark.parametrize("kind", KINDS)
def test_every_column_of_every_export_refuses_hostile_values_by_name(exports, kind):
    export, row = exports[kind]
    prep = Preprocessor.load(export)
    valid = prep(row)  # the valid row maps
    assert all(isinstance(t, torch.Tensor) for t in valid)
    tried = 0
    for column in prep.columns:
        for what, value in HOSTILE.items():
            rows = {**row, column: [value]}
            try:
                prep(rows)  # accepted: a value training would accept too (a null id: a row without ids)
            except ValueError as e:
                message = str(e)
                assert message.startswith("hybridrec: ") and "\n" not in message, (column, what, message)
                assert repr(column) in message or column in message, (column, what, message)
            tried += 1
    assert tried == len(prep.columns) * len(HOSTILE)


def _edit(export: str, change) -> str:
    """preprocessing.json of ``export`` after ``change(spec)``, as an attacker who knows the
    format writes it (the files' sha256 recomputed where a file changed)."""
    path = os.path.join(export, PREPROCESSING)
    spec = json.load(open(path))
    change(spec)
    with open(path, "w") as f:
        json.dump(spec, f)
    return path


def _first(spec, kind):
    return next(f for f in spec["sparse"] if f["ids"]["kind"] == kind)


# (kind of export, what is changed, the edit, the message's fragment)
EDITS = [
    (
        "feature log",
        "a string std",
        lambda s: s["dense"][1].__setitem__("steps", [{"op": "standardize", "mean": 0, "std": "1"}]),
        "field dense[1].steps[0].std is '1' (a str), expected a finite number",
    ),
    (
        "feature log",
        "a std of 0",
        lambda s: s["dense"][1].__setitem__("steps", [{"op": "standardize", "mean": 0, "std": 0}]),
        "field dense[1].steps[0].std is '0' (a int), expected a number > 0",
    ),
    (
        "feature log",
        "an op of its own",
        lambda s: s["dense"][0]["steps"].append({"op": "eval"}),
        "field dense[0].steps[2].op is 'eval'",
    ),
    (
        "feature log",
        "a negative modulo",
        lambda s: _first(s, "hash")["ids"].__setitem__("modulo", -5),
        "ids.modulo is '-5' (a int), expected an integer in [1, ",
    ),
    (
        "feature log",
        "a modulo beyond the table",
        lambda s: _first(s, "hash")["ids"].__setitem__("modulo", 2**70),
        "ids.modulo is '1180591620717411303424' (a int), expected an integer in [1, ",
    ),
    (
        "feature log",
        "a seed beyond 64 bits",
        lambda s: _first(s, "hash")["ids"].__setitem__("seed", 2**70),
        "ids.seed is '1180591620717411303424' (a int), expected an integer in [0, 18446744073709551615]",
    ),
    (
        "feature log",
        "a dense column left out",
        lambda s: s["dense"][0].pop("column"),
        "field dense[0].column is '(missing)' (a str), expected present",
    ),
    (
        "feature log",
        "a weights column left out",
        lambda s: s["sparse"][0].pop("weights_column"),
        "field sparse[0].weights_column is '(missing)'",
    ),
    (
        "feature log",
        "an op that is a list",
        lambda s: s["dense"][0]["steps"].append({"op": ["x"]}),
        "field dense[0].steps[2].op is \"['x']\"",
    ),
    (
        "feature log",
        "an id kind that is a list",
        lambda s: _first(s, "hash")["ids"].__setitem__("kind", ["row"]),
        "ids.kind is \"['row']\"",
    ),
    (
        "movielens",
        "a join that is a list",
        lambda s: s["dense"][0].__setitem__("join", ["x"]),
        "field dense[0].join is \"['x']\"",
    ),
    (
        "movielens",
        "a join's missing values of other columns",
        lambda s: s["joins"][0].__setitem__("missing", {"x": 1}),
        "has 'missing' values for ['x'], and its file's columns are",
    ),
    ("feature log", "no rows description", lambda s: s.pop("rows"), "field rows is 'None'"),
    ("feature log", "no sparse list", lambda s: s.__setitem__("sparse", "all"), "field sparse is 'all'"),
    (
        "feature log",
        "an unknown id kind",
        lambda s: _first(s, "hash")["ids"].__setitem__("kind", "python"),
        "ids.kind is 'python'",
    ),
    (
        "feature log",
        "a table size of text",
        lambda s: s["sparse"][0].__setitem__("num_embeddings", "13"),
        "field sparse[0].num_embeddings is '13' (a str), expected an integer >= 1",
    ),
    (
        "movielens",
        "a join of no name",
        lambda s: s["dense"][0].__setitem__("join", "nobody"),
        "field dense[0].join is 'nobody'",
    ),
    (
        "feature log, managed ids",
        "the managed ids unlisted",
        lambda s: s["files"].pop(MANAGED_FILE),
        f"it reads {MANAGED_FILE} but its 'files' records no sha256 for it",
    ),
]


@pytest.mark.parametrize("kind, what, change, fragment", EDITS, ids=[e[1] for e in EDITS])
def test_an_edited_description_is_refused_naming_the_file_and_field(exports, tmp_path, kind, what, change, fragment):
    import shutil

    export = shutil.copytree(exports[kind][0], tmp_path / "export")
    path = _edit(str(export), change)
    with pytest.raises(ValueError) as e:
        Preprocessor.load(str(export))
    message = str(e.value)
    assert message.startswith(f"hybridrec: {path} is damaged or was edited: ") and fragment in message, message
    assert "\n" not in message


def test_files_outside_the_export_are_never_read(exports, tmp_path):
    """A join's path edited to climb out (``../``), an absolute one, and a file of the export
    that is a link to one outside: each refused, even with its sha256 recorded."""
    import shutil

    export = shutil.copytree(exports["movielens"][0], tmp_path / "export")
    name = json.load(open(export / PREPROCESSING))["joins"][0]["file"]
    outside = tmp_path / "other.parquet"
    shutil.copyfile(export / name, outside)
    for planted in ("../other.parquet", str(outside)):

        def point(spec, planted=planted):
            spec["files"][planted] = sha256(str(outside))
            spec["joins"][0]["file"] = planted

        copy = shutil.copytree(export, tmp_path / f"copy{len(planted)}")
        path = _edit(str(copy), point)
        with pytest.raises(ValueError) as e:
            Preprocessor.load(str(copy))
        assert str(e.value) == (
            f"hybridrec: {path} is damaged or was edited: it names {planted!r}, which is not a file "
            f"of the export {copy}; export the checkpoint again"
        )
    os.remove(export / name)
    os.symlink(outside, export / name)  # the file's name is the export's, its bytes another's
    with pytest.raises(ValueError, match="which is not a file of the export"):
        Preprocessor.load(str(export))


def test_a_deltas_managed_ids_are_verified_against_the_delta(exports, tmp_path):
    import shutil

    export = shutil.copytree(exports["feature log, managed ids"][0], tmp_path / "export")
    deltas = export / "deltas"
    deltas.mkdir()
    ids = deltas / "managed_ids_00001.parquet"
    shutil.copyfile(export / MANAGED_FILE, ids)
    torch.save({"format": 1, "managed_ids_sha256": sha256(str(ids))}, deltas / "delta_00001.pt")
    assert Preprocessor.load(str(export), managed_ids=str(ids))._managed.num_rows == 2
    table = pq.read_table(ids)
    pq.write_table(table.set_column(2, "row", pa.array([7, 7], pa.int64())), ids)  # ids moved to other rows
    with pytest.raises(
        ValueError,
        match=r"managed_ids_00001.parquet is damaged or was edited \(its sha256 is not "
        r"the one .*delta_00001.pt records\)",
    ):
        Preprocessor.load(str(export), managed_ids=str(ids))
    with pytest.raises(ValueError, match="give one of .*deltas's managed_ids_NNNNN.parquet"):
        Preprocessor.load(str(export), managed_ids=str(export / MANAGED_FILE))
    torch.save({"format": 1}, deltas / "delta_00001.pt")  # a delta that records no sha256
    with pytest.raises(ValueError, match="records no sha256 of managed_ids_00001.parquet"):
        Preprocessor.load(str(export), managed_ids=str(ids))


def test_the_export_lists_every_file_its_description_reads(exports):
    for kind, (export, _) in exports.items():
        spec = json.load(open(os.path.join(export, PREPROCESSING)))
        read = {f["ids"]["file"] for f in spec["sparse"] if "file" in f["ids"]} | {j["file"] for j in spec["joins"]}
        assert read <= set(spec["files"]), kind
        assert all(sha256(os.path.join(export, n)) == d for n, d in spec["files"].items()), kind
    assert MANAGED_FILE in json.load(open(os.path.join(exports["feature log, managed ids"][0], PREPROCESSING)))["files"]
    np.testing.assert_equal(len(exports), len(KINDS))
