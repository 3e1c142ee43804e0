"""data=parquet on files the tests write: the same global batches for any world size and
worker count, values exactly the file's (multi-hot, id weights, hashing, vocabularies, dense
transforms, labels, sample weights), bad rows counted where they are, and the config checks."""

import os
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from hybridrec.data import DataError, loader
from hybridrec.data.parquet import ParquetSource, hash_ints, hash_strings
from hybridrec.data.vocab import main as vocab_main

pytestmark = pytest.mark.unit

# ------------------------------------------------------------------ an independent reference
M = 2**64


def _mix(x):
    x ^= x >> 30
    x = x * 0xBF58476D1CE4E5B9 % M
    x ^= x >> 27
    x = x * 0x94D049BB133111EB % M
    return x ^ (x >> 31)


def _salt(seed):
    return (seed + 1) * 0x9E3779B97F4A7C15 % M


def ref_int(v, seed=0):
    return _mix((v % M + _salt(seed)) % M)


def ref_str(s, seed=0):
    data = s.encode() if isinstance(s, str) else s
    total = sum(_mix((((j << 8) | c) + _salt(seed) + 0xD1B54A32D192ED03) % M) for j, c in enumerate(data)) % M
    return _mix(total ^ _mix((len(data) + _salt(seed) + 0x8CB92BA72F3D8DD7) % M))


# ------------------------------------------------------------------------------ the files
def rows_table(first, n):
    """Rows first .. first + n - 1: every value a function of the row number."""
    r = np.arange(first, first + n)
    lengths = (r * 7) % 4  # 0..3 tags
    tags = [[int((i * 5 + j) % 20) for j in range(k)] for i, k in zip(r, lengths)]
    return pa.table(
        {
            "row": pa.array(r, pa.int64()),
            "click": pa.array((r % 3 == 0).astype(np.int8)),
            "w": pa.array(((1 + r % 5) / 5).astype(np.float32)),
            "x": pa.array(r * 0.5, pa.float64()),
            "user": pa.array([f"u{i % 11}" for i in r]),
            "item": pa.array(r % 13, pa.int64()),
            "tags": pa.array(tags, pa.list_(pa.int64())),
            "tag_w": pa.array([[0.5 + j for j in range(len(t))] for t in tags], pa.list_(pa.float32())),
        }
    )


def write(path, table, row_group_size=None):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(table, path, row_group_size=row_group_size)
    return str(path)


SPARSE = [
    {"name": "item", "column": "item", "num_embeddings": 13},
    {"name": "user", "column": "user", "num_embeddings": 50, "id_mapping": "hash"},
    {"name": "tags", "column": "tags", "num_embeddings": 20, "weights_column": "tag_w", "pooling": "mean"},
]


def source(train, eval_, batch=8, **kw):
    args = dict(
        batch_size=batch,
        train_path=str(train),
        eval_path=str(eval_),
        label={"column": "click"},
        weight="w",
        dense=[{"column": "row"}, {"column": "x"}],
        sparse=SPARSE,
        seed=0,
    )
    args.update(kw)
    return ParquetSource(**args)


@pytest.fixture
def files(tmp_path):
    """Training: 41 rows in two files (row groups of 5 and 7 rows), so 8-row batches cross
    row groups and files and one row is left over; eval: 13 rows (the last batch padded)."""
    write(tmp_path / "train/a.parquet", rows_table(0, 23), 5)
    write(tmp_path / "train/b.parquet", rows_table(23, 18), 7)
    write(tmp_path / "eval/a.parquet", rows_table(100, 13), 4)
    return tmp_path


def unbatch(batch, keys):
    """A batch as one tuple per row: dense, label, sample weight, and per feature its ids and
    id weights."""
    kjt = batch.sparse_features
    features = []
    for k in keys:
        jt = kjt[k]
        values, weights = jt.values().tolist(), jt.weights().tolist()
        offsets = np.concatenate([[0], np.cumsum(jt.lengths().numpy())])
        features.append([(tuple(values[a:b]), tuple(weights[a:b])) for a, b in zip(offsets[:-1], offsets[1:])])
    return [
        (
            tuple(batch.dense_features[i].tolist()),
            batch.labels[i].item(),
            batch.weights[i].item(),
            tuple(f[i] for f in features),
        )
        for i in range(len(batch.labels))
    ]


