"""The synthetic click log: deterministic, world-size independent, skewed, learnable."""

import os

import numpy as np
import pytest
import torch

from conftest import compose_cfg
from hybridrec.data import build_source, loader
from hybridrec.data.synthetic import SyntheticClickLog
from shared import global_batch

pytestmark = pytest.mark.unit


def _log(**kw):
    args = dict(
        batch_size=512,
        num_dense_features=4,
        num_embeddings_per_feature=[1000, 37],
        ids_per_feature=3,
        multi_hot_sizes=[],
        zipf_exponent=1.05,
        eval_batches=2,
        seed=0,
    )
    args.update(kw)
    return SyntheticClickLog(**args)


def _assert_batches_equal(a, b):
    torch.testing.assert_close(a.dense_features, b.dense_features, rtol=0, atol=0)
    torch.testing.assert_close(a.labels, b.labels, rtol=0, atol=0)
    for key in a.sparse_features.keys():
        ja, jb = a.sparse_features[key], b.sparse_features[key]
        assert torch.equal(ja.values(), jb.values()) and torch.equal(ja.lengths(), jb.lengths())


def test_same_seed_same_batches_other_seed_differs():
    a, b, c = _log(), _log(), _log(seed=1)
    _assert_batches_equal(global_batch(a, "train", 3), global_batch(b, "train", 3))
    assert not torch.equal(global_batch(a, "train", 3).labels, global_batch(c, "train", 3).labels)
    assert not torch.equal(global_batch(a, "train", 0).labels, global_batch(a, "eval", 0).labels)


@pytest.mark.parametrize("world_size", [2, 4])
def test_rank_slices_reassemble_the_global_batch(world_size):
    data = _log()
    parts = [next(loader.batches(data, "train", r, world_size, 1)) for r in range(world_size)]
    whole = global_batch(data, "train", 0)
    torch.testing.assert_close(torch.cat([p.labels for p in parts]), whole.labels)
    torch.testing.assert_close(torch.cat([p.dense_features for p in parts]), whole.dense_features)
    for key in whole.sparse_features.keys():
        rows = torch.cat([p.sparse_features[key].values().view(-1, 3) for p in parts])
        assert torch.equal(rows, whole.sparse_features[key].values().view(-1, 3))


def test_ids_are_in_range_and_zipf_skewed():
    data = _log(batch_size=20000)
    kjt = global_batch(data, "train", 0).sparse_features
    ids = kjt["cat_0"].values().numpy()
    assert ids.min() >= 0 and ids.max() < 1000
    counts = np.sort(np.bincount(ids, minlength=1000))[::-1]
    # heavy head: the hottest 1% of rows get far more than 1% of lookups (uniform would be 1%)
    assert counts[:10].sum() / counts.sum() > 0.15
    assert kjt["cat_1"].values().max() < 37
    assert torch.all(kjt.lengths() == 3)


def test_labels_follow_the_planted_model():
    data = _log(batch_size=20000)
    batch = global_batch(data, "train", 0)
    rate = batch.labels.mean().item()
    assert 0.1 < rate < 0.6
    # the planted logit is recoverable: a feature computed from the truth separates labels
    dense_score = torch.from_numpy(batch.dense_features.double().numpy() @ data._dense_w)
    pos, neg = dense_score[batch.labels == 1].mean(), dense_score[batch.labels == 0].mean()
    assert pos > neg + 0.1


def test_eval_split_has_configured_length():
    data = build_source(compose_cfg(["data.eval_batches=3"]).data, 0)
    assert len(list(loader.batches(data, "eval", 0, 2))) == 3


@pytest.mark.parametrize("dist", ["normal", "lognormal", "uniform"])
def test_dense_distribution_is_configurable_and_learnable(dist):
    data = _log(batch_size=20000, dense_distribution=dist)
    dense = global_batch(data, "train", 0).dense_features
    if dist == "uniform":
        assert dense.min() >= 0 and dense.max() < 1
    elif dist == "lognormal":
        assert dense.min() >= 0 and dense.mean() > 0.5  # log(1 + x) of positive counts
    else:
        assert abs(dense.mean()) < 0.05 and abs(dense.std() - 1) < 0.05
    assert 0.1 < global_batch(data, "train", 0).labels.mean() < 0.6


@pytest.mark.unit
def test_a_shipped_dataset_not_yet_written_is_named_with_its_make_target(tmp_path, monkeypatch):
    from hybridrec.data import DataError
    from hybridrec.data.criteo import resolve_paths
    from hybridrec.data.parquet.partitions import list_partitions
    from hybridrec.data.parquet.vocabulary import Vocabulary

    monkeypatch.chdir(tmp_path)  # a fresh clone: no data/ yet
    with pytest.raises(
        DataError,
        match=r"data.train_path=data/example/train: no such file, .* \(run `make "
        r"data-example` first: it writes data/example/\)$",
    ):
        resolve_paths("data/example/train", "data.train_path")
    with pytest.raises(
        DataError,
        match=r"not a directory of partitions \(data.partitions is set\) \(run `make "
        r"data-example` first: it writes data/example_days/\)$",
    ):
        list_partitions("data/example_days/train", "day=%Y-%m-%d")
    with pytest.raises(DataError, match=r"\(run `make data-example` first: it writes data/example/\)$"):
        Vocabulary("data/example/vocab/item_id.parquet", "data.sparse[1].vocabulary")
    # a path of the user's own, or a shipped folder that exists, gets no hint
    with pytest.raises(DataError, match=r"glob$"):
        resolve_paths("mine/train", "data.train_path")
    os.makedirs("data/example")
    with pytest.raises(DataError, match=r"glob$"):
        resolve_paths("data/example/train", "data.train_path")
