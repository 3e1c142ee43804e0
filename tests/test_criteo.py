"""Criteo readers on files the tests write: exact values, bad rows, partitioning, binary."""

import gzip
import json
import os
import zlib

import numpy as np
import pytest
import torch
from torchrec.datasets.criteo import BinaryCriteoUtils

import commands
from hybridrec.data import DataError, ReadReport, loader
from hybridrec.data.criteo import CriteoBinary, CriteoTSV, map_ids, read_tsv_file
from shared import SIZES, rand_rows, reader, row, write


@pytest.mark.unit
def test_values_are_parsed_exactly(tmp_path):
    cats = ["68fd1e64", "80E26C9B", ""] + ["fffffff0"] * 23
    write(tmp_path / "a.tsv", [row(1, [5, -3, ""] + [0] * 10, cats)] * 4)
    b = next(loader.batches(reader(tmp_path / "a.tsv", split="train"), "train", 0, 1, 1))
    expected = np.log1p([5, 0, 0] + [0] * 10).astype(np.float32)  # negatives clamp, missing = 0
    torch.testing.assert_close(b.dense_features[0], torch.from_numpy(expected))
    kjt = b.sparse_features
    assert kjt["cat_0"].values()[0] == int("68fd1e64", 16) % 1000
    assert kjt["cat_1"].values()[0] == int("80e26c9b", 16) % 1000  # upper-case hex
    assert kjt["cat_2"].values()[0] == 0  # missing
    assert torch.all(kjt.lengths() == 1) and b.labels.tolist() == [1.0] * 4


@pytest.mark.unit
def test_hash_mapping_spreads_ids_the_modulo_keeps():
    raw = np.array([[0, 1000, 2000]], dtype=np.uint64).T  # all = 0 mod 1000
    assert set(map_ids(raw, np.array([1000]), "modulo")[:, 0]) == {0}
    hashed = map_ids(raw, np.array([1000]), "hash")[:, 0]
    assert len(set(hashed)) == 3 and hashed.max() < 1000


