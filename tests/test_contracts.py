"""The contracts of models, losses and data sources: every shipped class implements its
base, and validation reads their declarations (not class names) to refuse misfits."""

import glob
import os

import pytest
import torch
from conftest import CONF_DIR, compose_cfg
from hydra.utils import get_class

from hybridrec.config import validate
from hybridrec.data import RecBatch, loader
from hybridrec.data.source import Source, UserItemSource
from hybridrec.losses import Loss
from hybridrec.models import Ranker

pytestmark = pytest.mark.unit

BASES = {"model": Ranker, "loss": Loss, "data": Source}


@pytest.mark.parametrize("group", sorted(BASES))
def test_every_shipped_option_implements_its_contract(group):
    options = [os.path.basename(f)[:-5] for f in glob.glob(os.path.join(CONF_DIR, group, "*.yaml"))]
    assert options
    for option in options:
        target = compose_cfg([f"{group}={option}"])[group]._target_
        assert issubclass(get_class(target), BASES[group]), f"{group}={option}: {target}"


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["+experiment=ctr", "loss=pairwise"], r"loss=Pairwise ranks lists: it needs a list source"),
        (["+experiment=ctr", "loss=mse"], r"loss=MSE needs graded relevance"),
        (["+experiment=movielens", "loss=sampled_softmax"], r"scores users against in-batch items: .*\(model=two_tower\)"),
        (["model=two_tower", "loss=pointwise"], r"model=TwoTower needs user and item features: .*movielens_retrieval"),
    ],
)
def test_misfits_are_refused_from_the_declarations(overrides, message):
    with pytest.raises(ValueError, match=message):
        validate(compose_cfg(overrides), 1)


def test_declarations_of_the_shipped_classes():
    from hybridrec.data.movielens import MovieLens, MovieLensRank
    from hybridrec.data.synthetic import SyntheticClickLog as Synthetic
    from hybridrec.losses import BCE, MSE, InBatchSoftmax, Pairwise
    from hybridrec.models.dlrm import DLRMRanker
    from hybridrec.models.two_tower import TwoTower

    assert BCE.calibrated and not any(c.calibrated for c in (MSE, Pairwise, InBatchSoftmax))
    assert Pairwise.needs_lists and Pairwise.needs_relevance and MSE.needs_relevance and not BCE.needs_relevance
    assert InBatchSoftmax.in_batch_negatives and TwoTower.in_batch_negatives and not DLRMRanker.in_batch_negatives
    assert MovieLensRank.lists and not MovieLens.lists and not Synthetic.lists
    assert MovieLens.user_item_features and not Synthetic.user_item_features
    assert Synthetic.ranking_k is None


def _options(group):
    return sorted(os.path.basename(f)[:-5] for f in glob.glob(os.path.join(CONF_DIR, group, "*.yaml")))


def test_user_and_item_sources_are_exactly_the_user_item_sources():
    for option in _options("data"):
        cls = get_class(compose_cfg([f"data={option}"]).data._target_)
        assert cls.user_item_features == issubclass(cls, UserItemSource), option
    assert not Source.per_rank_report and get_class("hybridrec.data.criteo.CriteoTSV").per_rank_report


def test_every_source_yields_recbatch_and_a_click_log_carries_no_ranking_tensor():
    from hybridrec.data.synthetic import SyntheticClickLog

    data = SyntheticClickLog(batch_size=8, num_dense_features=2, num_embeddings_per_feature=[10, 20], ids_per_feature=1,
                             multi_hot_sizes=[], zipf_exponent=1.05, eval_batches=1, seed=0)
    train, scored = next(loader.batches(data, "train", 0, 1, 1)), next(loader.batches(data, "eval", 0, 1)).batch
    for batch in (train, scored, train.to(torch.device("cpu"))):
        assert type(batch) is RecBatch
        assert (batch.relevance, batch.weights, batch.query, batch.log_q) == (None, None, None, None)
