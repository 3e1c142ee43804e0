"""The example feature log: deterministic from its seed, its files hold the columns the
shipped data config (data=example_log) declares, the Parquet source reads them, and a short
training run of +experiment=feature_log learns its clicks."""

import glob
import json
import os

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

import commands
from conftest import CONF_DIR, compose_cfg
from hybridrec.data import build_source, loader
from hybridrec.data.example import CATEGORY_IDS, ITEMS, MAX_HISTORY, SCHEMA, generate
from hybridrec.data.example import main as example
from hybridrec.run.validation import validate

ROWS = 2000  # training rows; validation and test get 200 each


def _files(out):
    return {os.path.relpath(p, out): open(p, "rb").read() for p in sorted(glob.glob(os.path.join(out, "*", "*")))}


@pytest.fixture(scope="module")
def log(tmp_path_factory):
    out = tmp_path_factory.mktemp("example") / "log"
    generate(str(out), rows=ROWS, seed=3)
    return out


@pytest.mark.unit
def test_the_same_seed_writes_the_same_bytes(log, tmp_path):
    generate(str(tmp_path / "again"), rows=ROWS, seed=3)
    first = _files(log)
    assert list(first) == [f"eval/part-0000{i}.parquet" for i in range(2)] + [
        f"train/part-0000{i}.parquet" for i in range(4)
    ] + [f"valid/part-0000{i}.parquet" for i in range(2)]
    assert _files(tmp_path / "again") == first
    generate(str(tmp_path / "other"), rows=ROWS, seed=4)
    other = _files(tmp_path / "other")
    assert other.keys() == first.keys() and all(other[k] != first[k] for k in first)


