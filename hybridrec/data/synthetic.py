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
from torchrec.datasets.utils import Batch

from hybridrec.data import SparseFeature, make_batch, rank_rows

# Each split draws from its own random streams: validation and test rows are new samples of
# the same planted model, never training rows.
_SPLITS = {"train": 0, "eval": 1, "valid": 2}
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
        dense_distribution: str = "normal",
        valid_batches: int = 0,
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
        self.dense_distribution = getattr(dense_distribution, "value", dense_distribution)
        self.eval_batches = eval_batches
        self.valid_batches = valid_batches
        self.splits = ("train", "valid", "eval") if valid_batches else ("train", "eval")
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

    def _global_arrays(self, split: str, index: int) -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:
        """The ``index``-th global batch of ``split`` as arrays: dense (b, d), per feature
        ids (b, k), labels (b,). A pure function of (seed, split, index)."""
        rng = np.random.default_rng([self.seed, _SPLITS[split], index])
        b, shape = self.batch_size, (self.batch_size, self.num_dense_features)
        if self.dense_distribution == "lognormal":  # raw-count-like; the model sees log(1 + x)
            raw = rng.lognormal(0.0, 1.5, shape)
            dense = np.log1p(raw)
            signal = (dense - 1.0) / 0.8  # roughly centred, for the planted logit
        else:
            dense = rng.standard_normal(shape) if self.dense_distribution == "normal" else rng.random(shape)
            signal = dense if self.dense_distribution == "normal" else (dense - 0.5) * 3.4
        ids = [
            self._zipf_rows(rng, f.num_embeddings, b * k).reshape(b, k)
            for f, k in zip(self.features, self._sizes)
        ]
        logit = -1.0 + 1.5 * signal @ self._dense_w
        for i, f_ids in enumerate(ids):
            logit += 3.0 * self._planted_weight(i, f_ids).mean(axis=1) / np.sqrt(len(ids))
        labels = rng.random(b) < 1 / (1 + np.exp(-logit))
        return dense, ids, labels

    def _batch(self, dense: np.ndarray, ids: list[np.ndarray], labels: np.ndarray) -> Batch:
        pairs = [(i.reshape(-1), np.full(len(i), i.shape[1], dtype=np.int32)) for i in ids]
        return make_batch(dense, pairs, labels, [f.name for f in self.features])

    def global_batch(self, split: str, index: int) -> Batch:
        """The ``index``-th global batch of ``split``, whole."""
        return self._batch(*self._global_arrays(split, index))

    def batches(
        self, split: str, rank: int, world_size: int, num_batches: int | None = None, start: int = 0
    ) -> Iterator[Batch]:
        """This rank's slice of global batches ``start`` .. ``num_batches - 1`` of ``split``.
        Every rank generates the whole global batch and keeps its rows: generation is cheap
        next to a training step, and it makes the batches independent of the world size."""
        if num_batches is None:
            num_batches = {"eval": self.eval_batches, "valid": self.valid_batches}.get(split)
        rows = rank_rows(self.batch_size, rank, world_size)
        index = start
        while num_batches is None or index < num_batches:
            dense, ids, labels = self._global_arrays(split, index)
            yield self._batch(dense[rows], [i[rows] for i in ids], labels[rows])
            index += 1

    def report(self) -> None:
        """Nothing is read from files: no read report."""
        return None