@pytest.mark.unit
def test_bad_rows_are_skipped_counted_and_located(tmp_path):
    good = row()
    rows = [
        good,
        "1\t2\t3",
        row(ints=["x"] + [1] * 12),
        row(label=2),
        row(cats=["zz"] + ["a"] * 25),
        row(cats=["123456789"] + ["a"] * 25),
        good,
    ]
    write(tmp_path / "a.tsv", rows)
    write(tmp_path / "b.tsv.gz", [good] * 3, gz=True)
    write(tmp_path / "c.tsv", [])  # empty file among others: fine, reported with 0 rows
    with gzip.open(tmp_path / "d.tsv.gz", "wt") as f:
        f.write("\n".join([good] * 200) + "\n")
    truncated = open(tmp_path / "d.tsv.gz", "rb").read()
    open(tmp_path / "d.tsv.gz", "wb").write(truncated[: len(truncated) // 2])
    data = reader(tmp_path, batch=2)
    batches = list(loader.batches(data, "eval", 0, 1))
    report = data.report()
    a = report["files"][str(tmp_path / "a.tsv")]
    assert a["rows"] == 2 and a["bad_rows"] == 5
    assert a["errors"] == [
        f"{tmp_path / 'a.tsv'}:2: 3 fields, expected 40",
        f"{tmp_path / 'a.tsv'}:3: int_0 'x' is not an integer",
        f"{tmp_path / 'a.tsv'}:4: label '2' is not 0 or 1",
        f"{tmp_path / 'a.tsv'}:5: cat_0 'zz' is not a hex id of at most 8 digits",
        f"{tmp_path / 'a.tsv'}:6: cat_0 '123456789' is not a hex id of at most 8 digits",
    ]
    d = report["files"][str(tmp_path / "d.tsv.gz")]
    # a truncated gzip keeps every complete line before the break; the rest is reported, not counted
    assert d["rows"] > 0 and d["bad_rows"] == 0 and d["errors"] == []
    assert d["unreadable"].startswith(f"unreadable from {tmp_path / 'd.tsv.gz'}:{d['rows'] + 1} (truncated gzip: ")
    assert report["unreadable"] == [d["unreadable"]]
    assert report["files"][str(tmp_path / "b.tsv.gz")]["rows"] == 3
    # every kept row is scored: the last batch is padded, not dropped
    assert report["rows"] == sum(int(b.real.sum()) for b in batches) and "eval" not in report["dropped_tail_rows"]


@pytest.mark.unit
def test_fail_mode_stops_at_the_first_bad_row(tmp_path):
    write(tmp_path / "a.tsv", [row(), row(), row(ints=["1.5"] + [1] * 12)])
    with pytest.raises(DataError, match=r"a.tsv:3: int_0 '1.5' is not an integer"):
        list(loader.batches(reader(tmp_path / "a.tsv", batch=1, bad_rows="fail"), "eval", 0, 1))
    write(tmp_path / "b.tsv", [row(), "1\t2"])
    with pytest.raises(DataError, match=r"b.tsv:2: 2 fields, expected 40"):
        list(loader.batches(reader(tmp_path / "b.tsv", batch=1, bad_rows="fail"), "eval", 0, 1))


@pytest.mark.unit
def test_missing_path_and_empty_dataset_fail_at_construction(tmp_path):
    with pytest.raises(DataError, match="data.train_path=.*nope.*no such file"):
        reader(tmp_path / "nope.tsv", split="train")
    write(tmp_path / "empty.tsv", [])
    open(tmp_path / "empty.tsv", "w").close()
    with pytest.raises(DataError, match="every file is empty"):
        reader(tmp_path / "empty.tsv")


@pytest.mark.unit
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_ranks_partition_each_global_batch(tmp_path, world_size):
    """Each rank reads only its shards, and together they make the 1-rank global batches."""
    write(tmp_path / "a.tsv", rand_rows(400))
    whole = [b for b in loader.batches(reader(tmp_path / "a.tsv", batch=12, shards=6), "eval", 0, 1)]
    parts = [
        list(loader.batches(reader(tmp_path / "a.tsv", batch=12, shards=6), "eval", r, world_size))
        for r in range(world_size)
    ]
    assert sum(int(b.real.sum()) for b in whole) == 400  # every row, the tails padded
    for i, w in enumerate(whole):
        got = [p[i] if i < len(p) else None for p in parts]  # a rank may run out first: padding
        real = torch.cat([g.real if g else torch.zeros(12 // world_size, dtype=torch.bool) for g in got])
        assert torch.equal(real, w.real)
        labels = torch.cat([g.batch.labels for g in got if g])[real[: sum(len(g.real) for g in got if g)]]
        assert torch.equal(labels, w.batch.labels[w.real])  # union, no overlap, same order
    for world in parts:  # a rank whose shards ran dry stopped; the others padded to its length
        assert len(world) <= len(whole)


@pytest.mark.unit
def test_table_collisions_are_estimated(tmp_path):
    write(tmp_path / "a.tsv", rand_rows(64))
    data = reader(tmp_path / "a.tsv", split="train", num_embeddings_per_feature=[7] * 26)
    list(loader.batches(data, "train", 0, 1, 17))  # estimated once the file (64 rows < the sample's size) is read
    c = data.report()["collisions"]["cat_0"]
    assert c["distinct_ids"] > c["distinct_rows"] and c["distinct_rows"] <= 7


@pytest.mark.unit
def test_binary_format_written_by_torchrec_reads_the_same_rows(tmp_path):
    tsv = write(tmp_path / "day_0.tsv", rand_rows(30, seed=3))
    BinaryCriteoUtils.tsv_to_npys(tsv, *(str(tmp_path / f"day_0_{p}.npy") for p in ("dense", "sparse", "labels")))
    os.makedirs(tmp_path / "train")
    train = write(tmp_path / "train" / "day_1.tsv", rand_rows(6, seed=4))
    BinaryCriteoUtils.tsv_to_npys(
        train, *(str(tmp_path / "train" / f"day_1_{p}.npy") for p in ("dense", "sparse", "labels"))
    )
    binary = CriteoBinary(
        batch_size=6,
        train_path=str(tmp_path / "train"),
        eval_path=str(tmp_path),
        num_embeddings_per_feature=SIZES,
        id_mapping="modulo",
        eval_batches=None,
        seed=0,
    )
    text = [b.batch for b in loader.batches(reader(tsv, batch=6), "eval", 0, 1)]
    for world_size in (1, 2, 3):
        parts = [[b.batch for b in loader.batches(binary, "eval", r, world_size)] for r in range(world_size)]
        assert all(len(p) == 5 for p in parts)
        for i, t in enumerate(text):
            assert torch.equal(torch.cat([p[i].labels for p in parts]), t.labels)
            for f in ("cat_0", "cat_25"):
                ids = torch.cat([p[i].sparse_features[f].values() for p in parts])
                assert torch.equal(ids, t.sparse_features[f].values())
    assert binary.report()["files"][str(tmp_path / "day_0")]["rows"] == 30


@pytest.mark.unit
def test_binary_day_missing_a_part_is_an_error(tmp_path):
    np.save(tmp_path / "day_0_dense.npy", np.zeros((4, 13), np.float32))
    with pytest.raises(DataError, match="day_0_sparse.npy is missing"):
        CriteoBinary(2, str(tmp_path), str(tmp_path), SIZES, "modulo", None, 0)


@pytest.mark.slow
def test_train_on_criteo_files_end_to_end(tmp_path):
    rows = rand_rows(600, seed=1)
    train = write(tmp_path / "train.tsv.gz", rows[:500] + ["1\tbroken"], gz=True)
    eval_ = write(tmp_path / "eval.tsv", rows[500:])
    run = tmp_path / "run"
    proc = commands.run(
        "hybridrec.train",
        "data=criteo",
        f"data.train_path={train}",
        f"data.eval_path={eval_}",
        "data.batch_size=50",
        "data.shards=2",
        "train.steps=12",
        "train.log_every=4",
        f"hydra.run.dir={run}",
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.load(open(run / "summary.json"))
    assert s["eval"]["n"] == 100 and 0 <= s["eval"]["auc"] <= 1
    assert s["data"]["bad_rows"] == 1 and "skipped 1 bad rows" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_missing_data_path_fails_before_any_rank_starts(tmp_path):
    proc = commands.run(
        "hybridrec.train",
        "data=criteo",
        "data.train_path=/nope",
        "data.eval_path=/nope",
        "launcher.nproc_per_node=2",
        f"hydra.run.dir={tmp_path}",
        timeout=60,
    )
    assert proc.returncode != 0 and "data.train_path=/nope" in proc.stderr and "[rank" not in proc.stderr


# ---------------------------------------------------------------- no silent data loss
def _gz(path, lines):
    with gzip.open(path, "wb") as f:
        f.write(("\n".join(lines) + "\n").encode())
    return str(path)


def _complete_lines(compressed: bytes) -> int:
    """Complete lines a decompressor recovers from a damaged gzip: the reference count."""
    text = zlib.decompressobj(wbits=31).decompress(compressed)
    return text.count(b"\n")


@pytest.mark.unit
def test_a_line_that_is_not_utf8_costs_that_line_only(tmp_path):
    lines = [row() for _ in range(1000)]
    data = ("\n".join(lines) + "\n").encode()
    at = data.index(b"\n", sum(len(line) + 1 for line in lines[:10]) + 5)  # inside line 11
    open(tmp_path / "a.tsv", "wb").write(data[: at - 3] + b"\xff" + data[at - 2 :])
    source = reader(tmp_path / "a.tsv", batch=8)
    list(loader.batches(source, "eval", 0, 1))
    f = source.report()["files"][str(tmp_path / "a.tsv")]
    assert f["rows"] == 999 and f["bad_rows"] == 1 and f["rows"] + f["bad_rows"] == 1000
    assert f["errors"] == [f"{tmp_path / 'a.tsv'}:11: not UTF-8 text (byte 0xff at column {len(lines[10]) - 2})"]
    with pytest.raises(DataError, match=r"a.tsv:11: not UTF-8 text \(byte 0xff"):
        list(loader.batches(reader(tmp_path / "a.tsv", batch=8, bad_rows="fail"), "eval", 0, 1))


@pytest.mark.slow
def test_a_truncated_gzip_keeps_every_complete_line_before_the_break(tmp_path):
    # about 4 MB of text (several 1 MB blocks): 2,000 random rows ten times over, each copy
    # 400 KB apart, beyond gzip's 32 KB window, so it compresses as 20,000 random rows do
    path = _gz(tmp_path / "a.tsv.gz", rand_rows(2_000, seed=2) * 10)
    compressed = open(path, "rb").read()
    open(path, "wb").write(compressed[: len(compressed) // 2])
    complete = _complete_lines(compressed[: len(compressed) // 2])
    assert complete > 9_000
    for block_size_mb in (1, 16):  # the break after several blocks, and inside the first
        # batches of 64: every row still counted (an evaluated split pads its last batch)
        source = reader(path, batch=64, block_size_mb=block_size_mb)
        kept = sum(int(b.real.sum()) for b in loader.batches(source, "eval", 0, 1))
        f = source.report()["files"][path]
        assert kept == f["rows"] == complete and f["bad_rows"] == 0  # rows + bad_rows = the complete lines read
        assert f["unreadable"].startswith(f"unreadable from {path}:{complete + 1} (truncated gzip: ")
        assert "bytes of that line read, nothing after it" in f["unreadable"]
        with pytest.raises(DataError, match=rf"a.tsv.gz:{complete + 1}: unreadable from here \(truncated gzip"):
            list(loader.batches(reader(path, batch=64, bad_rows="fail", block_size_mb=block_size_mb), "eval", 0, 1))


@pytest.mark.unit
def test_every_line_is_counted_and_row_indices_do_not_depend_on_the_block_size(tmp_path):
    lines = rand_rows(12_000, seed=5)  # > 2 MB: several 1 MB blocks
    for i in (10, 5_000, 11_999):
        lines[i] = "1\tbroken"
    lines[7_000] = ""  # an empty line is a bad row too (and a structurally valid one)
    path = write(tmp_path / "a.tsv", lines)
    parts = {}
    for mb in (1, 16):
        report = ReadReport()
        parts[mb] = list(read_tsv_file(path, mb * 2**20, False, report))
        f = report.to_dict()["files"][path]
        assert f["rows"] + f["bad_rows"] == 12_000 and f["bad_rows"] == 4
        assert f["errors"][:3] == [
            f"{path}:11: 2 fields, expected 40",
            f"{path}:5001: 2 fields, expected 40",
            f"{path}:7001: empty line",
        ]
    lines = {mb: np.concatenate([p[3] for p in blocks]) for mb, blocks in parts.items()}
    assert len(parts[1]) > 1 and np.array_equal(lines[1], lines[16])
    assert np.array_equal(lines[1], np.delete(np.arange(1, 12_001), [10, 5_000, 7_000, 11_999]))  # each kept row's line


@pytest.mark.unit
@pytest.mark.parametrize(
    "value,accepted",
    [
        ("9223372036854775807", True),
        ("-9223372036854775808", True),
        ("9223372036854775808", False),
        ("12345678901234567890", False),
    ],
)
def test_a_19_digit_integer_gets_the_same_verdict_whatever_its_neighbours(tmp_path, value, accepted):
    probe = row(ints=[value] + [1] * 12)
    verdicts = []
    for neighbour in (row(), row(ints=["x"] + [1] * 12)):  # fast path (all cast), slow path (cell by cell)
        path = write(tmp_path / "a.tsv", [probe, neighbour, row()])
        source = reader(path, batch=1)
        list(loader.batches(source, "eval", 0, 1))
        errors = source.report()["files"][path]["errors"]
        verdicts.append(not any(e.startswith(f"{path}:1:") for e in errors))
    assert verdicts == [accepted, accepted]


@pytest.mark.unit
def test_a_huge_bad_field_is_quoted_short(tmp_path):
    path = write(tmp_path / "a.tsv", [row(cats=["z" * 3_000_000] + ["a"] * 25), row()])
    source = reader(path, batch=1)
    list(loader.batches(source, "eval", 0, 1))
    report = source.report()
    error = report["files"][path]["errors"][0]
    assert error == f"{path}:1: cat_0 {'z' * 40!r}…(3000000 bytes) is not a hex id of at most 8 digits"
    assert len(json.dumps(report)) < 5_000


@pytest.mark.unit
def test_a_file_two_splits_would_read_is_refused(tmp_path):
    """The eval day inside the training directory (or glob), or validation = a training file."""
    for day in ("day_0", "day_1"):
        write(tmp_path / f"{day}.tsv", rand_rows(8))
    common = dict(
        batch_size=4,
        num_embeddings_per_feature=SIZES,
        id_mapping="modulo",
        bad_rows="skip",
        block_size_mb=1,
        eval_batches=None,
        seed=0,
    )
    with pytest.raises(DataError, match=r"day_1.tsv is in both data.train_path and data.eval_path"):
        CriteoTSV(train_path=str(tmp_path), eval_path=str(tmp_path / "day_1.tsv"), **common)
    os.makedirs(tmp_path / "test")
    test = write(tmp_path / "test" / "day_2.tsv", rand_rows(4))
    with pytest.raises(DataError, match=r"day_0.tsv is in both data.train_path and data.valid_path"):
        CriteoTSV(
            train_path=str(tmp_path / "day_*.tsv"), eval_path=test, valid_path=str(tmp_path / "day_0.tsv"), **common
        )
    for day in ("day_0", "day_1"):
        tsv = str(tmp_path / f"{day}.tsv")
        BinaryCriteoUtils.tsv_to_npys(tsv, *(str(tmp_path / f"{day}_{p}.npy") for p in ("dense", "sparse", "labels")))
    with pytest.raises(DataError, match=r"day_1_dense.npy is in both data.train_path and data.eval_path"):
        CriteoBinary(4, str(tmp_path), str(tmp_path / "day_1_dense.npy"), SIZES, "modulo", None, 0)


@pytest.mark.unit
def test_most_ids_colliding_in_a_table_warns_once_naming_it(tmp_path, caplog):
    write(tmp_path / "a.tsv", rand_rows(64))
    data = reader(tmp_path / "a.tsv", split="train", num_embeddings_per_feature=[7] + [1000] * 25)
    with caplog.at_level("WARNING", logger="hybridrec.data.criteo"):
        list(loader.batches(data, "train", 0, 1, 20))  # 20 batches of 4: the file once (16), then again
    warnings = [r.getMessage() for r in caplog.records if "collide" in r.getMessage()]
    assert len(warnings) == 1 and "t_cat_0: 7 rows" in warnings[0] and "index 0" in warnings[0]
    assert "t_cat_1" not in warnings[0]  # 64 ids in 1000 rows: few collide


@pytest.mark.unit
def test_valid_fraction_holds_out_disjoint_seeded_rows(tmp_path):
    """Validation rows are a seeded share of the training file: disjoint from the rows trained
    on, together all of them, the same for any world size."""
    rows = [row(label=i % 2, ints=[i] + [0] * 12) for i in range(200)]  # int_0 identifies the row
    write(tmp_path / "a.tsv", rows)
    data = reader(tmp_path / "a.tsv", batch=5, split="train", valid_fraction=0.25)
    assert data.splits == ("train", "valid", "eval")
    real = lambda b: (
        (b.batch, b.real) if isinstance(b, loader.EvalBatch) else (b, torch.ones(len(b.labels), dtype=torch.bool))
    )
    ident = lambda batches: sorted(
        int(round(float(torch.expm1(x)))) for b, r in map(real, batches) for x in b.dense_features[r, 0]
    )
    train, valid = (
        ident(loader.batches(data, "train", 0, 1, 200 // 5 * 3 // 4)),
        ident(loader.batches(data, "valid", 0, 1)),
    )
    assert not set(train) & set(valid) and 30 <= len(valid) <= 70
    assert len(set(train) | set(valid)) >= 195  # every row but the few training did not reach
    again = reader(tmp_path / "a.tsv", batch=5, split="train", valid_fraction=0.25)
    assert ident(loader.batches(again, "valid", 0, 1)) == valid  # fixed by the seed
    other_seed = reader(tmp_path / "a.tsv", batch=5, split="train", valid_fraction=0.25, seed=1)
    assert ident(loader.batches(other_seed, "valid", 0, 1)) != valid