def global_batches(data, split, world, workers=0, steps=None):
    """Each global batch as rows, put together from every rank's slice (and which are real)."""
    per_rank = [list(loader.batches(data, split, r, world, steps, num_workers=workers)) for r in range(world)]
    out = []
    for parts in zip(*per_rank):
        rows, real = [], []
        for p in parts:
            b = p if split == "train" else p.batch
            rows += unbatch(b, data.keys)
            real += [True] * len(b.labels) if split == "train" else p.real.tolist()
        out.append((rows, real))
    return out


def expected_row(i):
    """Row i of rows_table, as ``unbatch`` gives it."""
    k = (i * 7) % 4
    tags = tuple(int((i * 5 + j) % 20) for j in range(k))
    user = ref_str(f"u{i % 11}") % 50
    return (
        (float(i), i * 0.5),
        float(i % 3 == 0),
        float(np.float32((1 + i % 5) / 5)),
        (((i % 13,), (1.0,)), ((user,), (1.0,)), (tags, tuple(0.5 + j for j in range(k)))),
    )


# ------------------------------------------------------------------------------------ tests
def test_global_batches_are_the_files_rows_for_any_world_size(files):
    data = source(files / "train", files / "eval")
    assert data.num_batches("train") == 5 and data.num_batches("eval") == 2
    train = global_batches(data, "train", 1, steps=7)  # into the second epoch
    assert [r for rows, _ in train for r in rows] == [expected_row(i) for i in list(range(40)) + list(range(16))]
    evals = global_batches(data, "eval", 1)
    scored = [r for (rows, real) in evals for r, ok in zip(rows, real) if ok]
    assert scored == [expected_row(i) for i in range(100, 113)]
    assert sum(real.count(False) for _, real in evals) == 3  # the padded tail
    for world in (2, 4):
        assert global_batches(data, "train", world, steps=7) == train, world
        assert global_batches(data, "eval", world) == evals, world


def test_worker_processes_build_the_same_batches(files):
    data = source(files / "train", files / "eval")
    train, evals = global_batches(data, "train", 1, steps=6), global_batches(data, "eval", 1)
    for world in (1, 2):
        assert global_batches(data, "train", world, workers=2, steps=6) == train
        assert global_batches(data, "eval", world, workers=2) == evals


def test_a_read_decodes_only_the_row_groups_of_its_rows_and_keeps_the_last(files, monkeypatch):
    data = source(files / "train", files / "eval")
    read = []
    original = pq.ParquetFile.read_row_group
    monkeypatch.setattr(
        pq.ParquetFile, "read_row_group", lambda self, g, **kw: read.append(g) or original(self, g, **kw)
    )
    data.read("train", 0, 1, 4, 8)  # rows 12..15 of a.parquet: groups 2 (10..14) and 3 (15..19)
    assert read == [2, 3]
    data.read("train", 0, 2, 0, 4)  # rows 16..19: group 3 again, kept
    assert read == [2, 3]
    data.read("train", 0, 3, 0, 8)  # rows 24..31: b.parquet rows 1..8, its groups 0 and 1
    assert read == [2, 3, 0, 1]


