"""Rows of a batch as a few contiguous arrays: what every source reads, a worker process hands
over and the loader turns into a ``RecBatch``.

A batch of B rows and F sparse features is:

- ``dense``: float32 ``[B, D]``; ``labels``: float32 ``[B]``;
- ``values``: int64, every id of the rows, feature-major (feature 0's ids of rows 0..B-1,
  then feature 1's, ...): the order of a ``KeyedJaggedTensor``'s values, so the batch's KJT
  takes it as it is, without a copy;
- ``lengths``: int32 ``[F, B]``, the ids of each feature in each row, or None when every
  feature has exactly one id per row (one-hot, the Criteo shape): then ``values`` is
  ``[F, B]`` laid flat, and neither lengths nor offsets are built until the KJT asks;
- ``id_weights``: float32, one per value (sources with weighted features), or None;
- ``extra``: the ranking fields of list sources (``RANKING_FIELDS``), ``real``: the padding
  mask, ``report``: what reading them counted.

The KJT is built with its per-key lengths and offsets given (``length_per_key``,
``offset_per_key``), so turning rows into a batch costs no per-feature Python work and, for
one-hot rows, no reduction at all. Batches are the same, field by field and dtype by dtype,
as when every feature was a tensor of its own (``tests/test_batches.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import numpy.typing as npt
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from hybridrec.data import ReadReport, RecBatch

RANKING_FIELDS = ("relevance", "weights", "query", "log_q")
"""RecBatch's fields beside the Batch ones, in its order, that list sources set."""
SEQUENCE_FIELDS = ("times",)
"""The RecBatch field next-item sources set beside the ids: each history item's time."""


_ONES: dict[tuple[int, torch.device], torch.Tensor] = {}


def _ones(n: int, device: torch.device) -> torch.Tensor:
    """int32 ones of length ``n`` on ``device``: the lengths of one-hot rows, made once per
    size and device (a batch shape recurs every step) and shared by the batches'
    KeyedJaggedTensors, which never write their lengths (TorchRec's input distribution and
    pipelines copy or permute them)."""
    ones = _ONES.get((n, device))
    if ones is None:
        if len(_ONES) >= 8:  # a few shapes per run (train, evaluated splits, their last batches)
            _ONES.clear()
        ones = _ONES[(n, device)] = torch.ones(n, dtype=torch.int32, device=device)
    return ones


def _tensor(a: np.ndarray, dtype: npt.DTypeLike) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=dtype))


def _extra_dtype(key: str) -> type[np.generic]:
    """The dtype of a ranking field: the query (a user id) and times are integers, the rest floats."""
    return np.int64 if key in ("query", "times") else np.float32


