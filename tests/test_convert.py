"""The TSV -> binary converter: the rows and bad-row counts of the TSV reader, byte-stable
output, refusals, and training on its output equal to training on the TSV."""

import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from hybridrec.data import loader
from hybridrec.data.convert import main as convert
from hybridrec.data.criteo import CriteoBinary, map_ids
from shared import SIZES, reader, rand_rows, row, write


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


@pytest.mark.unit
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
    assert "day_0_dense.npy exists (and 2 more output files): pass --overwrite" in _refused(capsys, [path, "--out", out])
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


@pytest.mark.slow
def test_training_on_the_converted_files_equals_training_on_the_tsv(tmp_path):
    os.makedirs(tmp_path / "tsv")
    train = write(tmp_path / "tsv" / "train.tsv", _rows_with_bad(100, seed=4))
    test = write(tmp_path / "tsv" / "test.tsv", rand_rows(40, seed=5))
    convert([str(tmp_path / "tsv"), "--out", str(tmp_path / "npy")])
    common = ["data.batch_size=16", f"data.num_embeddings_per_feature=[{','.join(['50'] * 26)}]",
              "train.steps=4", "train.log_every=1"]
    runs = {
        "tsv": ["data=criteo", "data.shards=1", f"data.train_path={train}", f"data.eval_path={test}"],
        "npy": ["data=criteo_binary", f"data.train_path={tmp_path / 'npy' / 'train_dense.npy'}",
                f"data.eval_path={tmp_path / 'npy' / 'test_dense.npy'}"],
    }
    # the two runs side by side: this test's time is one run's
    procs = {name: subprocess.Popen([sys.executable, "-m", "hybridrec.train", *args, *common,
                                     f"hydra.run.dir={tmp_path / name}"],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, args in runs.items()}
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, f"{name}: {err[-3000:]}"
    losses = {name: [r["loss"] for r in map(json.loads, open(tmp_path / name / "metrics.jsonl")) if "loss" in r]
              for name in runs}
    assert len(losses["tsv"]) == 4 and losses["tsv"] == losses["npy"]
    summary = {name: json.load(open(tmp_path / name / "summary.json")) for name in runs}
    assert summary["tsv"]["eval"] == summary["npy"]["eval"]
