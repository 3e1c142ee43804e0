"""Parquet feature logs converted on the device (``data.device_input``), run on the CPU: the
training rows of ``read``, byte for byte, for every column type the reader takes (labels of
integers, booleans, floats with a threshold; dense integers, floats, decimals, booleans under
each transform; ids of every mapping, one-hot and lists, truncated, weighted, integers of every
width and strings), across row groups, files of different schemas and shards, 1 and 2 ranks;
bad rows padded and counted as ``read`` counts them, named with bad_rows=fail; the
configurations read on the CPU refused by name."""

import decimal
import os
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from conftest import compose_cfg
from hybridrec.data import DataError, loader
from hybridrec.data.parquet import ParquetSource
from hybridrec.data.vocab import main as vocab_main
from hybridrec.run.validation import validate
from shared import no_host_reads, same_rows

pytestmark = pytest.mark.unit
CPU = torch.device("cpu")


def _table(first: int, n: int, item_type: pa.DataType | None = None) -> pa.Table:
    """Rows first .. first + n - 1, every value a function of the row number (items int64
    unless ``item_type``)."""
    r = np.arange(first, first + n)
    tags = [[int((i * 5 + j) % 23) for j in range(i % 5)] for i in r]  # 0 to 4 ids
    words = [[f"w{(i + j) % 9}" for j in range(i % 3)] for i in r]
    return pa.table(
        {
            "click": pa.array((r % 3 == 0).astype(np.int8)),
            "liked": pa.array(r % 4 == 1),
            "rating": pa.array((r % 50) / 10, pa.float32()),
            "w": pa.array(((1 + r % 5) / 5).astype(np.float32)),
            "count": pa.array(r * 37 % 1001, pa.uint32()),
            "x": pa.array(np.where(r % 7 == 0, 0.0, np.exp((r % 40) - 20.0))),
            "price": pa.array([decimal.Decimal(int(i % 997)) / 100 for i in r], pa.decimal128(9, 2)),
            "flag": pa.array(r % 2 == 0),
            "item": pa.array(r % 13, item_type or pa.int64()),
            "big": pa.array([int(i) * 0x9E3779B97F4A7C15 % 2**64 for i in r], pa.uint64()),
            "user": pa.array([f"u{i % 11}" * (1 + i % 3) for i in r]),
            "code": pa.array(r % 17, pa.int32()),
            "city": pa.array([f"c{i % 6}" for i in r]),
            "tags": pa.array(tags, pa.list_(pa.int64())),
            "tag_w": pa.array([[0.5 + j for j in range(len(t))] for t in tags], pa.list_(pa.float32())),
            "words": pa.array(words, pa.list_(pa.string())),
        }
    )


def _write(path, table, row_group_size=None) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(table, path, row_group_size=row_group_size)
    return str(path)


@pytest.fixture
def log(tmp_path):
    """Training: 59 rows in two files (row groups of 5 and 7 rows; the second file's items
    int32, the first's int64), eval: 9 rows; vocabularies of ``code`` and ``city``."""
    _write(tmp_path / "train/a.parquet", _table(0, 31), 5)
    _write(tmp_path / "train/b.parquet", _table(31, 28, pa.int32()), 7)
    _write(tmp_path / "eval/a.parquet", _table(100, 9))
    vocab_main([str(tmp_path / "train"), "--column", "code", "--column", "city", "--out", str(tmp_path / "vocab")])
    return tmp_path


ONE_HOT = [
    {"name": "item", "column": "item", "num_embeddings": 13},
    {"name": "big", "column": "big", "num_embeddings": 1000, "id_mapping": "hash"},
    {"name": "user", "column": "user", "num_embeddings": 50, "id_mapping": "hash"},
]
DENSE = [
    {"column": "count"},
    {"column": "x", "transform": "log1p"},
    {"column": "price", "transform": "standardize"},
    {"column": "flag"},
]


def _source(log, sparse=ONE_HOT, **kw) -> ParquetSource:
    args = dict(
        batch_size=8,
        train_path=str(log / "train"),
        eval_path=str(log / "eval"),
        label={"column": "click"},
        weight="w",
        dense=DENSE,
        sparse=sparse,
        seed=0,
        hash_seed=3,
    )
    return ParquetSource(**(args | kw))


def _vocab(log, column, n=40, **kw):
    return {"name": column, "column": column, "num_embeddings": n, "id_mapping": "vocabulary"} | {
        "vocabulary": str(log / "vocab" / f"{column}.parquet"),
        **kw,
    }


def _same_training_rows(source, epochs=(0, 1)) -> None:
    reader = source.device_rows(CPU)
    for epoch in epochs:
        for index in range(source.num_batches("train")):
            for world in (1, 2):
                for rank in range(world):
                    (lo, hi), *_ = loader.plan_pieces(source, world, rank)
                    same_rows(source.read("train", epoch, index, lo, hi), reader("train", index, lo, hi, epoch=epoch))
    reader.check()  # nothing was flagged


