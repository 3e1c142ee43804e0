"""Numbers as embeddings (``data.dense[i].encoding``): the knots fitted on the train split,
each encoding's ids and weights, the feature log's columns read as tables of their own (bad
numbers counted as bad rows, knots carried by the config), the config's refusals, and 2
ranks training as 1 process."""

import re
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from conftest import compose_cfg
from dist_helpers import spawn, train_and_gather
from hybridrec.data import loader, numeric
from hybridrec.data.example import generate
from hybridrec.data.parquet import ParquetSource
from shared import TOL, assert_same_training


# --------------------------------------------------------------------------- the encodings
@pytest.mark.unit
def test_knots_are_equal_count_quantiles_with_ties_merged():
    assert numeric.fit_knots(np.arange(101, dtype=np.float64), 4) == [0.0, 25.0, 50.0, 75.0, 100.0]
    mostly_zero = np.concatenate([np.zeros(90), np.arange(1, 11)])  # 90% zeros: the first buckets merge
    assert numeric.fit_knots(mostly_zero, 4) == [0.0, 10.0]
    assert numeric.fit_knots(np.array([3.0, 3.0, np.nan, np.inf]), 8) == []  # one finite value: nothing to cut
    assert numeric.fit_knots(np.array([np.nan]), 8) == []


@pytest.mark.unit
def test_a_bucket_is_the_interval_between_inner_knots():
    knots = [0.0, 1.0, 5.0, 10.0]  # 3 buckets
    x = np.array([-3.0, 0.0, 0.999, 1.0, 4.0, 5.0, 9.99, 10.0, 1e9])
    ids, lengths, weights = numeric.encode(x, "bucketized", knots)
    assert ids.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2] and lengths.tolist() == [1] * 9 and weights is None
    assert numeric.rows_of("bucketized", knots) == 3 and numeric.rows_of("piecewise_linear", knots) == 4


@pytest.mark.unit
def test_piecewise_linear_interpolates_between_the_knots_vectors():
    """With each knot's vector its own value, the pooled vector is the number itself inside
    the knots and the nearest knot outside them: the weights are linear interpolation."""
    knots = [-2.0, 0.0, 0.5, 4.0]
    x = np.array([-5.0, -2.0, -1.0, 0.0, 0.25, 0.5, 3.0, 4.0, 7.0])
    ids, lengths, weights = numeric.encode(x, "piecewise_linear", knots)
    assert lengths.tolist() == [2] * len(x) and ids.max() == 3 and ids.min() == 0
    pooled = (np.asarray(knots)[ids] * weights).reshape(-1, 2).sum(1)
    np.testing.assert_allclose(pooled, np.clip(x, -2.0, 4.0), rtol=1e-6)
    assert (weights >= 0).all() and np.allclose(weights.reshape(-1, 2).sum(1), 1.0)
    with warnings.catch_warnings():  # the far ends of float64 take the end knots, quietly
        warnings.simplefilter("error")
        ids, _, weights = numeric.encode(np.array([-1.7e308, 1.7e308]), "piecewise_linear", [-1e300, 0.0, 1e300])
    assert ids.tolist() == [0, 1, 1, 2] and weights.tolist() == [1.0, 0.0, 0.0, 1.0]


@pytest.mark.unit
@pytest.mark.parametrize(
    "knots,why",
    [([1.0], "at least 2"), ([1.0, float("nan")], "finite"), ([0.0, 2.0, 1.0], "strictly increasing"), ("x", "list")],
)
def test_knots_that_cannot_cut_a_line_are_named(knots, why):
    assert why in numeric.check_knots(knots)


# ------------------------------------------------------------------------- the Parquet source
def _table(first, n):
    r = np.arange(first, first + n)
    return pa.table(
        {
            "click": pa.array((r % 3 == 0).astype(np.int8)),
            "age": pa.array((r % 50) + 18.0),
            "amount": pa.array(np.exp((r % 17) / 4.0)),
            "item": pa.array(r % 7, pa.int64()),
        }
    )


