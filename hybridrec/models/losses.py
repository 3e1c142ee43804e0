"""Training objectives (the ``loss`` config group): pointwise, pairwise and listwise.

A loss is an ``nn.Module`` called as ``loss(logits, batch)`` with one logit per row. List
losses see the rows as lists of ``list_size`` consecutive rows (one user's items; the list
source guarantees whole lists per rank) and use ``batch.relevance`` and ``batch.weights``
(0 = padding). Being modules without sharded children, TorchRec's pipeline tracer treats them
as leaves: their Python runs as written.

Every loss is a mean over lists (or rows) of a per-list value, so each rank's loss is the
mean over its equal share of the global batch: the average over ranks equals the loss of the
whole global batch, and 2-rank training equals 1-rank training (see the equivalence tests).
torchrec has no learning-to-rank losses, hence these.
"""

from __future__ import annotations

from typing import ClassVar, Optional

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F
from torch import nn

from hybridrec.data import RecBatch


class Loss(nn.Module):
    """The loss contract: ``forward(logits, batch)`` -> a scalar mean (see the module
    docstring), built with the source's ``list_size`` (None: rows are not lists). What the
    loss needs is declared on the class; validation and evaluation read it."""

    needs_lists: ClassVar[bool] = False
    """Rows must come as whole lists per rank (``Source.lists``: data=movielens_rank)."""
    needs_relevance: ClassVar[bool] = False
    """Batches must carry graded relevance (the source's ``extra_fields``: MovieLens)."""
    in_batch_negatives: ClassVar[bool] = False
    """Called with the towers, ``loss(user, item, batch)``: the model must declare
    ``Ranker.in_batch_negatives``."""
    needs_next_item: ClassVar[bool] = False
    """Called by a sequence ranker with positions and negatives (``NextItemSoftmax``): the
    source must be a next-item one (``Source.next_item``)."""
    calibrated: ClassVar[bool] = False
    """The scores it trains are click logits, so NE, log loss, calibration and accuracy of
    sigmoid(score) are reported; otherwise evaluation reports ordering metrics only."""

    def __init__(self, list_size: Optional[int] = None) -> None:
        super().__init__()
        self.list_size = list_size

    def _lists(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        assert self.list_size is not None  # list losses (needs_lists) are built with the list source's size
        return [t.view(-1, self.list_size) for t in tensors]


def _weights(batch: RecBatch, like: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(like) if batch.weights is None else batch.weights


def _mean_per_list(values: torch.Tensor, weights: torch.Tensor, list_size: Optional[int]) -> torch.Tensor:
    """Mean over real rows within each list, then over lists (rows are lists of one when
    there is no list structure: padding then counts as a zero, keeping the normalization
    the same on every rank)."""
    if list_size is None:
        return (values * weights).sum() / values.numel()
    v, w = values.view(-1, list_size), weights.view(-1, list_size)
    return ((v * w).sum(1) / w.sum(1).clamp(min=1)).mean()


class BCE(Loss):
    """Pointwise binary cross-entropy on the label (rating >= threshold, or click)."""

    calibrated = True

    def forward(self, logits: torch.Tensor, batch: RecBatch) -> torch.Tensor:
        if batch.weights is None and self.list_size is None:
            return F.binary_cross_entropy_with_logits(logits, batch.labels)  # as TorchRec's DLRMTrain
        per_row = F.binary_cross_entropy_with_logits(logits, batch.labels, reduction="none")
        return _mean_per_list(per_row, _weights(batch, logits), self.list_size)


class MSE(Loss):
    """Pointwise squared error on the graded relevance (explicit feedback: the rating)."""

    needs_relevance = True

    def forward(self, logits: torch.Tensor, batch: RecBatch) -> torch.Tensor:
        if batch.relevance is None:
            raise ValueError("loss=mse needs graded relevance (a MovieLens source), this batch has only labels")
        return _mean_per_list((logits - batch.relevance) ** 2, _weights(batch, logits), self.list_size)


class Pairwise(Loss):
    """RankNet / BPR logistic loss: for every pair (i, j) of real rows of a list with
    relevance_i > relevance_j, -log sigmoid(s_i - s_j). Mean over a list's pairs, then over
    lists (a list without any pair counts as 0). The "negatives" are the list's lower-rated
    items and the unrated items the source samples into it (``data.negatives``)."""

    needs_lists = True
    needs_relevance = True

    def forward(self, logits: torch.Tensor, batch: RecBatch) -> torch.Tensor:
        assert batch.relevance is not None and batch.weights is not None  # list sources set both (RANKING_FIELDS)
        s, rel, w = self._lists(logits, batch.relevance, batch.weights)
        real = (w[:, :, None] > 0) & (w[:, None, :] > 0)
        pairs = (rel[:, :, None] > rel[:, None, :]) & real
        per_pair = F.softplus(s[:, None, :] - s[:, :, None])  # -log sigmoid(s_i - s_j)
        per_list = (per_pair * pairs).sum((1, 2)) / pairs.sum((1, 2)).clamp(min=1)
        return per_list.mean()


class ListwiseSoftmax(Loss):
    """Softmax cross-entropy over each list (ListNet top-one, targets relevance / sum of
    relevance, as TF-Ranking's SoftmaxLoss). Lists without relevant rows count as 0."""

    needs_lists = True
    needs_relevance = True

    def forward(self, logits: torch.Tensor, batch: RecBatch) -> torch.Tensor:
        assert batch.relevance is not None and batch.weights is not None  # list sources set both (RANKING_FIELDS)
        s, rel, w = self._lists(logits, batch.relevance, batch.weights)
        log_p = torch.log_softmax(s.masked_fill(w == 0, float("-inf")), dim=1)
        target = rel * w / (rel * w).sum(1, keepdim=True).clamp(min=1e-12)
        return -(target * log_p.masked_fill(w == 0, 0.0)).sum(1).mean()


class ApproxNDCG(Loss):
    """ApproxNDCG (Qin, Liu & Li 2010): NDCG with each rank replaced by the smooth
    1 + sum_j sigmoid((s_j - s_i) / temperature); loss = -approximate NDCG per list, gains
    2^rel - 1. Lists without relevant rows count as 0."""

    needs_lists = True
    needs_relevance = True

    def __init__(self, list_size: Optional[int] = None, temperature: float = 0.1) -> None:
        super().__init__(list_size)
        self.temperature = temperature

    def forward(self, logits: torch.Tensor, batch: RecBatch) -> torch.Tensor:
        assert batch.relevance is not None and batch.weights is not None  # list sources set both (RANKING_FIELDS)
        s, rel, w = self._lists(logits, batch.relevance, batch.weights)
        real = (w[:, None, :] > 0) & (w[:, :, None] > 0)
        beats = torch.sigmoid((s[:, None, :] - s[:, :, None]) / self.temperature) * real  # [i, j]: j above i
        beats = beats * (1 - torch.eye(s.shape[1], device=s.device))
        rank = 1 + beats.sum(2)
        gain = (torch.pow(2.0, rel) - 1) * w
        dcg = (gain / torch.log2(1 + rank)).sum(1)
        ideal = gain.sort(dim=1, descending=True).values
        positions = torch.arange(1, s.shape[1] + 1, device=s.device, dtype=s.dtype)
        idcg = (ideal / torch.log2(1 + positions)).sum(1)
        return -(dcg / idcg.clamp(min=1e-12)).mean()


class InBatchSoftmax(Loss):
    """Sampled softmax with in-batch negatives for two-tower retrieval (Yi et al. 2019).

        Every positive row (label 1) is a user whose own item must win over the items of every
        row of the *global* batch (gathered from all ranks with autograd, so the negatives and
        hence the training do not depend on the world size). With ``logq_correction``, each
        item's logit is lowered by log q (its frequency among training rows), removing the
        popularity bias of in-batch sampling. Rows that hold the same item as the positive are
        not negatives. Called with the towers' outputs, ``loss(user, item, batch)``: the logits are
    ``user @ item.T`` (the model divides ``user`` by its temperature).
    """

    in_batch_negatives = True

    def __init__(self, list_size: Optional[int] = None, logq_correction: bool = True) -> None:
        super().__init__(list_size)
        self.logq_correction = logq_correction

    def forward(self, user: torch.Tensor, item: torch.Tensor, batch: RecBatch) -> torch.Tensor:
        item_ids = batch.sparse_features["item"].values()
        log_q = batch.log_q  # set by user-item sources, the only ones two towers train on
        offset = 0
        if dist.is_initialized() and dist.get_world_size() > 1:
            assert log_q is not None  # (see above)
            # The backward of this all_gather sums every rank's gradient into the owner's rows.
            item = torch.cat(dist_nn.all_gather(item))
            item_ids, log_q = torch.cat(_all_gather_nograd(item_ids)), torch.cat(_all_gather_nograd(log_q))
            offset = dist.get_rank() * user.shape[0]
        logits = user @ item.T
        if self.logq_correction:
            assert log_q is not None  # (see above)
            logits = logits - log_q[None, :]
        mine = torch.arange(user.shape[0], device=user.device) + offset
        same_item = item_ids[mine][:, None] == item_ids[None, :]
        same_item[torch.arange(user.shape[0]), mine] = False
        logits = logits.masked_fill(same_item, float("-inf"))
        per_row = F.cross_entropy(logits, mine, reduction="none")
        positive = batch.labels * _weights(batch, batch.labels)
        return (per_row * positive).sum() / user.shape[0]


class NextItemSoftmax(Loss):
    """Next-item softmax of the sequence rankers (``loss=next_item``): at every position of a
    history, its output must score the next item above the negatives. Called by the model as
    ``loss(queries, positives, positive_ids, negatives, negative_ids, user, users, log_q)``:
    the real positions' outputs ``[P, D]``, their next items' embeddings and ids, the batch's
    negatives (sampled per global batch by the source, or the whole catalogue: then it is a
    full softmax), each position's user (its row) and the rows of the batch.

    With ``in_batch``, the next items of every position of the global batch (gathered from
    all ranks, with autograd) are negatives too. A negative that is the position's own
    positive is masked (an accidental hit). With ``logq_correction`` and a sampler that is
    not uniform (the model's ``sampler_log_q``: training popularity), every candidate's
    logit is lowered by the log of its sampling probability (Bengio & Senecal; what TF's
    sampled softmax does), and in-batch negatives by their popularity. The loss is each
    user's mean over its positions, summed and divided by the rows of the rank's batch: every
    rank holds an equal share of the global batch, so the average over ranks is the global
    batch's loss, whatever the world size (a row without a position counts 0)."""

    needs_next_item = True

    def __init__(
        self,
        list_size: Optional[int] = None,
        in_batch: bool = False,
        logq_correction: bool = True,
        temperature: float = 1.0,
        average: str = "user",
    ) -> None:
        super().__init__(list_size)
        self.in_batch, self.logq_correction, self.temperature = in_batch, logq_correction, temperature
        self.by_position = str(getattr(average, "value", average)) == "position"

    def forward(
        self,
        queries: torch.Tensor,
        positives: torch.Tensor,
        positive_ids: torch.Tensor,
        negatives: torch.Tensor,
        negative_ids: torch.Tensor,
        user: torch.Tensor,
        users: int,
        log_q: Optional[torch.Tensor] = None,
        sampled_by_popularity: bool = False,
    ) -> torch.Tensor:
        candidates, candidate_ids = negatives, negative_ids
        correct = self.logq_correction and log_q is not None
        # Each candidate's correction is its own sampler's log-probability: popularity for
        # in-batch negatives and the positives (distributed like the interactions), and for
        # sampled negatives when drawn by popularity; uniformly drawn ones shift by a constant.
        corrections = [
            log_q[negative_ids]
            if correct and sampled_by_popularity and log_q is not None  # (correct implies log_q)
            else torch.zeros(len(negative_ids), device=queries.device)
        ]
        if self.in_batch:
            batch_items, batch_ids = positives, positive_ids
            if dist.is_initialized() and dist.get_world_size() > 1:
                batch_items = _cat_gathered(
                    dist_nn.all_gather(_padded_rows(positives, self._most(positives))),
                    _all_gather_nograd(torch.tensor([len(positives)], device=positives.device)),
                )
                batch_ids = _cat_gathered(
                    _all_gather_nograd(_padded_rows(positive_ids, self._most(positives))),
                    _all_gather_nograd(torch.tensor([len(positives)], device=positives.device)),
                )
            candidates, candidate_ids = torch.cat([candidates, batch_items]), torch.cat([candidate_ids, batch_ids])
            corrections.append(
                log_q[batch_ids]
                if correct and log_q is not None  # (correct implies log_q)
                else torch.zeros(len(batch_ids), device=queries.device)
            )
        queries = queries / self.temperature
        target = (
            None if self.in_batch or (correct and sampled_by_popularity) else self._column(candidate_ids, positive_ids)
        )
        if target is not None:  # the full softmax: every positive is a candidate, once
            per_position = F.cross_entropy(queries @ candidates.T, target, reduction="none")
            return self._mean(per_position, user, users)
        # The softmax over [positive, candidates] without building that [P, 1 + C] matrix: the
        # candidates' logsumexp, then logaddexp with the positive. With a full softmax C is the
        # catalogue, and concatenating, dividing and slicing the logits cost more than the
        # matmul (each a copy of P x C floats, and another in the backward).
        positive = (queries * positives).sum(1)
        logits = queries @ candidates.T
        if correct and (self.in_batch or sampled_by_popularity):
            assert log_q is not None  # correct implies it
            positive = positive - log_q[positive_ids]
            logits = logits - torch.cat(corrections)[None, :]
        # in place: mm's backward keeps its inputs, not its output
        logits.masked_fill_(candidate_ids[None, :] == positive_ids[:, None], float("-inf"))
        per_position = torch.logaddexp(positive, torch.logsumexp(logits, dim=1)) - positive
        return self._mean(per_position, user, users)

    @staticmethod
    def _column(candidate_ids: torch.Tensor, positive_ids: torch.Tensor) -> Optional[torch.Tensor]:
        """Each positive's column among the candidates when they are consecutive ids (the
        whole catalogue: a full softmax) holding every positive, else None. Then the softmax
        over the candidates with the positive's own column as the target is the same loss
        (the same set of logits), and cross-entropy's fused kernel computes it in fewer
        passes over the [P, C] logits than masking the positive out and adding it back."""
        n = len(candidate_ids)
        if not n or len(positive_ids) == 0:
            return None
        first = candidate_ids[0]
        if not torch.equal(candidate_ids, torch.arange(n, device=candidate_ids.device) + first):
            return None
        target = positive_ids - first
        return target if bool(((target >= 0) & (target < n)).all()) else None

    def _mean(self, per_position: torch.Tensor, user: torch.Tensor, users: int) -> torch.Tensor:
        """The batch's loss from its positions' (``average``). By position, each rank returns
        its positions' sum times the world size over the global batch's positions (one
        all-reduce of a count), so that the ranks' mean is the global batch's mean whatever
        the world size, as the per-user mean is."""
        if not self.by_position:
            return self._per_user_mean(per_position, user, users)
        count = torch.tensor([float(len(per_position))], device=per_position.device)
        world = 1
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(count)
            world = dist.get_world_size()
        return per_position.sum() * world / count.clamp(min=1)[0]

    @staticmethod
    def _per_user_mean(per_position: torch.Tensor, user: torch.Tensor, users: int) -> torch.Tensor:
        counts = torch.zeros(users, device=per_position.device).index_add_(0, user, torch.ones_like(per_position))
        per_user = torch.zeros(users, device=per_position.device).index_add_(0, user, per_position)
        return (per_user / counts.clamp(min=1)).sum() / users

    @staticmethod
    def _most(t: torch.Tensor) -> int:
        """The most rows any rank holds (all_gather takes equal shapes)."""
        size = torch.tensor([len(t)], device=t.device)
        dist.all_reduce(size, op=dist.ReduceOp.MAX)
        return int(size)


def _padded_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros((rows - len(t), *t.shape[1:]))])


def _cat_gathered(parts: list[torch.Tensor], sizes: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([part[: int(n)] for part, n in zip(parts, sizes)])


def _all_gather_nograd(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out
