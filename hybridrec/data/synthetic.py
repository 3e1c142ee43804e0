"""Synthetic click log with a planted model, so that learning is measurable.

Each sample has ``num_dense_features`` standard-normal dense features and, per categorical
feature, ``ids_per_feature`` ids drawn from a Zipf law (hot ids first, as in real logs),
scattered over the table by a bijective hash so that hot rows do not all land in the first
row-wise shard. Its label is Bernoulli(sigmoid(logit)) where the logit is a fixed function
of the ids and dense features (the "planted model"): a trained model can recover it, so a
short run's AUC is clearly above 0.5.

Determinism: global batch ``b`` of a split is a pure function of (seed, split, b). Every rank
generates the same global batch and keeps its own contiguous slice, so the global batches
are identical for any world size; that is what makes 1-rank and N-rank runs comparable.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from hybridrec.data import SparseFeature

_SPLITS = {"train": 0, "eval": 1}
# Multiplier of the bijective scatter rank -> row (a prime, so coprime to any table size
# it does not divide; checked in __init__).
_SCATTER = 2_654_435_761


class SyntheticClickLog:
    def __init__(
        self,
        batch_size: int,
        num_dense_features: int,
        num_embeddings_per_feature: list[int],
        ids_per_feature: int,
        multi_hot_sizes: list[int],
        zipf_exponent: float,
        eval_batches: int,
        seed: int,
    ) -> None:
        self.batch_size = batch_size
        self.num_dense_features = num_dense_features
        sizes = list(multi_hot_sizes) or [ids_per_feature] * len(num_embeddings_per_feature)
        if len(sizes) != len(num_embeddings_per_feature) or min(sizes) < 1:
            raise ValueError(
                f"data.multi_hot_sizes needs one size >= 1 per feature "
                f"({len(num_embeddings_per_feature)}), got {list(multi_hot_sizes)}"
            )
        self.features = [
            SparseFeature(f"cat_{i}", int(n), float(k))
            for i, (n, k) in enumerate(zip(num_embeddings_per_feature, sizes))
        ]
        self._sizes = [int(k) for k in sizes]
        for f in self.features:
            if f.num_embeddings % _SCATTER == 0 or f.num_embeddings >= 2**33:
                raise ValueError(f"synthetic table size {f.num_embeddings} is not supported")
        self.zipf_exponent = zipf_exponent
        self.eval_batches = eval_batches
        self.seed = seed
        # The planted model's dense weights; sparse weights are a hash of (feature, id), so
        # even a billion-row table needs no stored truth.
        self._dense_w = np.random.default_rng([seed, 99]).normal(
            0, 1 / np.sqrt(num_dense_features), num_dense_features
        )

    # -- sampling ------------------------------------------------------------------------
    def _zipf_rows(self, rng: np.random.Generator, n: int, size: int) -> np.ndarray:
        # Inverse CDF of the continuous power law on [1, n+1): popularity rank, 0 = hottest.
        u = rng.random(size)
        a = self.zipf_exponent
        if abs(a - 1.0) < 1e-9:
            x = np.exp(u * np.log(n + 1.0))
        else:
            x = ((np.power(n + 1.0, 1 - a) - 1) * u + 1) ** (1 / (1 - a))
        rank = np.minimum(x.astype(np.int64) - 1, n - 1)
        return (rank.astype(np.uint64) * np.uint64(_SCATTER) % np.uint64(n)).astype(np.int64)

    @staticmethod
    def _planted_weight(feature: int, ids: np.ndarray) -> np.ndarray:
        # A fixed pseudo-random weight in [-1, 1) per (feature, id): an integer hash.
        h = (ids.astype(np.uint64) * np.uint64(0x9E3779B1) + np.uint64(feature * 0x85EBCA77 + 1))
        h ^= h >> np.uint64(15)
        h = (h * np.uint64(0x2C1B3C6D)) & np.uint64(0xFFFFFFFF)
        return h.astype(np.float64) / 2**31 - 1.0

    def global_batch(self, split: str, index: int) -> Batch:
        """The ``index``-th global batch of ``split``: a pure function of (seed, split, index)."""
        rng = np.random.default_rng([self.seed, _SPLITS[split], index])
        b = self.batch_size
        dense = rng.standard_normal((b, self.num_dense_features))
        ids = [
            self._zipf_rows(rng, f.num_embeddings, b * k).reshape(b, k)
            for f, k in zip(self.features, self._sizes)
        ]
        logit = -1.0 + 1.5 * dense @ self._dense_w
        for i, f_ids in enumerate(ids):
            logit += 3.0 * self._planted_weight(i, f_ids).mean(axis=1) / np.sqrt(len(ids))
        labels = rng.random(b) < 1 / (1 + np.exp(-logit))
        # KJT layout: values grouped by feature, then by sample.
        values = np.concatenate([f_ids.reshape(-1) for f_ids in ids])
        return Batch(
            dense_features=torch.from_numpy(dense.astype(np.float32)),
            sparse_features=KeyedJaggedTensor.from_lengths_sync(
                keys=[f.name for f in self.features],
                values=torch.from_numpy(values),
                lengths=torch.tensor(self._sizes, dtype=torch.int32).repeat_interleave(b),
            ),
            labels=torch.from_numpy(labels.astype(np.float32)),
        )

    def batches(
        self, split: str, rank: int, world_size: int, num_batches: int | None = None
    ) -> Iterator[Batch]:
        """This rank's slice of the first ``num_batches`` global batches of ``split``."""
        if num_batches is None:
            num_batches = self.eval_batches if split == "eval" else None
        local = self.batch_size // world_size
        index = 0
        while num_batches is None or index < num_batches:
            yield slice_batch(self.global_batch(split, index), rank * local, local)
            index += 1


def slice_batch(batch: Batch, start: int, length: int) -> Batch:
    """Rows [start, start + length) of a batch (dense, labels and every KJT feature)."""
    kjt = batch.sparse_features
    b = batch.labels.numel()
    lengths = kjt.lengths().view(len(kjt.keys()), b)
    offsets = kjt.offsets()
    values = []
    for f in range(len(kjt.keys())):
        lo, hi = offsets[f * b + start], offsets[f * b + start + length]
        values.append(kjt.values()[lo:hi])
    return Batch(
        dense_features=batch.dense_features[start : start + length],
        sparse_features=KeyedJaggedTensor.from_lengths_sync(
            keys=kjt.keys(),
            values=torch.cat(values),
            lengths=lengths[:, start : start + length].reshape(-1),
        ),
        labels=batch.labels[start : start + length],
    )