def test_one_hot_rows_every_mapping_and_column_type(log):
    _same_training_rows(_source(log, ONE_HOT + [_vocab(log, "code"), _vocab(log, "city")]))


@pytest.mark.parametrize("label", [{"column": "liked"}, {"column": "rating", "threshold": 2.5}])
def test_labels_of_booleans_and_thresholds(log, label):
    _same_training_rows(_source(log, ONE_HOT[:1], label=label, weight=None), epochs=(0,))


def test_lists_weighted_truncated_and_strings(log):
    sparse = ONE_HOT + [
        {"name": "tags", "column": "tags", "num_embeddings": 23, "weights_column": "tag_w", "pooling": "mean"},
        {"name": "short", "column": "tags", "table": "t_tags", "num_embeddings": 23, "max_length": 2, "truncate": True},
        {
            "name": "words",
            "column": "words",
            "num_embeddings": 40,
            "id_mapping": "hash",
            "max_length": 1,
            "truncate": True,
        },
        _vocab(log, "city"),
    ]
    _same_training_rows(_source(log, sparse))


def test_shards_and_held_out_runs(log):
    _same_training_rows(_source(log, shards=2, eval_batches=1), epochs=(0,))


def test_the_reader_reads_no_value_back(log, monkeypatch):
    """On a GPU each such read would make the host wait for the device: every size the reader
    and the batch's KJT need comes from the host's arrays."""
    sparse = ONE_HOT + [
        _vocab(log, "code"),
        _vocab(log, "city"),
        {
            "name": "tags",
            "column": "tags",
            "num_embeddings": 23,
            "weights_column": "tag_w",
            "max_length": 3,
            "truncate": True,
        },
        {"name": "words", "column": "words", "num_embeddings": 40, "id_mapping": "hash"},
    ]
    source = _source(log, sparse)
    reader = source.device_rows(CPU)

    with no_host_reads(monkeypatch):
        for index in range(3):
            reader("train", index, 0, 8).batch(source.keys)


def _bad_log(log, changes):
    """The training log with ``changes`` ({column: {row: value}}) made to file a's rows."""
    table = _table(0, 31)
    for column, rows in changes.items():
        values = table.column(column).to_pylist()
        for row, value in rows.items():
            values[row] = value
        table = table.set_column(
            table.schema.get_field_index(column), column, pa.array(values, table.schema.field(column).type)
        )
    _write(log / "train/a.parquet", table, 5)


# (column, row, value, what the CPU's reader says): found on the device from the values alone
ON_DEVICE = [
    ("click", 9, 2, "label click 2 is not 0 or 1"),
    ("w", 17, float("nan"), "sample weight w nan is not a finite number >= 0"),
    ("x", 3, float("inf"), "x inf is not finite"),
    ("item", 22, 13, "item: id 13 is outside the table's rows 0..12 (id_mapping=none)"),
]


