"""The contracts of models, losses and data sources: every shipped class implements its
base, and validation reads their declarations (not class names) to refuse misfits."""

import glob
import os
import re

import pytest
import torch
from hydra.utils import get_class
from omegaconf import OmegaConf

from conftest import CONF_DIR, compose_cfg
from hybridrec.data import RecBatch, loader
from hybridrec.data.source import Source, UserItemSource
from hybridrec.models import Ranker
from hybridrec.models.losses import Loss
from hybridrec.run.validation import validate

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
        (
            ["+experiment=movielens", "loss=sampled_softmax"],
            r"scores users against in-batch items: .*\(model=two_tower\)",
        ),
        (["model=two_tower", "loss=pointwise"], r"model=TwoTower needs user and item features: .*movielens_retrieval"),
    ],
)
def test_misfits_are_refused_from_the_declarations(overrides, message):
    with pytest.raises(ValueError, match=message):
        validate(compose_cfg(overrides), 1)


def test_declarations_of_the_shipped_classes():
    from hybridrec.data.movielens import MovieLens, MovieLensRank
    from hybridrec.data.synthetic import SyntheticClickLog as Synthetic
    from hybridrec.models.dlrm import DLRMRanker
    from hybridrec.models.losses import BCE, MSE, InBatchSoftmax, Pairwise
    from hybridrec.models.two_tower import TwoTower

    assert BCE.calibrated and not any(c.calibrated for c in (MSE, Pairwise, InBatchSoftmax))
    assert Pairwise.needs_lists and Pairwise.needs_relevance and MSE.needs_relevance and not BCE.needs_relevance
    assert InBatchSoftmax.in_batch_negatives and TwoTower.in_batch_negatives and not DLRMRanker.in_batch_negatives
    assert MovieLensRank.lists and not MovieLens.lists and not Synthetic.lists
    assert MovieLens.user_item_features and not Synthetic.user_item_features
    assert Synthetic.ranking_k is None


def _options(group):
    return sorted(os.path.basename(f)[:-5] for f in glob.glob(os.path.join(CONF_DIR, group, "*.yaml")))


@pytest.mark.parametrize("group", ["model", "data"])
def test_the_shipped_configs_pass_their_class_checks(group):
    for option in _options(group):
        cfg = compose_cfg([f"{group}={option}"])
        cls = get_class(cfg[group]._target_)
        cls.check_config(cfg.model) if group == "model" else cls.check_config(cfg.data, 1)


DLRM = {"embedding_dim": 8, "dense_arch_layer_sizes": [16, 8], "over_arch_layer_sizes": [16, 1]}


@pytest.mark.parametrize(
    "target,model,message",
    [
        (
            "dlrm.DLRMRanker",
            {**DLRM, "dense_arch_layer_sizes": [16, 4]},
            "model.dense_arch_layer_sizes must end with model.embedding_dim=8 (the dense features meet the embeddings), "
            "got [16, 4]",
        ),
        (
            "dlrm.DLRMRanker",
            {**DLRM, "over_arch_layer_sizes": [16, 2]},
            "model.over_arch_layer_sizes must end with 1 (one logit), got [16, 2]",
        ),
        (
            "dcn.DCNRanker",
            {**DLRM, "over_arch_layer_sizes": []},
            "model.over_arch_layer_sizes=[]: an MLP's layer sizes",
        ),
        (
            "dcn.DCNRanker",
            {**DLRM, "dense_arch_layer_sizes": []},
            "model.dense_arch_layer_sizes=[]: an MLP's layer sizes",
        ),
        (
            "dcn.DCNRanker",
            {**DLRM, "dcn_num_layers": 0},
            "model.dcn_num_layers=0: the cross network's layers must be >= 1",
        ),
        (
            "deepfm.DeepFMRanker",
            {"embedding_dim": 8, "dense_arch_layer_sizes": [9], "deep_layer_sizes": [8]},
            "model.dense_arch_layer_sizes must end with model.embedding_dim=8",
        ),
        (
            "deepfm.DeepFMRanker",
            {"embedding_dim": 8, "dense_arch_layer_sizes": [8], "deep_layer_sizes": [8, 0]},
            "model.deep_layer_sizes=[8, 0]: an MLP's layer sizes, each >= 1",
        ),
        (
            "two_tower.TwoTower",
            {"embedding_dim": 8, "tower_layer_sizes": []},
            "model.tower_layer_sizes=[]: an MLP's layer sizes",
        ),
    ],
)
def test_a_model_refuses_its_own_bad_fields(target, model, message):
    cls = get_class(f"hybridrec.models.{target}")
    with pytest.raises(ValueError, match=re.escape(message)):
        cls.check_config(OmegaConf.create(model))