@dataclass
class Rows:
    """Rows of a batch (see the module docstring). Build them with ``one_hot`` or ``of``."""

    dense: torch.Tensor
    values: torch.Tensor
    lengths: Optional[torch.Tensor]
    labels: torch.Tensor
    features: int
    """F: the number of sparse features (needed to read ``values`` when ``lengths`` is None)."""
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    real: Optional[torch.Tensor] = None
    """False for padding rows; None = every row is real."""
    report: Optional[ReadReport] = None
    id_weights: Optional[torch.Tensor] = None
    totals: Optional[list[int]] = None
    """Each feature's ids, when the source knows them without reading ``lengths`` (rows made on
    a GPU: reading their lengths back would wait for the device); None = counted from them."""

    def __len__(self) -> int:
        return len(self.labels)

    # -- building --------------------------------------------------------------------------
    @staticmethod
    def one_hot(
        dense: np.ndarray, ids: np.ndarray, labels: np.ndarray, extra: Optional[dict[str, np.ndarray]] = None
    ) -> "Rows":
        """From NumPy: dense ``[n, D]``, ids ``[F, n]`` (feature-major: one id per feature and
        row), labels ``[n]``. ``ids`` as int64 and contiguous is taken without a copy."""
        return Rows(
            _tensor(dense, np.float32),
            _tensor(ids, np.int64).view(-1),
            None,
            _tensor(labels, np.float32),
            ids.shape[0],
            {k: _tensor(v, _extra_dtype(k)) for k, v in (extra or {}).items()} if extra else {},
        )

    @staticmethod
    def of(
        dense: np.ndarray,
        ids: Sequence[tuple[np.ndarray, np.ndarray]],
        labels: np.ndarray,
        extra: Optional[dict[str, np.ndarray]] = None,
        weights: Optional[Sequence[Optional[np.ndarray]]] = None,
    ) -> "Rows":
        """From NumPy, per feature: dense ``[n, D]``, per feature (values, lengths), labels
        ``[n]``, the ranking fields, and (a source with weighted features) per feature the
        weight of each value, None for an unweighted one (its ids weigh 1.0). Rows whose every
        feature has one id each are laid out one-hot."""
        if weights is not None and len(weights) != len(ids):
            raise ValueError(f"weights for {len(weights)} features, ids for {len(ids)}")
        n = len(labels)
        values = np.concatenate([np.asarray(v, np.int64) for v, _ in ids]) if ids else np.zeros(0, np.int64)
        lengths = np.stack([np.asarray(k, np.int32) for _, k in ids]) if ids else np.zeros((0, n), np.int32)
        one_hot = weights is None and len(values) == len(ids) * n and (n == 0 or bool((lengths == 1).all()))
        id_weights = None
        if weights is not None:
            id_weights = _tensor(
                np.concatenate([np.ones(len(v), np.float32) if w is None else w for (v, _), w in zip(ids, weights)]),
                np.float32,
            )
        return Rows(
            _tensor(dense, np.float32),
            torch.from_numpy(values),
            None if one_hot else torch.from_numpy(lengths),
            _tensor(labels, np.float32),
            len(ids),
            {k: _tensor(v, _extra_dtype(k)) for k, v in (extra or {}).items()},
            id_weights=id_weights,
        )

    # -- reading -----------------------------------------------------------------------------
    def real_mask(self) -> torch.Tensor:
        return torch.ones(len(self), dtype=torch.bool) if self.real is None else self.real

    def lengths_2d(self) -> torch.Tensor:
        """int32 ``[F, n]``: ids per feature and row (ones for one-hot rows)."""
        return torch.ones(self.features, len(self), dtype=torch.int32) if self.lengths is None else self.lengths

    def feature_totals(self) -> torch.Tensor:
        """int64 ``[F]``: the ids of each feature."""
        if self.lengths is None:
            return torch.full((self.features,), len(self), dtype=torch.int64)
        return self.lengths.sum(1, dtype=torch.int64)

    def feature(self, f: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Feature ``f``'s ids, their lengths per row and their weights (1.0 without): views
        of the arrays, for inspection; batches never need them one by one."""
        totals = self.feature_totals()
        first = int(totals[:f].sum())
        ids = slice(first, first + int(totals[f]))
        return self.values[ids], self.lengths_2d()[f], self.weights_or_ones()[ids]

    def weights_or_ones(self) -> torch.Tensor:
        return torch.ones(len(self.values)) if self.id_weights is None else self.id_weights

    # -- combining ---------------------------------------------------------------------------
    def padded(self, n: int) -> "Rows":
        """These rows and ``n - len(self)`` padding rows after them: dense 0, one id 0 per
        feature (models may rely on one item id per row) of id weight 1.0, label 0, row
        weight 0, not real. The id weight is 1.0, not 0, so that padding is the same lookup
        whether a feature is weighted or not (id 0, counted once); the row weight 0 already
        keeps its score out of every loss and metric."""
        pad = n - len(self)
        if pad <= 0:
            return self
        rows, F = len(self), self.features
        zeros = lambda t: torch.cat([t, torch.zeros((pad, *t.shape[1:]), dtype=t.dtype)])
        if self.lengths is None:  # [F, rows] -> [F, rows + pad]: a zero id appended to every feature
            values = torch.cat([self.values.view(F, rows), torch.zeros(F, pad, dtype=torch.int64)], 1).view(-1)
            weights = (
                None
                if self.id_weights is None
                else torch.cat([self.id_weights.view(F, rows), torch.ones(F, pad)], 1).view(-1)
            )
            lengths = None
        else:  # each feature's ids keep their place, shifted by the padding ids of the features before
            lengths = torch.cat([self.lengths, torch.ones(F, pad, dtype=torch.int32)], 1)
            to = torch.arange(len(self.values)) + pad * torch.repeat_interleave(torch.arange(F), self.feature_totals())
            values = torch.zeros(len(self.values) + F * pad, dtype=torch.int64)
            values[to] = self.values
            weights = None
            if self.id_weights is not None:
                weights = torch.ones(len(values))
                weights[to] = self.id_weights
        return Rows(
            zeros(self.dense),
            values,
            lengths,
            zeros(self.labels),
            F,
            {k: zeros(v) for k, v in self.extra.items()},
            torch.cat([self.real_mask(), torch.zeros(pad, dtype=torch.bool)]),
            self.report,
            weights,
        )

    @staticmethod
    def cat(parts: list["Rows"]) -> "Rows":
        """Rows of several parts, in order (a rank's slice read by several readers): each
        feature's ids are those of the parts one after the other."""
        if len(parts) == 1:
            return parts[0]
        F = parts[0].features
        real = None if all(p.real is None for p in parts) else torch.cat([p.real_mask() for p in parts])
        weighted = any(p.id_weights is not None for p in parts)
        if all(p.lengths is None for p in parts):
            values = torch.cat([p.values.view(F, len(p)) for p in parts], 1).view(-1)
            lengths = None
            weights = torch.cat([p.weights_or_ones().view(F, len(p)) for p in parts], 1).view(-1) if weighted else None
        else:
            # part-major, feature-major inside each part -> feature-major, parts in order: a
            # stable sort by feature of every value (one pass, no per-feature loop)
            lengths = torch.cat([p.lengths_2d() for p in parts], 1)
            feature = torch.cat([torch.repeat_interleave(torch.arange(F), p.feature_totals()) for p in parts])
            order = torch.argsort(feature, stable=True)
            values = torch.cat([p.values for p in parts])[order]
            weights = torch.cat([p.weights_or_ones() for p in parts])[order] if weighted else None
        first = parts[0]
        return Rows(
            torch.cat([p.dense for p in parts]),
            values,
            lengths,
            torch.cat([p.labels for p in parts]),
            F,
            {k: torch.cat([p.extra[k] for p in parts]) for k in first.extra},
            real,
            id_weights=weights,
            totals=[sum(t) for t in zip(*[p.totals or [] for p in parts])] if all(p.totals for p in parts) else None,
        )

    def none_like(self) -> "Rows":
        """No rows, laid out like these (a piece whose reader ran out: all padding)."""
        empty = lambda t: t[:0]
        return Rows(
            empty(self.dense),
            self.values[:0],
            None if self.lengths is None else self.lengths[:, :0],
            empty(self.labels),
            self.features,
            {k: empty(v) for k, v in self.extra.items()},
            None if self.real is None else empty(self.real),
            id_weights=None if self.id_weights is None else self.id_weights[:0],
        )

    # -- the batch ---------------------------------------------------------------------------
    def batch(self, keys: list[str], weighted: bool = False) -> RecBatch:
        """The batch the model and pipeline take, its ranking fields those of ``extra``
        (None for a source without them). The KeyedJaggedTensor carries ``id_weights`` as
        its weights when the rows have them; ``weighted`` (the source has a weighted
        feature): always, 1.0 per id for rows without them, since a weighted embedding
        collection reads weights of every batch."""
        weights = None
        if self.id_weights is not None or weighted:
            weights = self.weights_or_ones()
        n = len(self)
        if self.lengths is None:
            lengths = _ones(self.features * n, self.values.device)
            per_key = [n] * self.features
        else:
            lengths = self.lengths.reshape(-1)
            per_key = self.totals if self.totals is not None else self.feature_totals().tolist()
        offsets = np.concatenate([[0], np.cumsum(per_key, dtype=np.int64)]).tolist()
        kjt = KeyedJaggedTensor(
            keys=keys,
            values=self.values,
            weights=weights,
            lengths=lengths,
            stride=n,
            length_per_key=per_key,
            offset_per_key=offsets,
        )
        extra = dict(self.extra)
        if "weights" in extra and self.real is not None:
            extra["weights"] = extra["weights"] * self.real
        return RecBatch(dense_features=self.dense, sparse_features=kjt, labels=self.labels, **extra)