@pytest.mark.unit
def test_the_files_hold_the_columns_the_data_config_declares(log):
    tables = {split: pq.read_table(log / split) for split in ("train", "valid", "eval")}
    assert {s: t.num_rows for s, t in tables.items()} == {"train": ROWS, "valid": ROWS // 10, "eval": ROWS // 10}
    assert [pq.ParquetFile(p).metadata.num_rows for p in sorted(glob.glob(str(log / "train" / "*")))] == [500] * 4
    for table in tables.values():
        assert table.schema.equals(SCHEMA)
    # the splits follow each other in time, each in time order
    ts = [tables[s]["ts"].to_numpy() for s in ("train", "valid", "eval")]
    assert all((np.diff(t) >= 0).all() for t in ts) and ts[0][-1] < ts[1][0] and ts[1][-1] < ts[2][0]

    data = OmegaConf.load(os.path.join(CONF_DIR, "data", "example_log.yaml"))
    named = [
        data.label.column,
        data.weight,
        *(d.column for d in data.dense),
        *(s.column for s in data.sparse),
        *(s.weights_column for s in data.sparse if s.get("weights_column")),
    ]
    assert set(named) <= set(SCHEMA.names), set(named) - set(SCHEMA.names)
    sparse = {s.name: s for s in data.sparse}
    train = tables["train"]
    clicks = train[data.label.column].to_numpy()
    assert set(np.unique(clicks)) == {0, 1} and 0.1 < clicks.mean() < 0.4
    weights = train[data.weight].to_numpy()
    assert (weights > 0.3).all() and (weights <= 1).all()
    assert all(u.startswith("u") and len(u) == 7 for u in train["user_id"].to_pylist()[:100])
    assert (train["item_id"].to_numpy() >= 10_000_000).all()
    # the click history: lists of 0..30 ids, some longer than the config keeps (cut, not refused)
    lengths = pc.list_value_length(train[sparse["history"].column]).to_numpy()
    assert lengths.min() == 0 and lengths.max() == MAX_HISTORY
    assert (lengths > sparse["history"].max_length).mean() > 0.05 and sparse["history"].truncate
    # the weighted categories: ids already table rows, a weight per id summing to 1 per row
    cats, cat_w = train[sparse["categories"].column], train[sparse["categories"].weights_column]
    assert pc.list_value_length(cats).equals(pc.list_value_length(cat_w))
    assert 0 <= pc.min(pc.list_flatten(cats)).as_py() and pc.max(pc.list_flatten(cats)).as_py() < CATEGORY_IDS
    assert sparse["categories"].num_embeddings == CATEGORY_IDS and sparse["categories"].id_mapping == "none"
    sums = np.add.reduceat(pc.list_flatten(cat_w).to_numpy(), cats.combine_chunks().offsets.to_numpy()[:-1])
    nonempty = pc.list_value_length(cats).to_numpy() > 0
    assert np.allclose(sums[nonempty], 1, atol=1e-5)
    # the item table has a row for every item and the out-of-vocabulary row
    assert sparse["item"].table == sparse["history"].table and sparse["item"].num_embeddings > ITEMS


@pytest.mark.unit
def test_existing_files_are_refused_in_one_line(log, capsys):
    with pytest.raises(SystemExit) as e:
        example(["--out", str(log), "--rows", str(ROWS), "--seed", "3"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("hybridrec: ") and err.count("\n") == 1, err
    assert "part-00000.parquet exists (and 7 more): pass --overwrite" in err


@pytest.mark.unit
def test_the_experiment_composes_and_validates():
    cfg = compose_cfg(["+experiment=feature_log"])
    assert cfg.data._target_ == "hybridrec.data.parquet.ParquetSource" and cfg.model._target_.endswith("DLRMRanker")
    assert cfg.train.objective == "valid.logloss" and cfg.train.eval_every and cfg.data.valid_path
    validate(cfg, 1)


def _vocabulary(log):
    """The item vocabulary, as `make data-example` builds it (its command, forked from the
    preloaded command server)."""
    out = log / "vocab"
    if not os.path.exists(out / "item_id.parquet"):
        proc = commands.run(
            "hybridrec.data.vocab",
            str(log / "train"),
            "--column",
            "item_id",
            "--min-count",
            "1",
            "--out",
            str(out),
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "item_id.parquet"


def _paths(log):
    vocab = _vocabulary(log)
    return [
        f"data.train_path={log / 'train'}",
        f"data.valid_path={log / 'valid'}",
        f"data.eval_path={log / 'eval'}",
        f"data.sparse.1.vocabulary={vocab}",
        f"data.sparse.2.vocabulary={vocab}",
    ]


@pytest.mark.slow
def test_the_parquet_source_reads_every_row_of_the_log(log):
    cfg = compose_cfg(["+experiment=feature_log", "data.batch_size=256", *_paths(log)])
    source = build_source(cfg.data, seed=0)
    assert source.keys == ["user", "item", "history", "categories"]
    rows = sum(int(b.real.sum()) for b in loader.batches(source, "eval", 0, 1))
    assert rows == ROWS // 10
    batch = next(loader.batches(source, "train", 0, 1, num_batches=1))
    assert batch.dense_features.shape == (256, 3) and batch.labels.shape == (256,)
    history = batch.sparse_features["history"].lengths()
    assert history.max() == 20 and history.min() == 0  # cut to max_length
    assert batch.sparse_features["categories"].weights() is not None


@pytest.mark.slow
def test_a_short_run_learns_the_clicks(tmp_path):
    """The acceptance run of the example: +experiment=feature_log on a tenth of the log, 60
    steps: validation AUC clearly above chance. The commands are forked from the preloaded
    command server (the training itself is about a second)."""
    log = tmp_path / "log"
    generate(str(log), rows=20_000, seed=0)
    run = tmp_path / "run"
    proc = commands.run(
        "hybridrec.train",
        "+experiment=feature_log",
        *_paths(log),
        "data.batch_size=512",
        "train.steps=60",
        "train.eval_every=30",
        "launcher.device=cpu",
        f"hydra.run.dir={run}",
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.load(open(run / "summary.json"))
    assert summary["objective"]["name"] == "valid.logloss"
    evals = [r["eval"] for r in map(json.loads, open(run / "metrics.jsonl")) if r.get("split") == "valid"]
    assert evals and evals[-1]["auc"] > 0.65, evals