DENSE = [
    {"column": "age", "transform": "standardize"},  # a scalar: standardized, mean and std fitted
    {"column": "age", "encoding": "bucketized", "buckets": 5},  # the same number as ids too
    {"column": "amount", "encoding": "piecewise_linear", "buckets": 4},
]


def _source(tmp_path, dense, **kw):
    return ParquetSource(
        batch_size=20,
        train_path=str(tmp_path / "train.parquet"),
        eval_path=str(tmp_path / "eval.parquet"),
        label={"column": "click"},
        dense=dense,
        sparse=[{"name": "item", "column": "item", "num_embeddings": 7}],
        seed=0,
        **kw,
    )


@pytest.mark.unit
def test_encoded_columns_are_features_with_tables_of_their_own(tmp_path):
    train = _table(0, 100)
    pq.write_table(train, tmp_path / "train.parquet", row_group_size=30)  # the fit reads several row groups
    pq.write_table(_table(1000, 20), tmp_path / "eval.parquet")
    data = _source(tmp_path, DENSE)
    assert data.num_dense_features == 1 and data.keys == ["item", "num_age", "num_amount"]
    fitted = data.fitted()["dense"]
    age_knots = numeric.fit_knots(train["age"].to_numpy(), 5)
    amount_knots = numeric.fit_knots(train["amount"].to_numpy(), 4)
    assert fitted[1]["knots"] == age_knots and fitted[2]["knots"] == amount_knots
    assert fitted[1]["name"] == "num_age" and fitted[2]["encoding"] == "piecewise_linear"
    features = {f.name: f for f in data.features}
    assert features["num_age"].num_embeddings == len(age_knots) - 1 and not features["num_age"].weighted
    assert features["num_amount"].num_embeddings == len(amount_knots) and features["num_amount"].weighted
    batch = next(loader.batches(data, "eval", 0, 1)).batch
    rows = _table(1000, 20)
    kjt = batch.sparse_features
    ids, _, _ = numeric.encode(rows["age"].to_numpy(), "bucketized", age_knots)
    assert kjt["num_age"].values().tolist() == ids.tolist()
    ids, lengths, weights = numeric.encode(rows["amount"].to_numpy(), "piecewise_linear", amount_knots)
    assert kjt["num_amount"].values().tolist() == ids.tolist()
    assert kjt["num_amount"].weights().tolist() == weights.tolist() and kjt["item"].weights().tolist() == [1.0] * 20
    age = rows["age"].to_numpy()
    np.testing.assert_allclose(batch.dense_features[:, 0].numpy(), (age - fitted[0]["mean"]) / fitted[0]["std"], 1e-5)
    # the knots merged into the config: nothing is fitted again, the same batch
    again = _source(tmp_path, fitted)
    assert again.fitted() == {}
    same = next(loader.batches(again, "eval", 0, 1)).batch.sparse_features
    assert same["num_amount"].weights().tolist() == weights.tolist()
    # the global default: every entry without its own encoding; the fitted entries keep
    # theirs when they replace the config's (the scalar one stays a scalar)
    dense = [{"column": "amount", "encoding": "scalar"}, {"column": "amount"}]
    default = _source(tmp_path, dense, numeric_encoding="bucketized", numeric_buckets=3)
    fitted = default.fitted()["dense"]
    assert default.num_dense_features == 1 and fitted[1]["knots"] == numeric.fit_knots(train["amount"].to_numpy(), 3)
    assert fitted[0]["encoding"] == "scalar" and fitted[1]["encoding"] == "bucketized"
    again = _source(tmp_path, fitted, numeric_encoding="bucketized", numeric_buckets=3)
    assert again.keys == default.keys and again.num_dense_features == 1


