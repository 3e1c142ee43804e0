"""Next-item data: each user's history in time order, split leave-one-out.

A user's interactions, sorted by timestamp (ties in the order the file gives them: a stable
sort), are one sequence of item ids. Leave-one-out, as SASRec and HSTU are evaluated: the
last item is the user's test target (``eval``), the one before it the validation target
(``valid``), and the rest is the training sequence, in which every item is the target of the
items before it. Users with fewer than three interactions have no training transition and
are left out (counted in the read report). One row per user in the evaluated splits; in
training, ``train_windows`` decides: ``last`` (SASRec's original sampler) one row per user,
its newest ``max_length + 1`` training items, so a longer history's older items are never
targets; ``all``, the training sequence cut from its end into windows of ``max_length + 1``
items (each window's first item is the previous window's last target), so every training
item is a target once per epoch (on MovieLens-100k at 50 items: 2,412 rows instead of 943,
and all 97,171 transitions instead of 40% of them); ``overlap``, windows every
``max_length / 2`` items, each training its newer half only (the older half is context, its
``next`` ids 0), so a target sees at least half a window before it (4,320 rows).

A row's batch (``Rows``) has three sparse features, all looked up in one item table:
``history``, the row's most recent items (at most ``max_length``, oldest first: jagged, no
padding), ``next``, the target of each history position (training: the history shifted by
one; an evaluated split: the held-out item), and ``negatives``, ids for the loss to score
against, carried in the first row of each rank's slice only: training, ``train_negatives``
ids drawn per global batch from the seed (every rank draws the same ones; 0 = every item of
the catalogue, a full softmax); an evaluated split, every item of the catalogue, which the
model ranks for each user. ``RecBatch.times`` holds each history item's timestamp.

Item ids are table rows 1..N-1 (row 0: no item). Two sources: ``MovieLensSequences``
(data=movielens_seq: MovieLens' ratings as histories) and ``ParquetSequences`` (a team's own
histories: one row per user with a list column of item ids and an optional one of
timestamps). Both can make their batches on the training device (``data.device_input``,
``hybridrec.data.sequences_device``): the same bytes, gathered from the histories kept there.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, ClassVar, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from omegaconf import DictConfig

from hybridrec.config import BadRows
from hybridrec.data import DataError, ReadReport, SparseFeature, portable
from hybridrec.data.criteo.common import resolve_paths
from hybridrec.data.parquet.hashing import hash_ints
from hybridrec.data.rows import SEQUENCE_FIELDS, Rows
from hybridrec.data.source import Source

if TYPE_CHECKING:
    from hybridrec.data.sequences_device import SequencesOnDevice

FEATURES = ("history", "next", "negatives")
TABLE = "t_items"  # a ModuleDict key: not one of its method names ("items")


class NextItemSource(Source):
    """What every next-item source shares: the leave-one-out split of its sequences, rows of
    one user each, the negatives a batch carries. A subclass reads its data and calls
    ``_sequences(users, items, times)``."""

    next_item: ClassVar[bool] = True
    extra_fields = SEQUENCE_FIELDS
    per_rank_report = False

    @classmethod
    def check_config(cls, cfg: DictConfig, world_size: int) -> None:
        if cfg.max_length < 1:
            raise ValueError(f"data.max_length={cfg.max_length}: the most recent items a history keeps, >= 1")
        if cfg.train_negatives < 0:
            raise ValueError(
                f"data.train_negatives={cfg.train_negatives}: ids drawn per batch for the loss, "
                f">= 0 (0 = every item: a full softmax)"
            )

    def __init__(
        self,
        batch_size: int,
        max_length: int,
        train_negatives: int,
        negative_sampling: str,
        eval_batches: Optional[int],
        seed: int,
        train_windows: str = "last",
    ) -> None:
        self.batch_size, self.max_length, self.eval_batches, self.seed = batch_size, max_length, eval_batches, seed
        self.train_windows = str(getattr(train_windows, "value", train_windows))
        if self.train_windows not in ("last", "all", "overlap"):
            raise DataError(f"data.train_windows={self.train_windows}: last, all or overlap")
        self.train_negatives, self.negative_sampling = (
            train_negatives,
            str(getattr(negative_sampling, "value", negative_sampling)),
        )
        if self.negative_sampling not in ("uniform", "popularity"):
            raise DataError(f"data.negative_sampling={self.negative_sampling}: uniform or popularity")
        self.num_dense_features = 0
        self.splits = ("train", "valid", "eval")
        self._report = ReadReport()

    # -- the sequences ---------------------------------------------------------------------
    def _sequences(
        self, users: np.ndarray, items: np.ndarray, times: np.ndarray, source: str, catalogue: Optional[int] = None
    ) -> None:
        """Every user's items in time order (a stable sort: ties keep the file's order), as
        one flat array with each user's start (``offsets``); ``items`` are table rows >= 1,
        of a table of ``catalogue`` rows (default: the largest id + 1)."""
        order = np.lexsort((times, users))  # by user, then time; stable for equal (user, time)
        users, self.items, self.times = users[order], items[order].astype(np.int64), times[order].astype(np.int64)
        starts = np.flatnonzero(np.r_[True, users[1:] != users[:-1]]) if len(users) else np.zeros(0, np.int64)
        offsets = np.r_[starts, len(users)].astype(np.int64)
        lengths = np.diff(offsets)
        keep = lengths >= 3  # a training transition, a validation and a test target
        if not keep.any():
            raise DataError(
                f"{source}: no user has 3 interactions or more (a training transition, a validation and a test target)"
            )
        self.short_users = int((~keep).sum())
        self.user_ids = users[starts[keep]]
        self.starts, self.ends = offsets[:-1][keep], offsets[1:][keep]
        self.catalogue = catalogue or int(self.items.max()) + 1  # table rows; row 0 is no item
        if self.train_negatives > self.catalogue - 1:
            # drawn with replacement, the surplus would only repeat items: a softmax over more
            # ids than the catalogue has is a slower, noisier full softmax
            raise DataError(
                f"data.train_negatives={self.train_negatives} draws more ids per batch than {source}'s "
                f"catalogue has items ({self.catalogue - 1:,}): lower it, or set 0 to score every item"
            )
        self.window_begins, self.window_ends, self.window_context = self._windows()
        # The popularity of each item among the training parts (the items before the last two).
        train = np.concatenate([self.items[s : e - 2] for s, e in zip(self.starts, self.ends)])
        counts = np.bincount(train, minlength=self.catalogue).astype(np.float64)
        counts[0] = 0
        self.popularity = counts / counts.sum()
        self.log_q = portable.ln(np.maximum(self.popularity, 1e-12))
        users_n = len(self.starts)
        mean_train = float(np.mean(self.window_ends - self.window_begins - 1))
        negatives = self.train_negatives or self.catalogue - 1
        self.features = [
            SparseFeature("history", self.catalogue, max(mean_train, 1.0), table=TABLE),
            SparseFeature("next", self.catalogue, max(mean_train, 1.0), table=TABLE),
            # the negatives travel in the first row of a rank's slice: per row, a share of them
            SparseFeature("negatives", self.catalogue, max(1.0, negatives / max(1, self.batch_size)), table=TABLE),
        ]
        if users_n < self.batch_size:
            raise DataError(
                f"{source}: {users_n} users with 3 interactions or more, fewer than one global batch "
                f"(data.batch_size={self.batch_size}): one row per user and step"
            )

    def _windows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The training rows, as [begin, end) ranges of ``items``: windows of at most
        ``max_length + 1`` items of each user's training part (its items before the last two),
        the newest first, each ending ``stride`` targets before its predecessor's end, so no
        transition is lost; ``last`` keeps each user's newest window only. With ``overlap``
        (a stride of half the window) each window's first targets are its successor's too:
        they are context only, as many per row as the third array says (0 for ``last`` and
        ``all``). Per user in user order."""
        end = self.ends - 2  # the training part: items[start:end], at least one item
        span = self.max_length  # the transitions a window holds
        stride = -(-span // 2) if self.train_windows == "overlap" else span  # the targets a window owns
        if self.train_windows == "last":
            count = np.ones(len(end), np.int64)
        else:  # ceil(transitions / stride), at least one row (a user with one training item)
            count = np.maximum(1, -(-(end - self.starts - 1) // stride))
        user = np.repeat(np.arange(len(end)), count)
        k = _positions(count)  # 0 = the newest window
        ends = end[user] - k * stride
        begins = np.maximum(self.starts[user], ends - span - 1)
        return begins, ends, np.maximum(0, ends - begins - 1 - stride)

    @property
    def train_rows(self) -> int:
        return len(self.window_ends)

    def sampler_log_q(self, in_batch: bool) -> Optional[torch.Tensor]:
        """log P(item) under the training negatives' sampler: popularity sampling and in-batch
        negatives (the batch's next items, distributed like the interactions) follow the
        training popularity; uniform sampling and the full softmax need no correction."""
        if self.negative_sampling == "popularity" or in_batch:
            return torch.from_numpy(self.log_q)
        return None

    @property
    def users(self) -> int:
        return len(self.starts)

    def report(self) -> dict:
        out = self._report.to_dict()
        out["users_left_out"] = self.short_users  # fewer than 3 interactions: nothing to train or hold out
        return out

    # -- the Source contract ---------------------------------------------------------------
    def num_batches(self, split: str) -> int:
        """Train: whole global batches of training rows (the rest of an epoch dropped, and
        counted); evaluated splits: every user, the last batch padded."""
        return self.train_rows // self.batch_size if split == "train" else -(-self.users // self.batch_size)

    def begin_pass(self, split: str, epoch: int) -> None:
        if split == "train":
            self._report.dropped_tail_rows["train"] = self.train_rows % self.batch_size

    def _order(self, split: str, epoch: int) -> np.ndarray:
        """The rows of a pass: users, or training's windows reshuffled every epoch from the seed."""
        if split != "train":
            return np.arange(self.users)
        return np.random.default_rng([self.seed, 11, epoch]).permutation(self.train_rows)

    def read(self, split: str, epoch: int, index: int, lo: int, hi: int) -> Rows:
        order = self._order(split, epoch)
        first = index * self.batch_size
        train = split == "train"
        rows = order[first + lo : min(first + hi, len(order))]
        if train:  # a window: its history and, one further, its targets
            begins, ends, context = self.window_begins[rows], self.window_ends[rows], self.window_context[rows]
        else:
            ends = self.ends[rows] - {"valid": 2, "eval": 1}[split]  # the items before the target
            begins = np.maximum(self.starts[rows], ends - self.max_length)
        lengths = ends - begins
        seq = _gather(self.items, begins, lengths)
        seq_times = _gather(self.times, begins, lengths)
        if train:  # history = seq[:-1], next = seq[1:], per row
            hist_len = lengths - 1
            hist = _drop_each(seq, lengths, last=True)
            nxt = _drop_each(seq, lengths, last=False)
            nxt[_positions(hist_len) < np.repeat(context, hist_len)] = 0  # context only: no target
            times = _drop_each(seq_times, lengths, last=True)
            next_len = hist_len
        else:
            hist_len, hist, times = lengths, seq, seq_times
            nxt = self.items[ends]  # the held-out item, one per row
            next_len = np.ones(len(rows), np.int64)
        n = len(rows)
        negatives = self._negatives(split, epoch, index) if n else np.zeros(0, np.int64)
        neg_len = np.zeros(n, np.int64)
        if n:
            neg_len[0] = len(negatives)
        padded_times = np.zeros((n, self.max_length), np.int64)
        padded_times[np.repeat(np.arange(n), hist_len), _positions(hist_len)] = times
        return Rows.of(
            np.zeros((n, 0), np.float32),
            [(hist, hist_len), (nxt, next_len), (negatives, neg_len)],
            np.zeros(n, np.float32),
            {"times": padded_times},
        )

    def device_rows(self, device: torch.device) -> "SequencesOnDevice":
        """``read``'s rows, made on ``device`` from the histories kept there (``sequences_device``)."""
        from hybridrec.data.sequences_device import SequencesOnDevice

        return SequencesOnDevice(self, device)

    def _negatives(self, split: str, epoch: int, index: int) -> np.ndarray:
        """The ids the loss scores against: an evaluated split, every item (ranked); training,
        ``train_negatives`` ids drawn for global batch ``index`` of ``epoch`` (the same on every
        rank and for every world size), uniformly or by training popularity; 0 = every item."""
        if split != "train" or not self.train_negatives:
            return np.arange(1, self.catalogue, dtype=np.int64)
        rng = np.random.default_rng([self.seed, 13, epoch, index])
        if self.negative_sampling == "popularity":
            return rng.choice(self.catalogue, self.train_negatives, p=self.popularity).astype(np.int64)
        return rng.integers(1, self.catalogue, self.train_negatives).astype(np.int64)


def _gather(values: np.ndarray, begins: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``values[begins[i] : begins[i] + lengths[i]]`` of every i, one after the other."""
    if not len(lengths) or not lengths.sum():
        return np.zeros(0, values.dtype)
    return values[np.repeat(begins - np.r_[0, np.cumsum(lengths)[:-1]], lengths) + np.arange(lengths.sum())]


def _positions(lengths: np.ndarray) -> np.ndarray:
    """0 .. length-1 of every segment, one after the other."""
    total = int(lengths.sum())
    return np.arange(total) - np.repeat(np.r_[0, np.cumsum(lengths)[:-1]], lengths) if total else np.zeros(0, int)


def _drop_each(values: np.ndarray, lengths: np.ndarray, last: bool) -> np.ndarray:
    """Each segment without its last item (``last``) or its first."""
    position = _positions(lengths)
    keep = position < np.repeat(lengths - 1, lengths) if last else position > 0
    return values[keep]


class MovieLensSequences(NextItemSource):
    """data=movielens_seq: MovieLens-100k's ratings (``u.data``: user, item, rating, time),
    every rating an interaction, as each user's history (``make data-movielens``)."""

    def __init__(
        self,
        batch_size: int,
        path: str,
        max_length: int,
        train_negatives: int,
        negative_sampling: str,
        bad_rows: BadRows,
        eval_batches: Optional[int],
        seed: int,
        train_windows: str = "last",
    ) -> None:
        from hybridrec.data.movielens import _IDS, RATING_SCALE, read_table

        super().__init__(batch_size, max_length, train_negatives, negative_sampling, eval_batches, seed, train_windows)
        ratings = os.path.join(path, "u.data")
        if not os.path.isfile(ratings):
            raise DataError(f"data.path={path}: no u.data there (run `make data-movielens`)")
        user, item, _, ts = read_table(
            ratings,
            "\t",
            4,
            range(4),
            {0: _IDS, 1: _IDS, 2: RATING_SCALE},
            BadRows(bad_rows) == BadRows.fail,
            self._report,
        )
        self._sequences(user, item, ts, ratings)


class ParquetSequences(NextItemSource):
    """data=parquet_seq: a team's own histories, one row per user, in Parquet: ``items_column``
    a list of item ids (oldest first, or ordered by ``times_column``, a list of timestamps of
    the same length), ids used as table rows (``id_mapping: none``, ids 1..num_items-1) or
    hashed into ``num_items - 1`` rows (``hash``, seeded by ``hash_seed``). A row whose lists
    do not fit (a null, an id outside the table, lists of different lengths, a non-finite
    time) costs that row only, counted with file:row (``bad_rows=fail``: the run stops)."""

    def __init__(
        self,
        batch_size: int,
        path: str,
        items_column: str,
        num_items: int,
        max_length: int,
        train_negatives: int,
        negative_sampling: str,
        bad_rows: BadRows,
        eval_batches: Optional[int],
        seed: int,
        times_column: Optional[str] = None,
        id_mapping: str = "none",
        hash_seed: int = 0,
        train_windows: str = "last",
    ) -> None:
        super().__init__(batch_size, max_length, train_negatives, negative_sampling, eval_batches, seed, train_windows)
        fail, mapping = BadRows(bad_rows) == BadRows.fail, str(getattr(id_mapping, "value", id_mapping))
        users, items, times = [], [], []
        user = empty = 0
        for file in resolve_paths(path, "data.path", "*.parquet"):
            try:
                table = pq.read_table(file, columns=[c for c in (items_column, times_column) if c])
            except (OSError, pa.ArrowInvalid, KeyError) as e:
                raise DataError(
                    f"{file} (data.path): not readable as Parquet with column {items_column!r}"
                    f"{f' and {times_column!r}' if times_column else ''} ({str(e).splitlines()[0]})"
                ) from None
            for i, row in enumerate(self._rows(table, items_column, times_column, file)):
                ids, ts, why = row
                if why is None and mapping == "hash":
                    ids = (hash_ints(ids, hash_seed) % np.uint64(num_items - 1)).astype(np.int64) + 1
                elif why is None and len(ids) and (ids.min() < 1 or ids.max() >= num_items):
                    bad = ids[(ids < 1) | (ids >= num_items)][0]
                    why = f"{items_column}: id {bad} is outside the table's rows 1..{num_items - 1} (id_mapping=none)"
                if why is not None:
                    if fail:
                        raise DataError(f"{file}:{i}: {why} (data.bad_rows=fail)")
                    self._report.bad(file, i, why)
                    continue
                self._report.good(file, 1)
                if len(ids) == 0:  # an empty history: a user with nothing to train or hold out
                    empty += 1
                    continue
                users.append(np.full(len(ids), user))
                items.append(ids)
                times.append(ts)
                user += 1
        if not users:
            raise DataError(f"data.path={path}: no usable history")
        self._sequences(np.concatenate(users), np.concatenate(items), np.concatenate(times), path, num_items)
        self.short_users += empty  # left out like the histories of 1 or 2 items, and counted with them

    @staticmethod
    def _rows(table: pa.Table, items_column: str, times_column: Optional[str], file: str) -> Any:
        """Per row: (ids, times, None), or (None, None, why) for a row that does not fit."""
        ids_col = table.column(items_column).combine_chunks()
        if not (pa.types.is_list(ids_col.type) or pa.types.is_large_list(ids_col.type)) or not pa.types.is_integer(
            ids_col.type.value_type
        ):
            raise DataError(f"{file}: column {items_column!r} is {ids_col.type}, expected a list of integer ids")
        times_col = table.column(times_column).combine_chunks() if times_column else None
        for i in range(len(ids_col)):
            if not ids_col[i].is_valid:
                yield None, None, f"{items_column} is null"
                continue
            values = ids_col[i].values
            if values.null_count:
                yield None, None, f"{items_column} has a null id"
                continue
            ids = np.asarray(values.to_numpy(zero_copy_only=False), np.int64)
            if times_col is None:
                yield ids, np.arange(len(ids), dtype=np.int64), None
                continue
            if not times_col[i].is_valid or times_col[i].values.null_count:
                yield None, None, f"{times_column} is null"
                continue
            ts = np.asarray(pc.cast(times_col[i].values, pa.float64()), np.float64)
            if len(ts) != len(ids):
                yield None, None, f"{times_column} has {len(ts)} times for {len(ids)} ids"
            elif not np.isfinite(ts).all():
                yield None, None, f"{times_column} holds a time that is not finite"
            else:
                yield ids, ts.astype(np.int64), None
