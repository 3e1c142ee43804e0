"""Synthetic click log with a planted model, so that learning is measurable.

Each sample has ``num_dense_features`` standard-normal dense features and, per categorical
feature, ``ids_per_feature`` ids drawn from a Zipf law (hot ids first, as in real logs),
scattered over the table by a bijective hash so that hot rows do not all land in the first
row-wise shard. Its label is Bernoulli(sigmoid(logit)) where the logit is a fixed function
of the ids and dense features (the "planted model"): a trained model can recover it, so a
short run's AUC is clearly above 0.5.

Determinism and cost: every random number is a hash of (seed, split, global batch, row of
that batch, column), a counter-based generator. A rank computes only its own rows
[r * B/N, (r + 1) * B/N) of a global batch, so its cost is proportional to its rows whatever
the world size, and the global batches are identical for every world size (what makes
1-rank and N-rank runs comparable).

The same on every machine: the random numbers are integer hashes, and every float that
becomes an id, a label or a dense value is computed with ``hybridrec.data.portable``'s
functions (exactly rounded operations only), not NumPy's or the C library's transcendental
functions, which differ by a few ulps between instruction sets. Version 2 of the generator
(``SyntheticClickLog.version``); version 1 used NumPy's, and drew other rows on a CPU with
AVX-512 than on one without.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import numpy as np
import torch
from omegaconf import DictConfig

from hybridrec.config import DenseDistribution
from hybridrec.config.tasks import check_tasks, tasks_of
from hybridrec.data import DataError, SparseFeature, portable
from hybridrec.data.raw_inputs import RawInputs, dense_input, sparse_input
from hybridrec.data.source import Rows, Source, check_table_sizes

if TYPE_CHECKING:
    from hybridrec.data.loader import DeviceRows

# Each split draws from its own random streams: validation and test rows are new samples of
# the same planted model, never training rows.
_SPLITS = {"train": 0, "eval": 1, "valid": 2}
# Multiplier of the bijective scatter rank -> row (a prime, so coprime to any table size
# it does not divide; checked in __init__).
_SCATTER = 2_654_435_761
# Elements of the id columns the generator's hot loop handles at once (see _zipf_rows).
_BLOCK = 1 << 16
# The planted tasks a multi-task config can name (data.labels[i].column).
TASK_COLUMNS = ("click", "conversion")
# The conversion's uniforms are a stream of their own (this salt on the batch's key): a run
# with the conversion task draws the very rows and clicks of a run without it.
_CONVERSION_SALT = 0x5BD1E995


def _fmix32(h: np.ndarray, scratch: Optional[np.ndarray] = None) -> np.ndarray:
    """MurmurHash3's 32-bit finalizer, in place: uint32 in, well-mixed uint32 out (the
    multiplications wrap on purpose). ``scratch``: a uint32 array of ``h``'s shape for the
    shifted copies, so that no temporary is allocated (large ones cost page faults)."""
    t = np.right_shift(h, np.uint32(16), out=scratch)
    h ^= t
    h *= np.uint32(0x85EBCA6B)
    np.right_shift(h, np.uint32(13), out=t)
    h ^= t
    h *= np.uint32(0xC2B2AE35)
    np.right_shift(h, np.uint32(16), out=t)
    h ^= t
    return h


class SyntheticClickLog(Source):
    version = 2
    """The generator's version: what checkpoints record, so that a run is never resumed onto
    rows another version draws (``Source.version``)."""

    @classmethod
    def check_config(cls, cfg: DictConfig, world_size: int) -> None:
        check_table_sizes(cfg)
        sizes, features = list(cfg.multi_hot_sizes), len(cfg.num_embeddings_per_feature)
        if not sizes and cfg.ids_per_feature < 1:
            raise ValueError(
                f"data.ids_per_feature={cfg.ids_per_feature}: ids per sample of every feature, must be "
                f">= 1 (or give data.multi_hot_sizes, one per feature)"
            )
        if sizes and (len(sizes) != features or min(sizes) < 1):
            raise ValueError(
                f"data.multi_hot_sizes={sizes}: one size >= 1 per feature of "
                f"data.num_embeddings_per_feature ({features}), or empty for data.ids_per_feature"
            )
        if cfg.num_dense_features < 0:
            raise ValueError(f"data.num_dense_features={cfg.num_dense_features}: must be >= 0")
        if cfg.get("labels"):
            check_tasks(cfg.labels, TASK_COLUMNS)

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
        dense_distribution: DenseDistribution = DenseDistribution.normal,
        valid_batches: int = 0,
        labels: Optional[list] = None,
    ) -> None:
        if labels:
            check_tasks(labels, TASK_COLUMNS)
        self.tasks = tasks_of(labels)
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
        self._offsets = np.concatenate([[0], np.cumsum(self._sizes)[:-1]]).astype(int).tolist()
        self._ids = sum(self._sizes)  # id columns per row
        self._one_hot = all(k == 1 for k in self._sizes)
        for f in self.features:
            if f.num_embeddings % _SCATTER == 0 or f.num_embeddings >= 2**32:
                raise DataError(
                    f"data.num_embeddings_per_feature: synthetic table size {f.num_embeddings} is not "
                    f"supported (at most 2**32 - 1 rows, not a multiple of {_SCATTER})"
                )
        self._columns = 2 * num_dense_features + sum(self._sizes) + 1  # random numbers per row
        if batch_size * self._columns >= 2**32:
            raise DataError(
                f"data.batch_size={batch_size}: at most {2**32 // self._columns - 1} rows per global "
                f"batch for these features (the generator counts rows x columns in 32 bits)"
            )
        self.zipf_exponent = zipf_exponent
        # Per id column (a feature's k columns alike): its table's rows and the power law's
        # constants, as [ids, 1] arrays that broadcast over the rows of a batch.
        rows = np.repeat([f.num_embeddings for f in self.features], self._sizes).astype(np.uint64)[:, None]
        self._column_rows = rows
        self._log2_rows = (portable.ln(rows.astype(np.float64) + 1.0) * portable.LOG2E).astype(np.float32)
        self._zipf_scale = (portable.power(rows.astype(np.float64) + 1.0, 1 - zipf_exponent) - 1).astype(np.float32)
        self._feature_salt = np.repeat(
            [(i * 0x85EBCA77 + 1) % 2**32 for i in range(len(self.features))], self._sizes
        ).astype(np.uint32)[:, None]
        self.dense_distribution = DenseDistribution(dense_distribution)
        self.eval_batches = eval_batches
        self.valid_batches = valid_batches
        self.splits = ("train", "valid", "eval") if valid_batches else ("train", "eval")
        self.seed = seed
        # The planted model's dense weights; sparse weights are a hash of (feature, id), so
        # even a billion-row table needs no stored truth.
        u = np.random.default_rng([seed, 99]).random((2, num_dense_features))  # 53-bit uniforms in [0, 1)
        self._dense_w = portable.normal(1.0 - u[0], u[1]) / np.sqrt(num_dense_features)
        # The conversion's planted model (given a click): dense weights of its own, and the
        # click's id weights again, each feature's scaled by a coefficient of its own (some
        # negative): what a model learns of the ids from the many clicks serves the few
        # conversions, which is what sharing a bottom between the tasks can win.
        u = np.random.default_rng([seed, 98]).random((2, num_dense_features))
        self._dense_cv = portable.normal(1.0 - u[0], u[1]) / np.sqrt(num_dense_features)
        self._coef_cv = [(1.0, -0.5, 1.5, 0.0)[f % 4] for f in range(len(self._sizes))]

    # -- sampling ------------------------------------------------------------------------
    def _key(self, split: str, index: int) -> np.uint32:
        """The 32-bit key of a global batch: a 64-bit mix of (seed, split, index)."""
        x = (self.seed * 0x9E3779B97F4A7C15 + _SPLITS[split] * 0xD1B54A32D192ED03 + index * 0xBF58476D1CE4E5B9) % 2**64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % 2**64
        return np.uint32((x ^ (x >> 31)) & 0xFFFFFFFF)

    def _uniforms(self, split: str, index: int, lo: int, hi: int) -> np.ndarray:
        """Every random number of rows [lo, hi) of global batch ``index``: float32
        ``[columns, n]`` in (0, 1), 24 bits each; column c of row r is a hash of (key, r *
        columns + c). Column-major, so that each feature's numbers are one contiguous block
        (its ids become a batch's feature-major id array without a copy)."""
        total = self._columns
        h = np.arange(total, dtype=np.uint32)[:, None] + np.arange(lo, hi, dtype=np.uint32) * np.uint32(total)
        h ^= self._key(split, index)  # B * columns < 2**32 (checked): no wrap before the hash
        _fmix32(h, np.empty_like(h))
        h >>= np.uint32(8)
        u = h.astype(np.float32)
        u += np.float32(0.5)
        u *= np.float32(2.0**-24)
        return u

    def _arrays(self, split: str, index: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows [lo, hi) of global batch ``index`` of ``split``: dense ``[n, d]``, every id
        ``[sum of ids per row, n]`` (feature f's ids are rows ``_offsets[f]`` .. of it), labels
        ``[n]``. Each row is a pure function of (seed, split, index, row)."""
        d, n = self.num_dense_features, hi - lo
        u = self._uniforms(split, index, lo, hi)
        # dense features column by column ([d, n]), so that the planted logit sums them in a
        # fixed order (a matrix product's order depends on the BLAS kernel the CPU runs)
        if self.dense_distribution == DenseDistribution.uniform:
            columns = u[:d]
            signal = (columns - np.float32(0.5)) * np.float32(3.4)
        else:  # Box-Muller: two uniforms per standard normal
            z = portable.normal_f32(u[:d], u[d : 2 * d])
            if self.dense_distribution == DenseDistribution.lognormal:  # raw-count-like; the model sees log(1 + x)
                e = portable.exp2_f32(z * np.float32(1.5 * portable.LOG2E))
                e += np.float32(1)
                columns = portable.log2_f32(e) * np.float32(portable.LN2)
                signal = (columns - np.float32(1.0)) / np.float32(0.8)  # roughly centred, for the planted logit
            else:
                columns = signal = z
        dense = np.ascontiguousarray(columns.T)
        ids = self._zipf_rows(u[2 * d : 2 * d + self._ids])
        weights = self._planted_weights(ids)
        logit = np.full(n, -1.0)
        for j in range(d):
            logit += 1.5 * (signal[j] * self._dense_w[j])
        scale = 3.0 / np.sqrt(len(self._sizes))
        for first, k in zip(self._offsets, self._sizes):
            total = weights[first].copy()  # a row's mean over its k ids, summed in a fixed order
            for j in range(1, k):
                total += weights[first + j]
            logit += scale * (total / np.float32(k))
        clicks = u[-1] < portable.sigmoid(logit)
        labels = clicks
        if self.tasks:
            by_column = {"click": clicks}
            if any(t.column == "conversion" for t in self.tasks):
                by_column["conversion"] = clicks & (
                    self._task_uniforms(split, index, lo, hi)
                    < portable.sigmoid(self._conversion_logit(signal, weights))
                )
            # one task: one label per row, as a single-task model reads it
            labels = (
                np.stack([by_column[t.column] for t in self.tasks], 1)
                if len(self.tasks) > 1
                else by_column[self.tasks[0].column]
            )
        return dense, ids if n else ids.reshape(self._ids, 0), labels

    def _task_uniforms(self, split: str, index: int, lo: int, hi: int) -> np.ndarray:
        """One uniform per row for the conversion draw, from a stream of its own."""
        h = np.arange(lo, hi, dtype=np.uint32) ^ (self._key(split, index) ^ np.uint32(_CONVERSION_SALT))
        _fmix32(h, np.empty_like(h))
        h >>= np.uint32(8)
        return (h.astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-24)

    def _conversion_logit(self, signal: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """The planted logit of a conversion given a click (``signal``: the dense columns the
        click's logit reads, ``[d, n]``; ``weights``: the planted id weights), summed in a fixed
        order as the click's is."""
        logit = np.full(weights.shape[1], -5.5)
        for j in range(self.num_dense_features):
            logit += 1.5 * (signal[j] * self._dense_cv[j])
        scale = 3.0 / np.sqrt(len(self._sizes))
        for f, (first, k) in enumerate(zip(self._offsets, self._sizes)):
            total = weights[first].copy()
            for j in range(1, k):
                total += weights[first + j]
            logit += (scale * self._coef_cv[f]) * (total / np.float32(k))
        return logit

    def _zipf_rows(self, u: np.ndarray) -> np.ndarray:
        """Table rows from uniforms ``u`` (float32 ``[ids, n]``, consumed): per id column, the
        inverse CDF of the continuous power law on [1, n+1) of its table's size gives a
        popularity rank (0 = hottest), scattered over the table by a bijection. This is the
        generator's hot loop: a few id columns at a time, so that its temporaries stay in
        the CPU's cache (all at once, they take 3 times as long)."""
        out = np.empty(u.shape, np.int64)
        step = max(1, _BLOCK // max(1, u.shape[1]))
        for c in range(0, u.shape[0], step):
            out[c : c + step] = self._zipf_block(u[c : c + step], slice(c, c + step))
        return out

    def _zipf_block(self, u: np.ndarray, columns: slice) -> np.ndarray:
        a, n = self.zipf_exponent, self._column_rows[columns]
        if abs(a - 1.0) < 1e-9:  # (n + 1)^u
            u *= self._log2_rows[columns]
            x = portable.exp2_f32(u)
        else:  # (1 + u ((n + 1)^(1 - a) - 1))^(1 / (1 - a))
            u *= self._zipf_scale[columns]
            u += np.float32(1)
            x = portable.log2_f32(u)
            x *= np.float32(1 / (1 - a))
            x = portable.exp2_f32(x)
        rank = x.astype(np.uint64)
        rank -= np.uint64(1)
        np.minimum(rank, n - np.uint64(1), out=rank)
        rank *= np.uint64(_SCATTER)  # < 2**64: rank < 2**32 and _SCATTER < 2**32
        rank %= n
        return rank.view(np.int64)

    def _planted_weights(self, ids: np.ndarray) -> np.ndarray:
        """A fixed pseudo-random weight in [-1, 1) per (feature, id): an integer hash, every
        id column at once (float32, shaped like ``ids``)."""
        h = ids.astype(np.uint32)
        h *= np.uint32(0x9E3779B1)
        h += self._feature_salt
        w = _fmix32(h).astype(np.float32)
        w *= np.float32(2.0**-31)
        w -= np.float32(1)
        return w

    def rows(self, split: str, index: int, lo: int, hi: int) -> Rows:
        dense, ids, labels = self._arrays(split, index, lo, hi)
        if self._one_hot:  # [F, n]: the batch's id array as it is
            return Rows.one_hot(dense, ids, labels)
        n = hi - lo
        return Rows.of(
            dense,
            [
                (np.ascontiguousarray(ids[first : first + k].T).reshape(-1), np.full(n, k, np.int32))
                for first, k in zip(self._offsets, self._sizes)
            ],
            labels,
        )

    def device_rows(self, device: torch.device, graph: bool = False) -> DeviceRows:
        """``rows`` drawn by torch on ``device``, the same bytes (``synthetic_device``); ``graph``:
        replayed from a CUDA graph (a GPU only)."""
        from hybridrec.data.synthetic_device import DeviceGenerator

        return DeviceGenerator(self, device, _SCATTER, graph).rows

    # -- the Source contract ---------------------------------------------------------------
    def num_batches(self, split: str) -> Optional[int]:
        return {"eval": self.eval_batches, "valid": self.valid_batches}.get(split)  # train: endless

    def read(self, split: str, epoch: int, index: int, lo: int, hi: int) -> Rows:
        return self.rows(split, index, lo, hi)

    def report(self) -> None:
        """Nothing is read from files: no read report."""
        return None

    def raw_inputs(self) -> RawInputs:
        """A generated row is already what the model reads: dense columns ``dense_<j>`` as
        drawn, and each feature's ids (column ``cat_<i>``, its name) already table rows."""
        row = {"kind": "row", "outside": "error"}  # the generator never draws a row outside its table
        return RawInputs(
            doc=f"a synthetic row: columns dense_0 .. dense_{self.num_dense_features - 1} (float, as generated) and, "
            f"per sparse feature, its table rows (cat_<i>: one id, or a list of "
            f"data.multi_hot_sizes[i] ids)",
            dense=[dense_input(f"dense_{j}", []) for j in range(self.num_dense_features)],
            sparse=[
                sparse_input(
                    f.name, f.name, f.table_name, f.num_embeddings, f.pooling, row, "one id" if k == 1 else "list"
                )
                for f, k in zip(self.features, self._sizes)
            ],
        )