@pytest.mark.unit
def test_a_bad_number_costs_its_row_only(tmp_path):
    rows = _table(0, 40).to_pydict()
    rows["amount"][3], rows["amount"][7] = None, float("inf")
    table = pa.table(rows, schema=_table(0, 1).schema)
    pq.write_table(table, tmp_path / "train.parquet")
    pq.write_table(table, tmp_path / "eval.parquet")
    data = _source(tmp_path, DENSE)
    data.begin_pass("eval", 0)
    got = data.read("eval", 0, 0, 0, 20)
    assert got.real is not None and np.flatnonzero(~got.real.numpy()).tolist() == [3, 7]
    errors = [e for f in got.report.to_dict()["files"].values() for e in f["errors"]]
    assert any(":3: amount is null" in e for e in errors) and any(":7: amount inf is not finite" in e for e in errors)


@pytest.mark.unit
def test_a_constant_column_cannot_be_encoded(tmp_path):
    rows = _table(0, 40).to_pydict()
    rows["age"] = [30.0] * 40
    pq.write_table(pa.table(rows), tmp_path / "train.parquet")
    pq.write_table(pa.table(rows), tmp_path / "eval.parquet")
    with pytest.raises(Exception, match=r"data.dense\[0\] \(age\): one value only in the train split"):
        _source(tmp_path, [{"column": "age", "encoding": "bucketized"}])


GOOD = {"label": {"column": "click"}, "sparse": [{"name": "a", "column": "a", "num_embeddings": 10}], "dense": []}


@pytest.mark.unit
@pytest.mark.parametrize(
    "change,message",
    [
        ({"numeric_buckets": 1}, "data.numeric_buckets must be in [2, 65536] (one bucket says nothing"),
        ({"dense": [{"column": "x", "encoding": "bucketized", "buckets": 1}]}, "data.dense[0].buckets must be in [2, "),
        ({"dense": [{"column": "x", "encoding": "bucketized", "buckets": 10**9}]}, "got 1000000000"),
        (
            {"dense": [{"column": "x", "encoding": "bucketized", "knots": [0.0, 2.0, 1.0]}]},
            "data.dense[0].knots=[0.0, 2.0, 1.0]: the bucket edges are strictly increasing numbers",
        ),
        (
            {"dense": [{"column": "x", "encoding": "piecewise_linear", "name": "a"}]},
            "data.dense[0].name='a' (encoding=piecewise_linear) is used twice",
        ),
        (
            {"dense": [{"column": "x", "encoding": "bucketized"}, {"column": "x", "encoding": "bucketized"}]},
            "data.dense[1].column='x' is listed twice in data.dense (encoding=bucketized)",
        ),
        (
            {
                "dense": [{"column": "x"}],
                "numeric_encoding": "bucketized",
                "sparse": [{**GOOD["sparse"][0], "name": "num_x"}],
            },
            "data.dense[0].name='num_x' (encoding=bucketized) is used twice",
        ),
        (
            {"dense": [{"column": "x", "encoding": "bucketized", "name": "a.b"}]},
            "data.dense[0].name='a.b' (encoding=bucketized) cannot name a table",
        ),
    ],
)
def test_config_checks_refuse_in_one_line(change, message):
    with pytest.raises(ValueError, match=re.escape(message)) as e:
        ParquetSource.check_config(OmegaConf.create({**GOOD, **change}), 1)
    assert "\n" not in str(e.value)


@pytest.mark.unit
def test_an_encoded_number_may_be_the_only_feature_and_a_scalar_too():
    both = {"dense": [{"column": "x"}, {"column": "x", "encoding": "bucketized"}], "sparse": []}
    ParquetSource.check_config(OmegaConf.create({**GOOD, **both}), 1)


@pytest.mark.unit
def test_a_bad_encoding_is_refused_by_the_schema():
    with pytest.raises(Exception, match="numeric_encoding"):
        compose_cfg(["+experiment=feature_log", "data.numeric_encoding=splines"])