def test_the_base_classes_check_nothing():
    Ranker.check_config(OmegaConf.create({}))
    Source.check_config(OmegaConf.create({}), 3)


SIZES = {"num_embeddings_per_feature": [10] * 26}
RANK = {"batch_size": 80, "list_size": 10, "negatives": 10, "eval_negatives": 50, "ranking_k": 10}


@pytest.mark.parametrize(
    "target,data,world_size,message",
    [
        (
            "criteo.CriteoTSV",
            {**SIZES, "batch_size": 12, "shards": 3},
            2,
            "data.shards=3 must be a multiple of the world size (2) and divide data.batch_size=12: each rank reads whole "
            "shards. Set data.shards to a multiple of 2 (it changes the order of rows), or convert the logs with "
            "`python -m hybridrec.data.convert` and use data=criteo_binary",
        ),
        (
            "criteo.CriteoTSV",
            {**SIZES, "batch_size": 12, "shards": 0},
            1,
            "data.shards=0 must be a multiple of the world size (1)",
        ),
        ("criteo.CriteoTSV", {**SIZES, "batch_size": 12, "shards": 8}, 1, "and divide data.batch_size=12"),
        (
            "criteo.CriteoTSV",
            {"num_embeddings_per_feature": [10, 0], "batch_size": 12, "shards": 2},
            2,
            "data.num_embeddings_per_feature must be non-empty and >= 1: [10, 0]",
        ),
        (
            "criteo.CriteoBinary",
            {"num_embeddings_per_feature": []},
            1,
            "data.num_embeddings_per_feature must be non-empty and >= 1: []",
        ),
        (
            "synthetic.SyntheticClickLog",
            {"num_embeddings_per_feature": [0]},
            1,
            "data.num_embeddings_per_feature must be non-empty and >= 1: [0]",
        ),
        (
            "movielens.MovieLensRank",
            {**RANK, "ranking_k": 0},
            1,
            "data.list_size and data.ranking_k must be >= 1, data.negatives and data.eval_negatives >= 0",
        ),
        (
            "movielens.MovieLensRank",
            {**RANK, "eval_negatives": -1},
            1,
            "data.list_size and data.ranking_k must be >= 1",
        ),
        (
            "movielens.MovieLensRank",
            RANK,
            3,
            "data.batch_size=80 must be a whole number of lists of data.list_size + data.negatives = 20 rows on each of "
            "the 3 rank(s) (a multiple of 60)",
        ),
    ],
)
def test_a_source_refuses_its_own_bad_fields(target, data, world_size, message):
    cls = get_class(f"hybridrec.data.{target}")
    with pytest.raises(ValueError, match=re.escape(message)):
        cls.check_config(OmegaConf.create(data), world_size)


def test_user_and_item_sources_are_exactly_the_user_item_sources():
    for option in _options("data"):
        cls = get_class(compose_cfg([f"data={option}"]).data._target_)
        assert cls.user_item_features == issubclass(cls, UserItemSource), option
    assert not Source.per_rank_report and get_class("hybridrec.data.criteo.CriteoTSV").per_rank_report


def test_every_source_yields_recbatch_and_a_click_log_carries_no_ranking_tensor():
    from hybridrec.data.synthetic import SyntheticClickLog

    data = SyntheticClickLog(
        batch_size=8,
        num_dense_features=2,
        num_embeddings_per_feature=[10, 20],
        ids_per_feature=1,
        multi_hot_sizes=[],
        zipf_exponent=1.05,
        eval_batches=1,
        seed=0,
    )
    train, scored = next(loader.batches(data, "train", 0, 1, 1)), next(loader.batches(data, "eval", 0, 1)).batch
    for batch in (train, scored, train.to(torch.device("cpu"))):
        assert type(batch) is RecBatch
        assert (batch.relevance, batch.weights, batch.query, batch.log_q) == (None, None, None, None)
