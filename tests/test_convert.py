"""The converter: TSV -> the binary .npy layout and TSV or .npy -> Parquet. The rows and
bad-row counts of the TSV reader, byte-stable output, refusals, the Parquet source reading the
converted files as the TSV and binary sources read theirs, and training on the converted
files equal to training on the TSV."""

import glob
import json
import os

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from omegaconf import OmegaConf

import commands
from conftest import compose_cfg
from hybridrec.data import build_source, loader
from hybridrec.data.convert import DENSE_COLUMNS, PARQUET_SCHEMA, SPARSE_COLUMNS, config_path
from hybridrec.data.convert import main as convert
from hybridrec.data.criteo import CriteoBinary, map_ids
from shared import SIZES, rand_rows, reader, row, write


def _rows_with_bad(n, seed):
    rows = rand_rows(n, seed=seed)
    rows[3] = "1\tbroken"  # wrong field count
    rows[10] = row(ints=["x"] + [1] * 12)  # not an integer
    rows[n // 2] = ""  # empty line
    rows[-1] = row(cats=["123456789"] + ["a"] * 25)  # id too long
    return rows


def _npys(out):
    return {os.path.basename(p): open(p, "rb").read() for p in sorted(glob.glob(os.path.join(out, "*.npy")))}


@pytest.mark.unit
def test_converted_rows_and_bad_rows_are_the_tsv_readers(tmp_path):
    path = write(tmp_path / "day_0.tsv", _rows_with_bad(300, seed=1))
    convert([path, "--out", str(tmp_path / "npy"), "--workers", "1"])
    dense, sparse, labels = (np.load(tmp_path / "npy" / f"day_0_{p}.npy") for p in ("dense", "sparse", "labels"))
    assert (dense.dtype, sparse.dtype, labels.dtype) == (np.float32, np.int64, np.int32)
    assert dense.shape == (296, 13) and sparse.shape == (296, 26) and labels.shape == (296, 1)
    # what CriteoTSV yields for the file: one global batch of all its rows
    source = reader(path, batch=296)
    (batch,) = [b.batch for b in loader.batches(source, "eval", 0, 1)]
    assert torch.equal(torch.from_numpy(dense), batch.dense_features)
    assert torch.equal(torch.from_numpy(labels[:, 0].astype(np.float32)), batch.labels)
    ids = map_ids(sparse, np.array(SIZES), "modulo")
    for f in range(26):
        assert np.array_equal(ids[:, f], batch.sparse_features[f"cat_{f}"].values().numpy())
    # bad rows counted as training counts them, in the report
    report = json.load(open(tmp_path / "npy" / "convert_report.json"))
    expected = source.report()["files"][path]
    assert {k: report["files"][path][k] for k in expected} == expected
    assert expected["bad_rows"] == 4 and expected["errors"][0] == f"{path}:4: 2 fields, expected 40"
    assert report["rows"] == 296 and report["bad_rows"] == 4
    # and CriteoBinary reads the converted day as the same batches
    other = write(tmp_path / "x.tsv", rand_rows(148))  # the training split CriteoBinary needs
    convert([other, "--out", str(tmp_path / "other_npy")])
    binary = CriteoBinary(148, str(tmp_path / "other_npy"), str(tmp_path / "npy"), SIZES, "modulo", None, 0)
    parts = [b.batch for b in loader.batches(binary, "eval", 0, 1)]
    assert torch.equal(torch.cat([b.dense_features for b in parts]), batch.dense_features)
    assert torch.equal(torch.cat([b.labels for b in parts]), batch.labels)
    assert not glob.glob(str(tmp_path / "npy" / "*.partial"))


@pytest.mark.unit
def test_gz_input_converts_to_the_same_bytes_and_a_truncated_one_is_reported(tmp_path):
    rows = _rows_with_bad(2000, seed=2)
    os.makedirs(tmp_path / "plain")
    os.makedirs(tmp_path / "gz")
    write(tmp_path / "plain" / "day_0.tsv", rows)
    write(tmp_path / "gz" / "day_0.gz", rows, gz=True)
    convert([str(tmp_path / "plain"), "--out", str(tmp_path / "a")])
    convert([str(tmp_path / "gz"), "--out", str(tmp_path / "b")])
    assert _npys(tmp_path / "a") == _npys(tmp_path / "b") and len(_npys(tmp_path / "a")) == 3
    # a truncated gzip: every complete line before the break, the rest reported as training does
    whole = open(tmp_path / "gz" / "day_0.gz", "rb").read()
    cut = write(tmp_path / "cut.tsv.gz", [])
    open(cut, "wb").write(whole[: len(whole) // 2])
    convert([cut, "--out", str(tmp_path / "c"), "--block-size-mb", "1"])
    source = reader(cut, batch=1, block_size_mb=1)
    kept = sum(int(b.real.sum()) for b in loader.batches(source, "eval", 0, 1))
    report = json.load(open(tmp_path / "c" / "convert_report.json"))
    expected = source.report()["files"][cut]
    assert {k: report["files"][cut][k] for k in expected} == expected
    assert expected["unreadable"].startswith(f"unreadable from {cut}:")
    assert np.load(tmp_path / "c" / "cut_labels.npy").shape == (kept, 1) and kept > 0


@pytest.mark.slow  # --workers 2 starts worker processes (a fork server that imports torch, seconds the first time)
def test_two_workers_write_the_same_bytes_as_one(tmp_path):
    os.makedirs(tmp_path / "tsv")
    for day in range(3):
        write(tmp_path / "tsv" / f"day_{day}.tsv", _rows_with_bad(400, seed=day))
    convert([str(tmp_path / "tsv"), "--out", str(tmp_path / "one"), "--workers", "1"])
    convert([str(tmp_path / "tsv"), "--out", str(tmp_path / "two"), "--workers", "2"])
    one, two = _npys(tmp_path / "one"), _npys(tmp_path / "two")
    assert len(one) == 9 and one == two
    files = lambda d: json.load(open(tmp_path / d / "convert_report.json"))["files"]
    strip = lambda fs: {p: {k: v for k, v in f.items() if k != "output"} for p, f in fs.items()}
    assert strip(files("one")) == strip(files("two"))


def _refused(capsys, argv, code=2):
    with pytest.raises(SystemExit) as e:
        convert(argv)
    err = capsys.readouterr().err
    assert e.value.code == code and err.startswith("hybridrec: ") and err.count("\n") == 1, err
    return err


@pytest.mark.unit
def test_refusals_are_one_line_with_exit_code_2(tmp_path, capsys):
    path = write(tmp_path / "day_0.tsv", rand_rows(20))
    out = str(tmp_path / "npy")
    convert([path, "--out", out])
    before = _npys(out)
    assert "day_0_dense.npy exists (and 2 more output files): pass --overwrite" in _refused(
        capsys, [path, "--out", out]
    )
    convert([path, "--out", out, "--overwrite"])
    assert _npys(out) == before
    assert "no such file" in _refused(capsys, [str(tmp_path / "nope.tsv"), "--out", out])
    np.save(tmp_path / "x.npy", np.zeros((4, 13)))
    assert "not a Criteo TSV" in _refused(capsys, [str(tmp_path / "x.npy"), "--out", out])
    open(tmp_path / "fake.gz", "w").write(row() + "\n")
    assert "not gzip" in _refused(capsys, [str(tmp_path / "fake.gz"), "--out", out])


@pytest.mark.unit
def test_fail_mode_stops_at_the_first_bad_row_and_leaves_no_file(tmp_path, capsys):
    path = write(tmp_path / "day_0.tsv", _rows_with_bad(50, seed=3))
    err = _refused(capsys, [path, "--out", str(tmp_path / "npy"), "--bad-rows", "fail"], code=1)
    assert f"{path}:4: 2 fields, expected 40" in err
    assert os.listdir(tmp_path / "npy") == ["convert_report.json"]


def _parquet(out, *args):
    """Convert ``args`` (INPUT and options) to Parquet in ``out``, ids mapped into SIZES."""
    convert([*args, "--out", str(out), "--format", "parquet", "--num-embeddings", str(SIZES[0]), "--workers", "1"])
    return out


def _columns(path):
    """A converted file's (dense, ids, labels) as the sources' batches hold them."""
    table = pq.read_table(path)
    dense = np.stack([table[c].to_numpy() for c in DENSE_COLUMNS], axis=1)
    ids = np.stack([table[c].to_numpy() for c in SPARSE_COLUMNS], axis=1)
    return dense, ids, table["label"].to_numpy()


@pytest.mark.unit
def test_parquet_columns_are_the_tsv_readers_rows(tmp_path):
    path = write(tmp_path / "day_0.tsv", _rows_with_bad(300, seed=1))
    _parquet(tmp_path / "pq", path, "--row-group-size", "100")
    meta = pq.ParquetFile(tmp_path / "pq" / "day_0.parquet").metadata
    assert pq.read_schema(tmp_path / "pq" / "day_0.parquet").equals(PARQUET_SCHEMA)
    assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == [100, 100, 96]
    dense, ids, labels = _columns(tmp_path / "pq" / "day_0.parquet")
    assert (dense.dtype, ids.dtype, labels.dtype) == (np.float32, np.int64, np.int8)
    (batch,) = [b.batch for b in loader.batches(reader(path, batch=296), "eval", 0, 1)]
    assert torch.equal(torch.from_numpy(dense), batch.dense_features)
    assert torch.equal(torch.from_numpy(labels.astype(np.float32)), batch.labels)
    for f in range(26):  # table rows, mapped as data=criteo maps them
        assert np.array_equal(ids[:, f], batch.sparse_features[f"cat_{f}"].values().numpy())
    report = json.load(open(tmp_path / "pq" / "convert_report.json"))
    assert report["rows"] == 296 and report["bad_rows"] == 4
    assert report["files"][path]["errors"][0] == f"{path}:4: 2 fields, expected 40"
    # the data config beside the files: every column, read as it is, the tables data=criteo builds
    data = OmegaConf.load(config_path(str(tmp_path / "pq"), "criteo_parquet"))
    assert list(data.defaults) == ["/schema/data/parquet@_here_", "_self_"]
    assert OmegaConf.to_container(data.label) == {"column": "label", "threshold": None}
    assert [OmegaConf.to_container(d) for d in data.dense] == [
        {"column": c, "transform": "none"} for c in DENSE_COLUMNS
    ]
    assert [OmegaConf.to_container(d) for d in data.sparse] == [
        {"name": f"cat_{f}", "column": c, "num_embeddings": SIZES[f], "id_mapping": "none"}
        for f, c in enumerate(SPARSE_COLUMNS)
    ]
    assert not glob.glob(str(tmp_path / "pq" / "*.partial"))


@pytest.mark.unit
def test_npy_days_convert_to_the_parquet_of_their_tsv(tmp_path, capsys):
    os.makedirs(tmp_path / "tsv")
    for day in range(2):
        write(tmp_path / "tsv" / f"day_{day}.tsv", _rows_with_bad(200, seed=day))
    convert([str(tmp_path / "tsv"), "--out", str(tmp_path / "npy"), "--workers", "1"])
    _parquet(tmp_path / "a", str(tmp_path / "tsv"), "--row-group-size", "64")
    _parquet(tmp_path / "b", str(tmp_path / "npy"), "--row-group-size", "64")
    _parquet(tmp_path / "c", str(tmp_path / "npy" / "day_*_dense.npy"), "--row-group-size", "64")
    files = lambda d: {p.name: p.read_bytes() for p in sorted((tmp_path / d).glob("*.parquet"))}
    assert list(files("a")) == ["day_0.parquet", "day_1.parquet"]
    assert files("a") == files("b") == files("c")
    # rows of a day that data=criteo_binary would refuse: skipped and counted, or (fail) the end
    labels = np.load(tmp_path / "npy" / "day_0_labels.npy")
    dense = np.load(tmp_path / "npy" / "day_0_dense.npy")
    labels[5], dense[7, 2] = 2, np.nan
    np.save(tmp_path / "npy" / "day_0_labels.npy", labels)
    np.save(tmp_path / "npy" / "day_0_dense.npy", dense)
    _parquet(tmp_path / "d", str(tmp_path / "npy" / "day_0_dense.npy"))
    day = str(tmp_path / "npy" / "day_0_dense.npy")
    report = json.load(open(tmp_path / "d" / "convert_report.json"))["files"][day]
    assert report["bad_rows"] == 2 and report["rows"] == len(labels) - 2
    assert report["errors"] == [
        f"{day}:5: labels: label 2 is not 0 or 1",
        f"{day}:7: dense: dense value nan is not finite",
    ]
    dense_a, ids_a, labels_a = _columns(tmp_path / "a" / "day_0.parquet")
    keep = np.ones(len(labels), bool)
    keep[[5, 7]] = False
    dense_d, ids_d, labels_d = _columns(tmp_path / "d" / "day_0.parquet")
    assert np.array_equal(dense_d, dense_a[keep]) and np.array_equal(ids_d, ids_a[keep])
    err = _refused(capsys, [day, "--out", str(tmp_path / "e"), "--format", "parquet", "--bad-rows", "fail"], code=1)
    assert "day_0_labels.npy row 5: label 2 is not 0 or 1" in err
    assert not glob.glob(str(tmp_path / "e" / "*.parquet*"))


@pytest.mark.unit
def test_parquet_refusals_are_one_line_with_exit_code_2(tmp_path, capsys):
    os.makedirs(tmp_path / "tsv")
    path = write(tmp_path / "tsv" / "day_0.tsv", rand_rows(20))
    convert([path, "--out", str(tmp_path / "npy")])
    npy = str(tmp_path / "npy")
    assert "is the .npy layout already: --format parquet" in _refused(capsys, [npy, "--out", str(tmp_path / "x")])
    assert "--num-embeddings applies to --format parquet" in _refused(
        capsys, [path, "--out", str(tmp_path / "x"), "--num-embeddings", "10"]
    )
    with pytest.raises(SystemExit) as e:  # argparse's usage error
        convert([path, "--out", str(tmp_path / "x"), "--num-embeddings", "a,b"])
    assert e.value.code == 2 and "a,b: not integers separated by commas" in capsys.readouterr().err
    out = str(_parquet(tmp_path / "pq", path))
    assert "day_0.parquet exists: pass --overwrite" in _refused(
        capsys, [path, "--out", out, "--format", "parquet", "--num-embeddings", str(SIZES[0])]
    )
    # converting more days into the directory: the same tables, or a refusal (the files would disagree)
    other = write(tmp_path / "day_1.tsv", rand_rows(20, seed=1))
    assert "describes other columns (table sizes or id mapping)" in _refused(
        capsys, [other, "--out", out, "--format", "parquet", "--num-embeddings", "7"]
    )
    _parquet(out, other)
    assert sorted(os.listdir(out)) == ["conf", "convert_report.json", "day_0.parquet", "day_1.parquet"]
    open(tmp_path / "npy" / "notes.txt", "w").write("x")
    assert "convert TSV and .npy days separately" in _refused(
        capsys, [str(tmp_path / "npy" / "*"), "--out", str(tmp_path / "y"), "--format", "parquet"]
    )


def _parquet_cfg(out, **paths):
    """The data config `--config-dir <out>/conf data=criteo_parquet` gives training."""
    return compose_cfg(
        [
            f"hydra.searchpath=[file://{out / 'conf'}]",
            "data=criteo_parquet",
            *(f"data.{k}={v}" for k, v in paths.items()),
        ]
    ).data


def _assert_same_batches(a, b):
    assert torch.equal(a.dense_features, b.dense_features) and torch.equal(a.labels, b.labels)
    assert a.sparse_features.keys() == b.sparse_features.keys()
    for key in a.sparse_features.keys():
        assert torch.equal(a.sparse_features[key].values(), b.sparse_features[key].values()), key
        assert torch.equal(a.sparse_features[key].lengths(), b.sparse_features[key].lengths()), key


@pytest.mark.unit
def test_the_parquet_source_reads_the_batches_of_the_tsv_and_binary_sources(tmp_path):
    os.makedirs(tmp_path / "tsv")
    train = write(tmp_path / "tsv" / "train.tsv", _rows_with_bad(200, seed=6))
    test = write(tmp_path / "tsv" / "test.tsv", rand_rows(70, seed=7))
    convert([str(tmp_path / "tsv"), "--out", str(tmp_path / "npy"), "--workers", "1"])
    _parquet(tmp_path / "pq", str(tmp_path / "tsv"), "--row-group-size", "50")
    tsv = reader(test, batch=16, train_path=train, shards=1)
    binary = CriteoBinary(
        16,
        str(tmp_path / "npy" / "train_dense.npy"),
        str(tmp_path / "npy" / "test_dense.npy"),
        SIZES,
        "modulo",
        None,
        0,
    )
    parquet = build_source(
        _parquet_cfg(
            tmp_path / "pq",
            train_path=tmp_path / "pq" / "train.parquet",
            eval_path=tmp_path / "pq" / "test.parquet",
            batch_size=16,
        ),
        seed=0,
    )
    assert parquet.keys == tsv.keys and parquet.num_dense_features == 13
    for split, n in (("train", 12), ("eval", 5)):  # train: every whole batch of the 196 rows; eval: 70 rows, padded
        kw = dict(num_batches=n) if split == "train" else {}
        got = {
            name: list(loader.batches(source, split, 0, 1, **kw))
            for name, source in (("tsv", tsv), ("binary", binary), ("parquet", parquet))
        }
        assert len(got["parquet"]) == n
        for name in ("tsv", "binary"):
            for a, b in zip(got[name], got["parquet"], strict=True):
                if split == "eval":
                    assert torch.equal(a.real, b.real) and torch.equal(a.rows, b.rows)
                    a, b = a.batch, b.batch
                _assert_same_batches(a, b)


@pytest.mark.slow
def test_training_on_the_converted_files_equals_training_on_the_tsv(tmp_path):
    """The three training commands are forked from the preloaded command server: what is
    compared is what they train, not their start-up."""
    os.makedirs(tmp_path / "tsv")
    train = write(tmp_path / "tsv" / "train.tsv", _rows_with_bad(100, seed=4))
    test = write(tmp_path / "tsv" / "test.tsv", rand_rows(40, seed=5))
    # in this process: the worker pool has its own test above
    convert([str(tmp_path / "tsv"), "--out", str(tmp_path / "npy"), "--workers", "1"])
    convert(
        [
            str(tmp_path / "npy"),
            "--out",
            str(tmp_path / "pq"),
            "--format",
            "parquet",
            "--num-embeddings",
            "50",
            "--workers",
            "1",
        ]
    )
    sizes = f"data.num_embeddings_per_feature=[{','.join(['50'] * 26)}]"
    common = ["data.batch_size=16", "train.steps=4", "train.log_every=1"]
    runs = {
        "tsv": ["data=criteo", "data.shards=1", sizes, f"data.train_path={train}", f"data.eval_path={test}"],
        "npy": [
            "data=criteo_binary",
            sizes,
            f"data.train_path={tmp_path / 'npy' / 'train_dense.npy'}",
            f"data.eval_path={tmp_path / 'npy' / 'test_dense.npy'}",
        ],
        # TSV -> .npy -> Parquet, read through the data config the conversion wrote
        "parquet": [
            "--config-dir",
            str(tmp_path / "pq" / "conf"),
            "data=criteo_parquet",
            f"data.train_path={tmp_path / 'pq' / 'train.parquet'}",
            f"data.eval_path={tmp_path / 'pq' / 'test.parquet'}",
        ],
    }
    # the runs side by side: this test's time is about one run's
    procs = {
        name: commands.start("hybridrec.train", *args, *common, f"hydra.run.dir={tmp_path / name}")
        for name, args in runs.items()
    }
    for name, proc in procs.items():
        done = proc.wait(timeout=180)
        assert done.returncode == 0, f"{name}: {done.stderr[-3000:]}"
    losses = {
        name: [r["loss"] for r in map(json.loads, open(tmp_path / name / "metrics.jsonl")) if "loss" in r]
        for name in runs
    }
    assert len(losses["tsv"]) == 4 and losses["tsv"] == losses["npy"] == losses["parquet"]
    summary = {name: json.load(open(tmp_path / name / "summary.json")) for name in runs}
    assert summary["tsv"]["eval"] == summary["npy"]["eval"] == summary["parquet"]["eval"]