# ------------------------------------------------------------------------- 2 ranks = 1 process
@pytest.mark.dist
def test_two_ranks_train_encoded_numbers_as_one_process(tmp_path):
    """The feature log with price bucketized and tenure_days piecewise-linear (weighted ids
    through the input all-to-all of a row-wise table), the same global batches on 1 and 2
    ranks: the same losses and weights."""
    generate(str(tmp_path / "log"), rows=2000, seed=3)
    cfg = compose_cfg(
        [
            "+experiment=feature_log",
            *(f"data.{s}_path={tmp_path / 'log' / s}" for s in ("train", "valid", "eval")),
            # the item table's vocabulary is not needed for the numbers: the items hash
            "data.sparse.1.id_mapping=hash",
            "data.sparse.1.vocabulary=null",
            "data.sparse.2.id_mapping=hash",
            "data.sparse.2.vocabulary=null",
            "data.dense.0.encoding=bucketized",
            "data.dense.1.encoding=piecewise_linear",
            "data.dense.1.buckets=8",
            "data.batch_size=128",
            "model.embedding_dim=8",
            "model.dense_arch_layer_sizes=[16,8]",
            "model.over_arch_layer_sizes=[16,1]",
            "optimizer=sgd",
            "sharding=row_wise",
            "train.steps=6",
            "train.eval_every=0",
            "train.early_stop_patience=0",
            "launcher.device=cpu",
        ]
    )
    one = spawn(train_and_gather, 1, [cfg], str(tmp_path / "one"))[0]
    two = spawn(train_and_gather, 2, [cfg], str(tmp_path / "two"))[0]
    assert {"t_num_price", "t_num_tenure_days"} <= set(two["summary"]["plan"])
    assert_same_training(two, one, TOL)


# ------------------------------------------------------------------------- the census table
@pytest.mark.unit
def test_the_census_table_is_cut_once_into_three_splits_with_vocabularies(tmp_path):
    """``make data-adult``'s writer on a table shaped like the wheel's: the same files from
    the same rows, 70 / 15 / 15, every row once, the label 1 for >50K, the vocabularies over
    the training rows; the shipped experiment composes and validates over them."""
    from hybridrec.data import fetch_adult
    from hybridrec.run.validation import validate

    n = 200
    rng = np.random.default_rng(1)
    raw = {c.replace("_", "-"): rng.integers(0, 100, n) for c in fetch_adult.NUMERIC}
    raw |= {c.replace("_", "-"): [f"{c}{i % 5}" for i in rng.integers(0, 50, n)] for c in fetch_adult.CATEGORICAL}
    raw["income"] = rng.choice(["<=50K", ">50K"], n).tolist()
    table = fetch_adult.log_of(pa.table(raw))
    assert table.column(fetch_adult.LABEL).to_pylist() == [int(v == ">50K") for v in raw["income"]]
    counts = fetch_adult.write(table, str(tmp_path / "a"))
    (tmp_path / "b" / "train").mkdir(parents=True)
    (tmp_path / "b" / "train" / "part-00000.parquet").symlink_to(tmp_path / "planted")  # replaced, not followed
    fetch_adult.write(table, str(tmp_path / "b"))
    assert not (tmp_path / "planted").exists()
    assert counts == {"train": 140, "valid": 30, "eval": 30}
    for split in counts:
        name = f"{split}/part-00000.parquet"
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    rows = [tuple(r.values()) for s in counts for r in pq.read_table(tmp_path / "a" / s).to_pylist()]
    assert sorted(rows) == sorted(tuple(r.values()) for r in table.to_pylist())
    train = pq.read_table(tmp_path / "a" / "train")
    for c in fetch_adult.CATEGORICAL:
        assert set(pq.read_table(tmp_path / "a" / "vocab" / f"{c}.parquet")["id"].to_pylist()) == set(
            train[c].to_pylist()
        )
    cfg = compose_cfg(["+experiment=tabular"])
    assert cfg.data.numeric_encoding.value == "bucketized" and cfg.train.objective == "valid.auc"
    assert [d.column for d in cfg.data.dense] == list(fetch_adult.NUMERIC)
    assert [f.column for f in cfg.data.sparse] == list(fetch_adult.CATEGORICAL)
    validate(cfg, 1)
