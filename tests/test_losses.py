"""Each ranking loss and the ranking metrics against values computed by hand on tiny lists."""

import math

import numpy as np
import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from conftest import compose_cfg
from hybridrec.data import RecBatch
from hybridrec.models.losses import BCE, MSE, ApproxNDCG, InBatchSoftmax, ListwiseSoftmax, Pairwise
from hybridrec.reports.metrics import ranking_metrics

pytestmark = pytest.mark.unit

# Two lists of 3 rows; the second list's middle row is padding (weight 0).
S = [2.0, 0.0, 1.0, 0.5, 9.0, 0.0]
REL = [3.0, 0.0, 1.0, 1.0, 5.0, 0.0]
W = [1.0, 1.0, 1.0, 1.0, 0.0, 1.0]
LABELS = [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]
sig = lambda x: 1 / (1 + math.exp(-x))


def batch(items=None, log_q=None, labels=LABELS, rel=REL, w=W):
    n = len(labels)
    items = list(range(n)) if items is None else items
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["item"], values=torch.tensor(items), lengths=torch.ones(n, dtype=torch.int32)
    )
    return RecBatch(
        torch.zeros(n, 1),
        kjt,
        torch.tensor(labels),
        torch.tensor(rel),
        torch.tensor(w),
        torch.zeros(n, dtype=torch.long),
        torch.tensor(log_q or [0.0] * n),
    )


def test_pointwise_losses_average_real_rows_per_list():
    bce = lambda s, y: -math.log(sig(s)) if y else -math.log(1 - sig(s))
    expected = ((bce(2, 1) + bce(0, 0) + bce(1, 0)) / 3 + (bce(0.5, 0) + bce(0, 0)) / 2) / 2
    assert BCE(list_size=3)(torch.tensor(S), batch()).item() == pytest.approx(expected, rel=1e-6)
    sq = ((2 - 3) ** 2 + 0 + 0, (0.5 - 1) ** 2 + 0)
    assert MSE(list_size=3)(torch.tensor(S), batch()).item() == pytest.approx((sq[0] / 3 + sq[1] / 2) / 2, rel=1e-6)
    # Without lists, BCE is TorchRec's DLRMTrain loss: the plain mean.
    plain = sum(bce(s, y) for s, y in zip(S, LABELS)) / 6
    assert BCE()(torch.tensor(S), batch(w=[1.0] * 6)).item() == pytest.approx(plain, rel=1e-6)


def test_pairwise_is_ranknet_over_higher_lower_pairs():
    nll = lambda d: -math.log(sig(d))
    first = (nll(2 - 0) + nll(2 - 1) + nll(1 - 0)) / 3  # pairs (0,1), (0,2), (2,1)
    second = nll(0.5 - 0)  # the padding row (relevance 5, score 9) is in no pair
    assert Pairwise(list_size=3)(torch.tensor(S), batch()).item() == pytest.approx((first + second) / 2, rel=1e-6)


def test_listwise_softmax_targets_are_normalized_relevance():
    lse1 = math.log(math.exp(2) + math.exp(0) + math.exp(1))
    first = -(0.75 * (2 - lse1) + 0.25 * (1 - lse1))
    second = -(0.5 - math.log(math.exp(0.5) + math.exp(0)))  # softmax over the 2 real rows
    assert ListwiseSoftmax(list_size=3)(torch.tensor(S), batch()).item() == pytest.approx(
        (first + second) / 2, rel=1e-6
    )


def test_approx_ndcg_by_its_definition():
    t = 0.5

    def approx(scores, rels):
        ranks = [1 + sum(sig((sj - si) / t) for j, sj in enumerate(scores) if j != i) for i, si in enumerate(scores)]
        gains = [2**r - 1 for r in rels]
        dcg = sum(g / math.log2(1 + r) for g, r in zip(gains, ranks))
        idcg = sum(g / math.log2(2 + k) for k, g in enumerate(sorted(gains, reverse=True)))
        return dcg / idcg

    expected = -(approx([2, 0, 1], [3, 0, 1]) + approx([0.5, 0], [1, 0])) / 2
    got = ApproxNDCG(list_size=3, temperature=t)(torch.tensor(S), batch()).item()
    assert got == pytest.approx(expected, rel=1e-6)