@pytest.mark.parametrize("column,row,value,reason", ON_DEVICE)
def test_a_bad_value_found_on_the_device_is_padding_counted_by_the_cpu_reader(log, column, row, value, reason):
    _bad_log(log, {column: {row: value}})
    host, device = _source(log), _source(log)
    reader = device.device_rows(CPU)
    ours = list(loader.batches(host, "train", 0, 1, 7))
    theirs = list(loader.batches(device, "train", 0, 1, 7, device_rows=reader))
    b = theirs[row // 8]
    assert b.weights[row % 8] == 0 and b.labels[row % 8] == 0 and not b.dense_features[row % 8].any()
    for x, y in zip(ours, theirs, strict=True):  # one-hot: the same batches, padding too
        assert torch.equal(x.dense_features, y.dense_features) and torch.equal(x.labels, y.labels)
        assert torch.equal(x.weights, y.weights) and torch.equal(x.sparse_features.values(), y.sparse_features.values())
    assert device.report() != host.report()  # counted good until the flag is read
    reader.check()
    assert device.report() == host.report()
    assert f"a.parquet:{row}: {reason}" in str(host.report()["files"])


def test_a_bad_row_with_bad_rows_fail_stops_naming_its_file_and_row(log):
    _bad_log(log, {"item": {12: -1}})
    reader = _source(log, bad_rows="fail").device_rows(CPU)
    for index in range(3):
        reader("train", index, 0, 8)
    with pytest.raises(DataError, match=r"a\.parquet:12: item: id -1 is outside"):
        reader.check()


@pytest.mark.parametrize("column,value", [("x", None), ("tags", [1, None]), ("tag_w", [0.5])])
def test_a_bad_row_the_host_sees_is_read_on_the_cpu(log, column, value):
    """A null, a null id in a list, weights that do not match their ids: the batch is read's."""
    _bad_log(log, {column: {4: value}})
    sparse = ONE_HOT + [{"name": "tags", "column": "tags", "num_embeddings": 23, "weights_column": "tag_w"}]
    source = _source(log, sparse)
    rows = source.device_rows(CPU)("train", 0, 0, 8)
    assert rows.real is not None and not bool(rows.real[4]) and bool(rows.real[:4].all())
    same_rows(source.read("train", 0, 0, 0, 8), rows)


def test_strings_as_dictionaries_large_strings_binary_and_empty(log):
    """The same rows whatever string type the files store (a dictionary, large_string,
    binary), empty strings included."""
    table = _table(0, 31)
    users = ["" if i % 4 == 0 else v for i, v in enumerate(table.column("user").to_pylist())]
    table = table.set_column(table.schema.get_field_index("user"), "user", pa.array(users).dictionary_encode())
    table = table.set_column(table.schema.get_field_index("city"), "city", table.column("city").cast(pa.large_string()))
    words = table.column("words").cast(pa.list_(pa.binary()))
    table = table.set_column(table.schema.get_field_index("words"), "words", words)
    _write(log / "train/a.parquet", table, 5)
    sparse = ONE_HOT + [
        {"name": "city", "column": "city", "num_embeddings": 40, "id_mapping": "hash"},
        {"name": "words", "column": "words", "num_embeddings": 40, "id_mapping": "hash"},
    ]
    _same_training_rows(_source(log, sparse), epochs=(0,))


@pytest.mark.parametrize("truncate", [True, False])
def test_weights_longer_than_their_ids_fit_once_both_are_truncated(log, truncate):
    """Row 8 has 3 tags and 5 weights: with max_length=2 and truncate both keep 2 (a good row,
    converted on the device); without truncate the counts differ (a bad row, read's batch)."""
    _bad_log(log, {"tag_w": {8: [0.5, 1.5, 2.5, 3.5, 4.5]}})
    limit = {"max_length": 2, "truncate": True} if truncate else {}
    tags = {"name": "tags", "column": "tags", "num_embeddings": 23, "weights_column": "tag_w", **limit}
    source = _source(log, ONE_HOT + [tags])
    rows = source.device_rows(CPU)("train", 1, 0, 8)
    assert (rows.real is None) == truncate
    same_rows(source.read("train", 0, 1, 0, 8), rows)


@pytest.mark.parametrize(
    "experiment,refusal",
    [
        ("tabular", "data.dense[0].encoding=bucketized makes its ids"),
        ("continuous", "a partitioned log (data.partitions)"),
    ],
)
def test_what_is_read_on_the_cpu_is_refused_by_name(experiment, refusal):
    with pytest.raises(ValueError, match=r"^data\.device_input=true: " + re.escape(refusal)):
        validate(compose_cfg([f"+experiment={experiment}", "data.device_input=true"]), 1)


def test_criteo_tsv_is_refused_with_the_conversion_that_gives_a_device_path():
    with pytest.raises(ValueError, match=r"CriteoTSV reads its rows on the CPU .* python -m hybridrec\.data\.convert$"):
        validate(
            compose_cfg(
                ["+experiment=ctr", "data=criteo", "data.train_path=a", "data.eval_path=b", "data.device_input=true"]
            ),
            1,
        )


def test_the_feature_log_is_accepted():
    validate(compose_cfg(["+experiment=feature_log", "data.device_input=true"]), 1)


def test_log1p_on_the_device_has_portables_bits():
    from hybridrec.data import portable
    from hybridrec.data.device_input import log1p

    rng = np.random.default_rng(0)
    x = np.concatenate([rng.lognormal(0, 8, 100_000), rng.uniform(0, 1e-9, 1000), [0.0, 5e-324, 1e308, np.inf]])
    assert np.array_equal(portable.log1p(x).view(np.int64), log1p(torch.from_numpy(x)).numpy().view(np.int64))


def test_a_short_run_trains_the_same_losses_and_read_report_on_the_device_path(tmp_path):
    """+experiment=feature_log on a small example log (lists, vocabularies, hashing, weights,
    its planted bad rows): one rank, the same losses step by step and the same read report."""
    from dist_helpers import spawn, train_and_gather
    from hybridrec.data.example import generate

    generate(str(tmp_path / "example"), rows=6000)
    vocab_main([str(tmp_path / "example/train"), "--column", "item_id", "--out", str(tmp_path / "example/vocab")])
    paths = [f"data.{split}_path={tmp_path / 'example' / split}" for split in ("train", "valid", "eval")]
    short = ["data.batch_size=256", "train.steps=6", "train.log_every=1", "train.eval_every=0", "data.eval_batches=1"]
    cfgs = []
    for on in ("false", "true"):
        cfg = compose_cfg(["+experiment=feature_log", *paths, *short, "launcher.device=cpu", f"data.device_input={on}"])
        for f in cfg.data.sparse:
            if f.get("vocabulary"):
                f.vocabulary = str(tmp_path / "example" / "vocab" / os.path.basename(f.vocabulary))
        cfgs.append(cfg)
    off, on = spawn(train_and_gather, 1, cfgs, str(tmp_path / "runs"))
    assert len(off["losses"]) == 6 and off["losses"] == on["losses"]
    assert off["summary"]["data"] == on["summary"]["data"]
