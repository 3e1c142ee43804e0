"""MovieLens-100k in its official layout (``make data-movielens`` writes it offline).

``u.data``: user, item, rating, timestamp (tab-separated); optional ``u.user``
(id|age|gender|occupation|zip) and ``u.item`` (id|title|release date|video date|url|19 genre
flags). Sparse features: user, item, and with the side files age bucket, gender, occupation,
zip prefix and genres (multi-hot). Dense features: age and release year, scaled. Label: rating
>= ``label_threshold``. The eval split is a fixed random 20% (from the seed) or the latest 20%
by time. 100k ratings fit in memory: train rows are reshuffled every epoch from the seed.
"""

from __future__ import annotations

import os
from typing import Iterator, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
from torchrec.datasets.utils import Batch

from hybridrec.data import DataError, ReadReport, SparseFeature, make_batch, rank_rows

GENRES = 19
_AGE_EDGES = [18, 25, 35, 45, 50, 56]  # the MovieLens-1M age buckets


class MovieLens:
    def __init__(
        self,
        batch_size: int,
        path: str,
        label_threshold: float,
        split: str,
        eval_fraction: float,
        side_features: bool,
        bad_rows: str,
        eval_batches: Optional[int],
        seed: int,
    ) -> None:
        ratings_path = os.path.join(path, "u.data")
        if not os.path.isfile(ratings_path):
            raise DataError(f"data.path={path}: no u.data there (run `make data-movielens`)")
        self.batch_size, self.seed, self.eval_batches = batch_size, seed, eval_batches
        self.fail = getattr(bad_rows, "value", bad_rows) == "fail"
        self._report = ReadReport()
        user, item, rating, ts = self._read_table(ratings_path, "\t", 4, numeric=range(4))
        if len(user) == 0:
            raise DataError(f"{ratings_path}: no valid rating")
        self.label = (rating >= label_threshold).astype(np.float32)
        sparse = {"user": user, "item": item}
        sizes = {"user": int(user.max()) + 1, "item": int(item.max()) + 1}
        dense = [np.ones(len(user), dtype=np.float32)]  # a bias input when there are no side files
        if side_features:
            users = self._read_table(os.path.join(path, "u.user"), "|", 5, numeric=[0, 1])
            items = self._read_table(os.path.join(path, "u.item"), "|", 5 + GENRES, numeric=[0, *range(5, 5 + GENRES)])
            dense, side, side_sizes, genres = self._side(users, items, user, item)
            sparse.update(side)
            sizes.update(side_sizes)
            self.genres = genres
        self.dense = np.stack(dense, axis=1).astype(np.float32)
        self.sparse = sparse
        self.features = [SparseFeature(name, sizes[name]) for name in sparse]
        if side_features:
            mean_genres = float(np.mean([len(g) for g in self.genres[1]])) if len(self.genres[1]) else 1.0
            self.features.append(SparseFeature("genres", GENRES, mean_genres))
        self.num_dense_features = self.dense.shape[1]
        self.split_rows = self._split(split, eval_fraction, ts)

    def report(self) -> dict:
        return self._report.to_dict()

    # -- reading -----------------------------------------------------------------------
    def _read_table(self, path: str, sep: str, columns: int, numeric) -> list[np.ndarray]:
        """A MovieLens file's columns (int64 where ``numeric``, else str), bad rows counted or
        failing: a wrong number of fields, or a non-integer where an integer belongs."""
        if not os.path.isfile(path):
            raise DataError(f"{path} is missing (side files need u.user and u.item; or data.side_features=false)")

        fatal: list[str] = []

        def wrong_fields(row: pacsv.InvalidRow) -> str:
            # PyArrow swallows exceptions raised here: record, and let the reader stop.
            reason = f"{row.actual_columns} fields, expected {row.expected_columns}"
            if self.fail:
                fatal.append(f"{path}:{row.number}: {reason}")
                return "error"
            self._report.bad(path, row.number, reason)
            return "skip"

        names = [f"c{i}" for i in range(columns)]
        try:
            table = pacsv.read_csv(
                path,
                # MovieLens-100k is latin-1 (accented titles)
                read_options=pacsv.ReadOptions(column_names=names, encoding="latin-1", use_threads=False),
                parse_options=pacsv.ParseOptions(delimiter=sep, quote_char=False, invalid_row_handler=wrong_fields),
                convert_options=pacsv.ConvertOptions(column_types={n: pa.string() for n in names}),
            )
        except pa.ArrowInvalid as e:
            raise DataError(fatal[0] if fatal else f"{path}: {e}") from None
        ok = np.ones(table.num_rows, dtype=bool)
        for j in numeric:
            ok &= np.asarray(pc.match_substring_regex(table.column(j), r"^\d+$").combine_chunks())
        for i in np.flatnonzero(~ok):
            reason = "non-integer in an integer field: " + "|".join(str(table.column(j)[i]) for j in numeric)
            if self.fail:
                raise DataError(f"{path}:{int(i) + 1}: {reason}")
            self._report.bad(path, int(i) + 1, reason)  # (line numbers assume no skipped rows)
        self._report.good(path, int(ok.sum()))
        table = table.filter(pa.array(ok))
        return [
            np.asarray(pc.cast(table.column(j), pa.int64())) if j in numeric
            else np.array(table.column(j).to_pylist(), dtype=object)
            for j in range(columns)
        ]

    def _side(self, users, items, user, item):
        """Side features per rating, from the user and item files."""
        uid, ages, genders_col, jobs_col, zips_col = users
        n_users = max(int(uid.max()), int(user.max())) + 1
        age = np.zeros(n_users)
        age[uid] = ages
        vocab = lambda values: {v: i + 1 for i, v in enumerate(sorted(set(values)))}  # 0 = unknown
        genders, jobs = vocab(genders_col), vocab(jobs_col)
        zips = vocab(z[:3] for z in zips_col)
        gender, job, zip3 = (np.zeros(n_users, dtype=np.int64) for _ in range(3))
        gender[uid] = [genders[g] for g in genders_col]
        job[uid] = [jobs[o] for o in jobs_col]
        zip3[uid] = [zips[z[:3]] for z in zips_col]
        iid = items[0]
        n_items = max(int(iid.max()), int(item.max())) + 1
        year = np.full(n_items, 1990.0)  # unknown release dates: a neutral year
        year[iid] = [float(d[-4:]) if d and d[-4:].isdigit() else 1990.0 for d in items[2]]
        flags = np.stack(items[5:], axis=1) == 1
        item_genres = [np.zeros(0, dtype=np.int64)] * n_items
        for k, i in enumerate(iid):
            item_genres[i] = np.flatnonzero(flags[k])
        lengths = np.array([len(item_genres[i]) for i in item], dtype=np.int32)
        values = np.concatenate([item_genres[i] for i in item]) if len(item) else np.zeros(0, np.int64)
        dense = [age[user] / 100.0, (year[item] - 1900.0) / 100.0]
        side = {
            "age": np.searchsorted(_AGE_EDGES, age[user], side="right"),
            "gender": gender[user],
            "occupation": job[user],
            "zip": zip3[user],
        }
        sizes = {"age": len(_AGE_EDGES) + 1, "gender": len(genders) + 1,
                 "occupation": len(jobs) + 1, "zip": len(zips) + 1}
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        return dense, side, sizes, (offsets, [values[offsets[k]:offsets[k + 1]] for k in range(len(item))])

    def _split(self, kind: str, fraction: float, ts: np.ndarray) -> dict[str, np.ndarray]:
        kind = getattr(kind, "value", kind)
        n = len(ts)
        order = np.argsort(ts, kind="stable") if kind == "time" else np.random.default_rng([self.seed, 7]).permutation(n)
        n_eval = int(round(n * fraction))
        return {"train": np.sort(order[: n - n_eval]) if kind == "random" else order[: n - n_eval],
                "eval": order[n - n_eval :]}

    # -- batches -----------------------------------------------------------------------
    def _batch(self, rows: np.ndarray) -> Batch:
        ids = [(self.sparse[name][rows], np.ones(len(rows), dtype=np.int32)) for name in self.sparse]
        keys = list(self.sparse)
        if hasattr(self, "genres"):
            per_row = [self.genres[1][r] for r in rows]
            ids.append((np.concatenate(per_row) if per_row else np.zeros(0, np.int64),
                        np.array([len(g) for g in per_row], dtype=np.int32)))
            keys.append("genres")
        return make_batch(self.dense[rows], ids, self.label[rows], keys)

    def batches(
        self, split: str, rank: int, world_size: int, num_batches: Optional[int] = None, start: int = 0
    ) -> Iterator[Batch]:
        """Train: a new permutation of the train rows every epoch (from the seed). Eval: the
        eval rows in order, once. The partial last global batch is dropped and counted."""
        if num_batches is None and split == "eval":
            num_batches = self.eval_batches
        rows_of = self.split_rows[split]
        full = len(rows_of) // self.batch_size
        if full == 0:
            raise DataError(f"the {split} split has {len(rows_of)} rows, fewer than one global batch ({self.batch_size})")
        self._report.dropped_tail_rows[split] = len(rows_of) - full * self.batch_size
        mine = rank_rows(self.batch_size, rank, world_size)
        produced, epoch = start, start // full
        while True:
            order = rows_of if split == "eval" else np.random.default_rng([self.seed, 11, epoch]).permutation(rows_of)
            for b in range(start % full if produced == start else 0, full):
                yield self._batch(order[b * self.batch_size : (b + 1) * self.batch_size][mine])
                produced += 1
                if num_batches is not None and produced >= num_batches:
                    return
            if split == "eval":
                return
            epoch += 1