def test_in_batch_softmax_with_logq_and_duplicate_items():
    user = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    item = torch.tensor([[1.0, 0.5], [0.2, 1.0], [0.3, 0.3]])
    log_q = [-1.0, -2.0, -1.0]
    b = batch(items=[5, 7, 5], log_q=log_q, labels=[1.0, 1.0, 0.0], rel=[5.0, 4.0, 2.0], w=[1.0, 1.0, 1.0])
    logits = (user @ item.T - torch.tensor(log_q)).tolist()
    ce = lambda row, target, cols: -(row[target] - math.log(sum(math.exp(row[c]) for c in cols)))
    # row 0: column 2 holds the same item (5): not a negative; row 2 is no positive (label 0)
    expected = (ce(logits[0], 0, [0, 1]) + ce(logits[1], 1, [0, 1, 2])) / 3
    assert InBatchSoftmax()(user, item, b).item() == pytest.approx(expected, rel=1e-6)
    plain = (user @ item.T).tolist()
    no_logq = (ce(plain[0], 0, [0, 1]) + ce(plain[1], 1, [0, 1, 2])) / 3
    assert InBatchSoftmax(logq_correction=False)(user, item, b).item() == pytest.approx(no_logq, rel=1e-6)


def test_ranking_metrics_by_hand():
    scores = np.array([0.9, 0.8, 0.1, 0.5, 0.2, 0.3])
    rel = np.array([0, 4, 5, 0, 1, 0], dtype=float)
    query = np.array([1, 1, 1, 1, 2, 2])
    m = ranking_metrics(scores, rel, query, threshold=4, k=2)
    ndcg1 = (15 / math.log2(3)) / (31 + 15 / math.log2(3))  # ranked: rel 0, 4 | ideal: 5, 4
    ndcg2 = (1 / math.log2(3)) / 1  # ranked: rel 0, 1 | ideal: 1, 0
    assert m["ndcg@2"] == pytest.approx((ndcg1 + ndcg2) / 2)
    assert m["recall@2"] == pytest.approx(0.5)  # query 2 has no relevant row (>= 4): left out
    assert m["map"] == pytest.approx((1 / 2 + 2 / 4) / 2)  # relevant rows at ranks 2 and 4
    assert (m["queries"], m["queries_with_relevant"]) == (2, 1)


@pytest.mark.unit
@pytest.mark.parametrize("model", ["dlrm", "deepfm", "mmoe"])
def test_the_embedding_penalty_is_the_looked_up_rows_squared_norm(model):
    """model.embedding_l2 adds l2 x the mean over rows of each row's squared pooled
    embeddings (padding rows count as zero) in training only."""
    from hybridrec.data import build_source, loader
    from hybridrec.models import build_model
    from hybridrec.parallel.parallelize import init_embeddings

    extra = ["+experiment=multitask"] if model == "mmoe" else [f"model={model}"]
    cfg = compose_cfg([*extra, "data.batch_size=16", "model.embedding_l2=0.5"])
    data = build_source(cfg.data, 0)
    torch.manual_seed(0)
    net = build_model(cfg, data.features, data.num_dense_features)
    net.sparse_module().to_empty(device="cpu")
    init_embeddings(net.sparse_module(), 0)
    batch = next(iter(loader.batches(data, "train", 0, 1, 1)))
    batch.weights = torch.ones(len(batch.labels))
    batch.weights[-3:] = 0  # padding
    net.train()
    with_l2, _ = net(batch)
    pooled = net._arches[0](batch.sparse_features)  # [B, F, D]; deepfm's first-order columns count too
    by_hand = 0.5 * (pooled.pow(2).sum((1, 2)) * batch.weights).sum() / len(batch.labels)
    net.set_embedding_l2(0.0)
    without, _ = net(batch)
    torch.testing.assert_close(with_l2 - without, by_hand, rtol=1e-5, atol=1e-7)
    net.set_embedding_l2(0.5)
    net.eval()
    assert float(net(batch)[0]) == pytest.approx(float(without), rel=1e-5)  # evaluation: no penalty