def test_shards_give_each_rank_its_own_rows_and_the_same_batches_for_any_world_size(files, monkeypatch):
    """data.shards=4: the 41 training rows are 4 shards of 10-11 rows, batch k is rows 2k, 2k+1
    of each; the 13 eval rows are shards of 3-4, the last batch padded. A rank of 4 reads
    only its shard's row groups."""
    data = source(files / "train", files / "eval", shards=4)
    assert data.num_batches("train") == 5 and data.num_batches("eval") == 2
    starts = [s * 41 // 4 for s in range(4)]
    expected = [i for k in range(5) for s in range(4) for i in (starts[s] + 2 * k, starts[s] + 2 * k + 1)]
    train = global_batches(data, "train", 1, steps=5)
    assert [r for rows, _ in train for r in rows] == [expected_row(i) for i in expected]
    evals = global_batches(data, "eval", 1)
    scored = sorted(r for (rows, real) in evals for r, ok in zip(rows, real) if ok)
    assert scored == [expected_row(i) for i in range(100, 113)]  # every row once
    for world in (2, 4):
        assert global_batches(data, "train", world, steps=5) == train, world
        assert global_batches(data, "eval", world) == evals, world
    assert data.report()["dropped_tail_rows"] == {"train": 1}
    read = []
    original = pq.ParquetFile.read_row_group
    monkeypatch.setattr(
        pq.ParquetFile,
        "read_row_group",
        lambda self, g, **kw: read.append((self.metadata.num_rows, g)) or original(self, g, **kw),
    )
    fresh = source(files / "train", files / "eval", shards=4)
    read.clear()  # (building it sampled the first training rows for the pooling factors)
    list(loader.batches(fresh, "train", 3, 4, 5))  # rank 3 of 4: shard 3 = rows 30..40 (b.parquet rows 7..17)
    assert set(read) == {(18, 1), (18, 2)}  # b.parquet (18 rows): its groups of rows 7..13 and 14..17
    with pytest.raises(ValueError, match=r"data.shards=4 must be a multiple of the world size \(3\)"):
        ParquetSource.check_config(OmegaConf.create({"batch_size": 8, "shards": 4}), 3)


def test_rows_and_the_dropped_tail_are_counted_once(files):
    data = source(files / "train", files / "eval")
    list(loader.batches(data, "train", 0, 1, 10))  # two epochs
    for _ in range(2):
        list(loader.batches(data, "eval", 0, 1))
    report = data.report()
    assert report["rows"] == 40 + 13 and report["bad_rows"] == 0
    assert report["dropped_tail_rows"] == {"train": 1}
    assert report["files"][str(files / "train/b.parquet")]["rows"] == 17  # its last row is the tail


def test_multi_hot_lengths_values_and_weights_are_the_files(tmp_path):
    ids = [[3, 1, 4], None, [], [1, 5, 9, 2, 6], [7]]
    weights = [[0.5, 1.5, 2.0], None, [], [1, 2, 3, 4, 5], [0.25]]
    table = pa.table(
        {
            "click": pa.array([1, 0, 1, 0, 1], pa.int8()),
            "ids": pa.array(ids, pa.list_(pa.int32())),
            "wts": pa.array(weights, pa.list_(pa.float64())),
            "one": pa.array([4, None, 2, 0, 1], pa.int64()),
        }
    )
    write(tmp_path / "t.parquet", table)
    write(tmp_path / "e.parquet", table)
    sparse = [
        {"name": "ids", "column": "ids", "num_embeddings": 10, "weights_column": "wts"},
        {"name": "cut", "column": "ids", "num_embeddings": 10, "max_length": 2, "truncate": True},
        {"name": "one", "column": "one", "num_embeddings": 5},
    ]
    data = ParquetSource(
        batch_size=5,
        train_path=str(tmp_path / "t.parquet"),
        eval_path=str(tmp_path / "e.parquet"),
        label={"column": "click"},
        sparse=sparse,
        seed=0,
    )
    rows = data.read("train", 0, 0, 0, 5)
    assert rows.feature(0)[1].tolist() == [3, 0, 0, 5, 1] and rows.feature(0)[0].tolist() == [3, 1, 4, 1, 5, 9, 2, 6, 7]
    assert rows.feature(0)[2].tolist() == [0.5, 1.5, 2.0, 1, 2, 3, 4, 5, 0.25]
    assert rows.feature(1)[1].tolist() == [2, 0, 0, 2, 1] and rows.feature(1)[0].tolist() == [3, 1, 1, 5, 7]
    assert rows.feature(2)[1].tolist() == [1, 0, 1, 1, 1] and rows.feature(2)[0].tolist() == [4, 2, 0, 1]  # null: no id
    assert rows.feature(2)[2].tolist() == [1.0] * 4 and rows.real is None
    assert [f.weighted for f in data.features] == [True, False, False]
    assert data.features[0].pooling_factor == pytest.approx(9 / 5) and data.features[1].pooling_factor == 1.0
    assert rows.dense.shape == (5, 0)


def test_hashing_is_seeded_splitmix64_of_ints_and_strings(tmp_path):
    strings = ["", "a", "abc", "héllo", "a" * 300, "u123"]
    assert hash_strings(pa.array(strings), 0).tolist() == [ref_str(s) for s in strings]
    assert hash_strings(pa.array(strings, pa.large_string()).slice(1), 7).tolist() == [
        ref_str(s, 7) for s in strings[1:]
    ]
    ints = np.array([0, 1, -1, 2**62, 10_000_123])
    # a null whose span holds bytes ("xy"): they belong to no string
    offsets, valid = np.array([0, 2, 4, 5, 5], np.int32), np.packbits([1, 0, 1, 1], bitorder="little")
    with_nulls = pa.StringArray.from_buffers(4, pa.py_buffer(offsets), pa.py_buffer(b"abxyc"), pa.py_buffer(valid))
    assert with_nulls.to_pylist() == ["ab", None, "c", ""]
    assert hash_strings(with_nulls, 0).tolist() == [ref_str("ab"), ref_str(""), ref_str("c"), ref_str("")]
    assert hash_ints(ints, 3).tolist() == [ref_int(int(v), 3) for v in ints]

    users = [f"u{i % 37}" for i in range(200)]
    table = pa.table(
        {
            "click": pa.array([0, 1] * 100, pa.int8()),
            "user": pa.array(users),
            "cat": pa.array(users).dictionary_encode(),
            "item": pa.array(np.arange(200) * 1000, pa.int64()),
        }
    )
    write(tmp_path / "t.parquet", table, 64)
    write(tmp_path / "e.parquet", table)
    sparse = [{"name": n, "column": n, "num_embeddings": 1000, "id_mapping": "hash"} for n in ("user", "cat", "item")]
    make = lambda seed: ParquetSource(
        batch_size=200,
        train_path=str(tmp_path / "t.parquet"),
        eval_path=str(tmp_path / "e.parquet"),
        label={"column": "click"},
        sparse=sparse,
        hash_seed=seed,
        seed=0,
    )
    rows = make(0).read("train", 0, 0, 0, 200)
    assert rows.feature(0)[0].tolist() == [ref_str(u) % 1000 for u in users]
    assert rows.feature(1)[0].tolist() == rows.feature(0)[0].tolist()  # a dictionary column: its strings
    assert rows.feature(2)[0].tolist() == [ref_int(i * 1000) % 1000 for i in range(200)]  # no modulo pattern
    assert make(1).read("train", 0, 0, 0, 200).feature(0)[0].tolist() == [ref_str(u, 1) % 1000 for u in users]
    assert make(0).report()["collisions"].keys() <= {"user", "cat", "item"}


def test_vocabularies_map_known_ids_and_send_the_rest_to_row_0(tmp_path):
    # counts: b 3, a 2, c 2, d 1; ints 7: 3, 5: 2, 9: 1
    part1 = pa.table(
        {
            "click": pa.array([1, 0, 1], pa.int8()),
            "s": ["a", "b", "c"],
            "n": pa.array([7, 5, 9], pa.int64()),
            "l": pa.array([["b", "d"], [], None], pa.list_(pa.string())),
        }
    )
    part2 = pa.table(
        {
            "click": pa.array([0, 1], pa.int8()),
            "s": ["c", "a"],
            "n": pa.array([7, 5], pa.int32()),
            "l": pa.array([["b"], ["x", None]], pa.list_(pa.string())),
        }
    )
    write(tmp_path / "data/p1.parquet", part1)
    write(tmp_path / "data/p2.parquet", part2)
    write(tmp_path / "eval/e.parquet", part1)
    out = str(tmp_path / "vocab")
    assert (
        vocab_main(
            [
                str(tmp_path / "data"),
                "--column",
                "s",
                "--column",
                "n",
                "--column",
                "l",
                "--min-count",
                "2",
                "--out",
                out,
            ]
        )
        == 0
    )
    s, n = pq.read_table(f"{out}/s.parquet"), pq.read_table(f"{out}/n.parquet")
    assert s.to_pydict() == {"id": ["a", "c"], "count": [2, 2]}  # ties by id; b is only in l
    assert n.to_pydict() == {"id": [5, 7], "count": [2, 2]}
    assert pq.read_table(f"{out}/l.parquet").to_pydict() == {"id": ["b"], "count": [2]}
    first = open(f"{out}/s.parquet", "rb").read()
    vocab_main(
        [
            str(tmp_path / "data/p*.parquet"),
            "--column",
            "s",
            "--column",
            "n",
            "--column",
            "l",
            "--min-count",
            "2",
            "--out",
            out,
        ]
    )
    assert open(f"{out}/s.parquet", "rb").read() == first  # deterministic, byte for byte

    sparse = [
        {"name": c, "column": c, "num_embeddings": 3, "id_mapping": "vocabulary", "vocabulary": f"{out}/{c}.parquet"}
        for c in ("s", "n", "l")
    ]
    data = ParquetSource(
        batch_size=5,
        train_path=str(tmp_path / "data"),
        eval_path=str(tmp_path / "eval"),
        label={"column": "click"},
        sparse=sparse,
        seed=0,
    )
    rows = data.read("train", 0, 0, 0, 5)
    # the last row is bad (a null id in its list): padding, one id 0 in every feature
    assert rows.real.tolist() == [True] * 4 + [False]
    assert rows.feature(0)[0].tolist() == [1, 0, 2, 2, 0]  # a -> 1, b (below min-count) -> 0, c -> 2
    assert rows.feature(1)[0].tolist() == [2, 1, 0, 2, 0]  # 5 -> 1, 7 -> 2, 9 -> 0; int32 in one file
    assert rows.feature(2)[0].tolist() == [1, 0, 1, 0] and rows.feature(2)[1].tolist() == [2, 0, 0, 1, 1]  # d -> 0
    assert data.report()["collisions"]["s"] == {"sample_ids": 4, "oov_share": 0.25}

    with pytest.raises(
        DataError,
        match=r"^data.sparse\[0\].num_embeddings=2 is too small for .*s.parquet \(2 ids\): "
        r"it needs 3 rows \(row 0 is every id not in the vocabulary\)$",
    ):
        ParquetSource(
            batch_size=5,
            train_path=str(tmp_path / "data"),
            eval_path=str(tmp_path / "eval"),
            label={"column": "click"},
            sparse=[{**sparse[0], "num_embeddings": 2}],
            seed=0,
        )
    with pytest.raises(DataError, match=r"column 'n' \(data.sparse\[0\].column\) is int64, expected strings"):
        ParquetSource(
            batch_size=5,
            train_path=str(tmp_path / "data"),
            eval_path=str(tmp_path / "eval"),
            label={"column": "click"},
            sparse=[{**sparse[0], "column": "n"}],
            seed=0,
        )


def test_dense_transforms_and_the_fitted_standardization(tmp_path):
    x = np.array([0.0, 1.0, 3.0, -2.0, 10.0, 7.0])
    table = pa.table(
        {
            "click": pa.array([1, 0] * 3, pa.int8()),
            "x": x,
            "k": pa.array([1, 2, 3, 4, 5, 6], pa.int32()),
            "i": pa.array([0] * 6, pa.int64()),
        }
    )
    write(tmp_path / "t.parquet", table, 4)  # the fit merges two row groups
    write(tmp_path / "e.parquet", table)
    sparse = [{"name": "i", "column": "i", "num_embeddings": 1}]
    dense = [
        {"column": "x", "transform": "log1p"},
        {"column": "x", "transform": "standardize"},
        {"column": "k", "transform": "standardize", "mean": 2.0, "std": 4.0},
        {"column": "k"},
    ]
    data = ParquetSource(
        batch_size=6,
        train_path=str(tmp_path / "t.parquet"),
        eval_path=str(tmp_path / "e.parquet"),
        label={"column": "click"},
        sparse=sparse,
        dense=dense,
        seed=0,
    )
    got = data.read("train", 0, 0, 0, 6).dense.numpy()
    np.testing.assert_allclose(got[:, 0], np.log1p(np.maximum(x, 0)), rtol=1e-6)  # negatives clamp to 0
    np.testing.assert_allclose(got[:, 1], (x - x.mean()) / x.std(), rtol=1e-5)
    np.testing.assert_allclose(got[:, 2], (np.arange(1, 7) - 2.0) / 4.0)
    np.testing.assert_allclose(got[:, 3], np.arange(1, 7))
    fitted = data.fitted()["dense"]
    assert fitted[1]["mean"] == pytest.approx(x.mean()) and fitted[1]["std"] == pytest.approx(x.std())
    assert fitted[0] == {"column": "x", "transform": "log1p", "mean": None, "std": None, "encoding": "scalar"}
    assert fitted[2] == {"column": "k", "transform": "standardize", "mean": 2.0, "std": 4.0, "encoding": "scalar"}
    dense[1] = fitted[1]  # merged into the config: nothing is fitted again
    again = ParquetSource(
        batch_size=6,
        train_path=str(tmp_path / "t.parquet"),
        eval_path=str(tmp_path / "e.parquet"),
        label={"column": "click"},
        sparse=sparse,
        dense=dense,
        seed=0,
    )
    assert again.fitted() == {} and np.array_equal(again.read("train", 0, 0, 0, 6).dense.numpy(), got)


def test_label_threshold_and_sample_weights_reach_the_batch(tmp_path):
    table = pa.table(
        {
            "rating": [1.0, 3.5, 4.0, 5.0],
            "w": pa.array([0.5, 2.0, 0.0, 1.0], pa.float32()),
            "i": pa.array([0, 1, 2, 3], pa.int64()),
        }
    )
    write(tmp_path / "t.parquet", table)
    write(tmp_path / "e.parquet", table)
    data = ParquetSource(
        batch_size=4,
        train_path=str(tmp_path / "t.parquet"),
        eval_path=str(tmp_path / "e.parquet"),
        label={"column": "rating", "threshold": 3.5},
        weight="w",
        sparse=[{"name": "i", "column": "i", "num_embeddings": 4}],
        seed=0,
    )
    batch = next(loader.batches(data, "train", 0, 1, 1))
    assert batch.labels.tolist() == [0, 0, 1, 1] and batch.weights.tolist() == [0.5, 2.0, 0.0, 1.0]
    assert data.extra_fields == ("weights",)


def test_bad_rows_are_padding_counted_with_file_and_row(tmp_path):
    table = pa.table(
        {
            "click": pa.array([1, None, 2, 0, 1, 0, 1, 0], pa.int8()),
            "x": [1.0, 1.0, 1.0, None, float("nan"), 1.0, 1.0, 1.0],
            "item": pa.array([1, 2, 3, 4, 5, 99, 6, 7], pa.int64()),
            "tags": pa.array([[1], [1], [1], [1], [1], [1], [1, 2, 3, 4, 5], [1, None]], pa.list_(pa.int64())),
            "tag_w": pa.array(
                [[1.0], [1.0], [1.0], [1.0], [1.0], [1.0], [1.0] * 5, [1.0, 1.0]], pa.list_(pa.float32())
            ),
        }
    )
    mismatched = table.slice(0, 1).set_column(4, "tag_w", pa.array([[1.0, 2.0]], pa.list_(pa.float32())))
    table = pa.concat_tables([table, mismatched])
    bad = write(tmp_path / "e/bad.parquet", table, 3)
    write(tmp_path / "t/t.parquet", pa.concat_tables([table.slice(0, 1)] * 4))
    sparse = [
        {"name": "item", "column": "item", "num_embeddings": 13},
        {"name": "tags", "column": "tags", "num_embeddings": 20, "weights_column": "tag_w", "max_length": 4},
    ]
    make = lambda **kw: ParquetSource(
        **{
            "batch_size": 1,
            "train_path": str(tmp_path / "t"),
            "eval_path": str(tmp_path / "e"),
            "label": {"column": "click"},
            "dense": [{"column": "x"}],
            "sparse": sparse,
            "seed": 0,
            **kw,
        }
    )
    data = make(batch_size=4, train_path=str(tmp_path / "e"), eval_path=str(tmp_path / "t"))
    batches = list(loader.batches(data, "train", 0, 1, 2))
    assert [w for b in batches for w in b.weights.tolist()] == [1, 0, 0, 0, 0, 0, 0, 0]  # weight 0: no loss
    report = data.report()
    assert report["rows"] == 1 and report["bad_rows"] == 7 and report["dropped_tail_rows"] == {"train": 1}
    assert report["files"][bad]["errors"] == [
        f"{bad}:1: label click is null",
        f"{bad}:2: label click 2 is not 0 or 1 (or set data.label.threshold)",
        f"{bad}:3: x is null",
        f"{bad}:4: x nan is not finite",
        f"{bad}:5: item: id 99 is outside the table's rows 0..12 (id_mapping=none)",
    ]
    # every bad row's reason, the 6th onwards past the report's first five
    data = make(batch_size=1)
    rows = data.read("eval", 0, 6, 0, 1), data.read("eval", 0, 7, 0, 1), data.read("eval", 0, 8, 0, 1)
    assert [r.report.files[bad].errors for r in rows] == [
        [f"{bad}:6: tags has 5 ids, more than data.sparse[1].max_length=4"],
        [f"{bad}:7: tags has a null id in its list"],
        [f"{bad}:8: tag_w has 2 weights for 1 ids of tags"],
    ]
    # the batch keeps its shape: a bad row is padding in its place, scored by no metric
    ev = list(loader.batches(make(batch_size=3), "eval", 0, 1))
    assert [r for b in ev for r in b.rows.tolist()] == [0] + [-1] * 8
    first = ev[0].batch
    assert first.sparse_features["tags"].lengths().tolist() == [1, 1, 1] and first.dense_features[1:].abs().sum() == 0
    with pytest.raises(DataError, match=re.escape(f"{bad}:1: label click is null (data.bad_rows=fail)")):
        list(loader.batches(make(batch_size=3, bad_rows="fail"), "eval", 0, 1))


def test_a_directory_a_glob_and_a_valid_fraction_carve_out(tmp_path):
    for f in range(3):
        write(tmp_path / f"logs/part-{f:05d}.parquet", rows_table(f * 5000, 5000), 2048)
    open(tmp_path / "logs/_SUCCESS", "w").close()  # Spark's marker: not a Parquet file, not read
    write(tmp_path / "test/e.parquet", rows_table(0, 10))
    by_dir = source(tmp_path / "logs", tmp_path / "test", batch=1000, dense=[{"column": "row"}])
    by_glob = source(str(tmp_path / "logs/part-*.parquet"), tmp_path / "test", batch=1000, dense=[{"column": "row"}])
    assert by_dir.num_batches("train") == by_glob.num_batches("train") == 15
    assert by_dir.read("train", 0, 14, 0, 1000).dense[:, 0].tolist() == list(range(14000, 15000))

    data = source(tmp_path / "logs", tmp_path / "test", batch=1000, dense=[{"column": "row"}], valid_fraction=0.3)
    assert data.splits == ("train", "valid", "eval")
    seen = {}
    for split in ("train", "valid"):
        total = data._splits[split].total
        seen[split] = data.read(split, 0, 0, 0, total).dense[:, 0].long().tolist()
    assert not set(seen["train"]) & set(seen["valid"]) and sorted(seen["train"] + seen["valid"]) == list(range(15000))
    assert seen["train"] == sorted(seen["train"]) and 0 < len(seen["valid"]) < 15000
    assert all(len(run) % 4096 == 0 or run[-1] % 5000 == 4999 for run in _runs(seen["valid"]))


def _runs(rows):
    out, run = [], [rows[0]]
    for r in rows[1:]:
        if r == run[-1] + 1 and r % 5000:
            run.append(r)
        else:
            out.append(run)
            run = [r]
    return out + [run]


def test_files_and_columns_that_do_not_fit_are_named(tmp_path):
    write(tmp_path / "t/a.parquet", rows_table(0, 10))
    write(tmp_path / "e/a.parquet", rows_table(0, 10))
    with pytest.raises(DataError, match=r"a.parquet: no column 'clicks' \(data.label.column\); its columns: row, "):
        source(tmp_path / "t", tmp_path / "e", label={"column": "clicks"})
    with pytest.raises(DataError, match=r"column 'user' \(data.sparse\[0\].column\) is string, expected integers"):
        source(tmp_path / "t", tmp_path / "e", sparse=[{"name": "u", "column": "user", "num_embeddings": 5}])
    with pytest.raises(
        DataError,
        match=r"^the train split has 10 rows: fewer than one global batch "
        r"\(data.batch_size=16\)$",
    ):
        source(tmp_path / "t", tmp_path / "e", batch=16)
    with pytest.raises(DataError, match=r"is in both data.train_path and data.eval_path"):
        source(tmp_path / "t", tmp_path / "t/a.parquet")
    open(tmp_path / "e/b.parquet", "w").write("not parquet")
    with pytest.raises(DataError, match=r"b.parquet \(data.eval_path\): not a readable Parquet file"):
        source(tmp_path / "t", tmp_path / "e")


GOOD = {"label": {"column": "click"}, "sparse": [{"name": "a", "column": "a", "num_embeddings": 10}], "dense": []}


@pytest.mark.parametrize(
    "change,message",
    [
        ({"sparse": []}, "data.sparse lists no feature: give at least one (name, column, num_embeddings)"),
        ({"label": {"column": None}}, "data.label.column is not set: name the label column"),
        (
            {"sparse": [GOOD["sparse"][0]] * 2},
            "data.sparse[1].name='a' is used twice: feature names are the batch's keys",
        ),
        ({"sparse": [{**GOOD["sparse"][0], "num_embeddings": 0}]}, "data.sparse[0].num_embeddings must be >= 1, got 0"),
        (
            {"sparse": [{**GOOD["sparse"][0], "max_length": 0}]},
            "data.sparse[0].max_length must be >= 1 (or unset: any length)",
        ),
        (
            {"sparse": [{**GOOD["sparse"][0], "truncate": True}]},
            "data.sparse[0].truncate=true cuts lists to max_length",
        ),
        (
            {"sparse": [{**GOOD["sparse"][0], "id_mapping": "vocabulary"}]},
            "data.sparse[0]: id_mapping=vocabulary and a vocabulary file go together (id_mapping=vocabulary, vocabulary=None)",
        ),
        (
            {
                "sparse": [
                    {**GOOD["sparse"][0], "table": "t"},
                    {"name": "b", "column": "b", "num_embeddings": 20, "table": "t"},
                ]
            },
            "data.sparse: a and b share table t but differ in num_embeddings (10 vs 20)",
        ),
        (
            {
                "sparse": [
                    {**GOOD["sparse"][0], "table": "t"},
                    {"name": "b", "column": "b", "num_embeddings": 10, "table": "t", "pooling": "mean"},
                ]
            },
            "data.sparse: a and b share table t but differ in pooling (sum vs mean)",
        ),
        (
            {"sparse": [{**GOOD["sparse"][0], "table": "items"}]},
            "data.sparse[0].table='items' cannot name a table: it is an attribute of torch's ModuleDict, which holds the tables",
        ),
        (
            {"sparse": [{**GOOD["sparse"][0], "weights_column": "a"}]},
            "data.sparse[0].weights_column='a' must name a column",
        ),
        (
            {"dense": [{"column": "x", "transform": "log1p", "mean": 1.0}]},
            "data.dense[0]: mean and std belong to transform=standardize, not transform=log1p",
        ),
        (
            {"dense": [{"column": "x", "transform": "standardize", "mean": 1.0}]},
            "data.dense[0]: set both mean and std, or neither",
        ),
        (
            {"dense": [{"column": "x", "transform": "standardize", "mean": 1.0, "std": 0.0}]},
            "data.dense[0].std must be > 0, got 0.0",
        ),
        ({"dense": [{"column": "x"}, {"column": "x"}]}, "data.dense[1].column='x' is listed twice in data.dense"),
        ({"weight": "click"}, "data.weight='click' must name a sample weight column other than the label's"),
        ({"valid_fraction": 1.0}, "data.valid_fraction must be in [0, 1), got 1.0"),
        ({"valid_fraction": 0.1, "valid_path": "v"}, "data.valid_path and data.valid_fraction are both set"),
    ],
)
def test_config_checks_refuse_in_one_line(change, message):
    with pytest.raises(ValueError, match=re.escape(message)) as e:
        ParquetSource.check_config(OmegaConf.create({**GOOD, **change}), 2)
    assert "\n" not in str(e.value)


def test_the_shipped_option_composes_and_passes_its_checks(cfg_factory):
    cfg = cfg_factory(["data=parquet"])
    ParquetSource.check_config(cfg.data, 4)
    assert cfg.data.train_path == "data/example/train" and cfg.data.sparse[2].table == "item_table"


@pytest.mark.unit
def test_a_vocabulary_that_cannot_be_written_is_one_line_and_replaces_nothing(tmp_path, capsys):
    write(tmp_path / "t.parquet", rows_table(0, 20))
    (tmp_path / "a_file").write_text("")
    assert vocab_main([str(tmp_path / "t.parquet"), "--column", "user", "--out", str(tmp_path / "a_file" / "v")]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("hybridrec.data.vocab: --out ") and "cannot create the directory" in err
