"""MovieLens-100k in its official layout (``make data-movielens`` writes it offline).

``u.data``: user, item, rating, timestamp (tab-separated); optional ``u.user``
(id|age|gender|occupation|zip) and ``u.item`` (id|title|release date|video date|url|19 genre
flags). Sparse features: user, item, and with the side files age bucket, gender, occupation,
zip prefix and genres (multi-hot). Dense features: age and release year, scaled. Label: rating
>= ``label_threshold``. The eval split is a fixed random 20% (from the seed) or the latest 20%
by time. 100k ratings fit in memory: train rows are reshuffled every epoch from the seed.

``MovieLensRank`` (data=movielens_rank) serves the same ratings as per-user lists for
learning to rank and retrieval. Both yield ``RecBatch``: the rating as graded relevance, the
user as query id, and each item's training frequency for the log-q correction.
``MovieLens`` can make its batches on the training device (``data.device_input``,
``hybridrec.data.movielens_device``): the same bytes, gathered from the ratings kept there.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import torch
from omegaconf import DictConfig

from hybridrec.config import BadRows, EvalItems, NegativeSampling, SplitKind
from hybridrec.data import DataError, ReadReport, RecBatch, SparseFeature, portable, shorten
from hybridrec.data.raw_inputs import RawInputs, dense_input, join, sparse_input
from hybridrec.data.source import RANKING_FIELDS, Rows, UserItemSource

if TYPE_CHECKING:
    from hybridrec.data.movielens_device import RatingsOnDevice

GENRES = 19
RATING_SCALE = (1, 5)  # MovieLens' stars
# Ids start at 1: row 0 of the user and item tables is the "no such user/item" input of the
# catalogue and user exports. At most int32's largest: the tables are indexed with int32.
_IDS = (1, 2**31 - 1)
COLUMN_NAMES = {0: "user id", 1: "item id", 2: "rating"}
_AGE_EDGES = [18, 25, 35, 45, 50, 56]  # the MovieLens-1M age buckets


def read_table(
    path: str,
    sep: str,
    columns: int,
    numeric,
    ranges: Optional[dict[int, tuple[int, int]]],
    fail: bool,
    report: ReadReport,
) -> list[np.ndarray]:
    """A MovieLens file's columns (int64 where ``numeric``, else str), bad rows counted or
    failing: a wrong number of fields, a non-integer where an integer belongs, or an
    integer outside its column's ``ranges`` (inclusive)."""
    if not os.path.isfile(path):
        raise DataError(f"{path} is missing (side files need u.user and u.item; or data.side_features=false)")

    fatal: list[str] = []

    def wrong_fields(row: pacsv.InvalidRow) -> str:
        # PyArrow swallows exceptions raised here: record, and let the reader stop.
        reason = f"{row.actual_columns} fields, expected {row.expected_columns}"
        if fail:
            fatal.append(f"{path}:{row.number}: {reason}")
            return "error"
        report.bad(path, row.number, reason)
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
    reasons = {
        int(i): "non-integer in an integer field: " + "|".join(shorten(table.column(j)[i]) for j in numeric)
        for i in np.flatnonzero(~ok)
    }
    for j, (lo, hi) in (ranges or {}).items():
        value = np.asarray(pc.cast(pc.if_else(pa.array(ok), table.column(j), "0"), pa.int64()))
        outside = ok & ((value < lo) | (value > hi))
        for r in np.flatnonzero(outside):
            reasons[int(r)] = f"{COLUMN_NAMES.get(j, f'field {j + 1}')} {value[r]} is outside {lo}..{hi}"
        ok &= ~outside
    for i in sorted(reasons):
        if fail:
            raise DataError(f"{path}:{i + 1}: {reasons[i]}")
        report.bad(path, i + 1, reasons[i])  # (line numbers assume no skipped rows)
    report.good(path, int(ok.sum()))
    table = table.filter(pa.array(ok))
    return [
        np.asarray(pc.cast(table.column(j), pa.int64()))
        if j in numeric
        else np.array(table.column(j).to_pylist(), dtype=object)
        for j in range(columns)
    ]


class MovieLens(UserItemSource):
    extra_fields = RANKING_FIELDS

    def __init__(
        self,
        batch_size: int,
        path: str,
        label_threshold: float,
        split: SplitKind,
        eval_fraction: float,
        side_features: bool,
        bad_rows: BadRows,
        eval_batches: Optional[int],
        seed: int,
        valid_fraction: float = 0.0,
    ) -> None:
        ratings_path = os.path.join(path, "u.data")
        if not os.path.isfile(ratings_path):
            raise DataError(f"data.path={path}: no u.data there (run `make data-movielens`)")
        self.batch_size, self.seed, self.eval_batches = batch_size, seed, eval_batches
        self.fail = BadRows(bad_rows) == BadRows.fail
        self._report = ReadReport()
        self._epoch: Optional[int] = None  # _order is drawn once per epoch, when first read
        self._order = np.zeros(0, dtype=np.int64)
        user, item, rating, ts = self._read_table(
            ratings_path, "\t", 4, numeric=range(4), ranges={0: _IDS, 1: _IDS, 2: RATING_SCALE}
        )
        if len(user) == 0:
            raise DataError(f"{ratings_path}: no valid rating")
        self.user, self.item, self.rating, self.threshold = user, item, rating.astype(np.float32), label_threshold
        self.label = (rating >= label_threshold).astype(np.float32)
        self.side_features = side_features
        self.features = [SparseFeature("user", int(user.max()) + 1), SparseFeature("item", int(item.max()) + 1)]
        self.num_dense_features = 1  # a bias input when there are no side files
        if side_features:
            users = self._read_table(os.path.join(path, "u.user"), "|", 5, numeric=[0, 1])
            items = self._read_table(os.path.join(path, "u.item"), "|", 5 + GENRES, numeric=[0, *range(5, 5 + GENRES)])
            self._side(users, items, user, item)
            self.features += [SparseFeature(name, size) for name, size in self.side_sizes.items()]
            mean_genres = float(np.mean([len(self.item_genres[i]) for i in item]))
            self.features.append(SparseFeature("genres", GENRES, mean_genres))
            self.num_dense_features = 2  # age and release year
        if not 0 <= valid_fraction < 1 or not 0 < eval_fraction < 1:
            raise DataError(
                f"data.eval_fraction must be in (0, 1) and data.valid_fraction in [0, 1), got "
                f"{eval_fraction} and {valid_fraction}"
            )
        self.valid_fraction = valid_fraction
        self.split_rows = self._split(split, eval_fraction, ts)
        self.splits = tuple(name for name in ("train", "valid", "eval") if name in self.split_rows)
        # log of each item's frequency among training rows: in-batch negatives are drawn
        # with this probability (the log-q correction of sampled softmax)
        counts = np.bincount(item[self.split_rows["train"]], minlength=int(item.max()) + 1)
        self.item_log_q = portable.ln(np.maximum(counts, 1) / max(len(self.split_rows["train"]), 1))

    def report(self) -> dict:
        return self._report.to_dict()

    # -- reading -----------------------------------------------------------------------
    def _read_table(
        self, path: str, sep: str, columns: int, numeric, ranges: Optional[dict[int, tuple[int, int]]] = None
    ) -> list[np.ndarray]:
        return read_table(path, sep, columns, numeric, ranges, self.fail, self._report)

    def _side(self, users, items, user, item) -> None:
        """Per-user and per-item side tables, from the user and item files."""
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
        self.user_age, self.item_year, self.item_genres = age, year, item_genres
        self.user_side = {
            "age": np.searchsorted(_AGE_EDGES, age, side="right"),
            "gender": gender,
            "occupation": job,
            "zip": zip3,
        }
        self.side_sizes = {
            "age": len(_AGE_EDGES) + 1,
            "gender": len(genders) + 1,
            "occupation": len(jobs) + 1,
            "zip": len(zips) + 1,
        }

    def _pair_features(self, user: np.ndarray, item: np.ndarray):
        """Dense features, (values, lengths) per sparse feature and the keys, for any
        (user, item) pairs: rated rows, sampled unrated items and catalogue scoring alike."""
        ones = np.ones(len(user), dtype=np.int32)
        ids = [(user, ones), (item, ones)]
        if not self.side_features:
            return np.ones((len(user), 1), dtype=np.float32), ids, ["user", "item"]
        ids += [(self.user_side[name][user], ones) for name in self.user_side]
        per_row = [self.item_genres[i] for i in item]
        ids.append(
            (
                np.concatenate(per_row) if per_row else np.zeros(0, np.int64),
                np.array([len(g) for g in per_row], dtype=np.int32),
            )
        )
        dense = np.stack([self.user_age[user] / 100.0, (self.item_year[item] - 1900.0) / 100.0], axis=1)
        return dense, ids, ["user", "item", *self.user_side, "genres"]

    def raw_inputs(self) -> RawInputs:
        """A raw row is a rating's ``user_id`` and ``item_id`` (u.data's ids). They are the
        user and item tables' rows; an id outside a table reads row 0, the row of no such user
        or item (the two-tower exports' input). The side features are looked up in two joins
        the export carries, made from u.user and u.item as training made them: per user the
        age (years, for the dense input) and the rows of its age bucket, gender, occupation
        and zip prefix; per item the release year and its genres; a user or item that the
        files lack has age 0 and rows 0, release year 1990 and no genres, as in training."""
        outside = {"kind": "row", "outside": "row_0"}
        sparse = [
            sparse_input(f.name, f"{f.name}_id", f.table_name, f.num_embeddings, f.pooling, outside, "one id")
            for f in self.features[:2]
        ]
        doc = "a rating's user_id and item_id (integers, u.data's ids)"
        if not self.side_features:
            return RawInputs(doc, [dense_input(None, [{"op": "constant", "value": 1.0}])], sparse)
        row = {"kind": "row", "outside": "error"}  # the joins hold table rows
        side = {f.name: f for f in self.features}
        sparse += [
            sparse_input(
                name,
                name,
                side[name].table_name,
                side[name].num_embeddings,
                side[name].pooling,
                row,
                "one id",
                join="users",
            )
            for name in self.user_side
        ]
        sparse.append(
            sparse_input(
                "genres", "genres", side["genres"].table_name, GENRES, side["genres"].pooling, row, "list", join="items"
            )
        )
        dense = [
            dense_input("age_years", [{"op": "standardize", "mean": 0.0, "std": 100.0}], join="users"),
            dense_input("release_year", [{"op": "standardize", "mean": 1900.0, "std": 100.0}], join="items"),
        ]
        users = pa.table(
            {
                "user_id": np.arange(len(self.user_age), dtype=np.int64),
                "age_years": self.user_age.astype(np.float64),
                **{name: rows.astype(np.int64) for name, rows in self.user_side.items()},
            }
        )
        items = pa.table(
            {
                "item_id": np.arange(len(self.item_year), dtype=np.int64),
                "release_year": self.item_year.astype(np.float64),
                "genres": pa.array([g.tolist() for g in self.item_genres], pa.list_(pa.int64())),
            }
        )
        joins = [
            join(
                "users",
                "movielens_users.parquet",
                "user_id",
                {"age_years": 0.0, **{name: 0 for name in self.user_side}},
            ),
            join("items", "movielens_items.parquet", "item_id", {"release_year": 1990.0, "genres": None}),
        ]
        return RawInputs(
            doc, dense, sparse, joins, tables={"movielens_users.parquet": users, "movielens_items.parquet": items}
        )

    def _split(self, kind: SplitKind, fraction: float, ts: np.ndarray) -> dict[str, np.ndarray]:
        kind = SplitKind(kind)
        n = len(ts)
        order = (
            np.argsort(ts, kind="stable")
            if kind == SplitKind.time
            else np.random.default_rng([self.seed, 7]).permutation(n)
        )
        n_eval = int(round(n * fraction))
        rest = order[: n - n_eval]  # random order, or oldest first: validation is its tail
        n_valid = int(round(len(rest) * self.valid_fraction))
        train = rest[: len(rest) - n_valid]
        out = {"train": np.sort(train) if kind == SplitKind.random else train, "eval": order[n - n_eval :]}
        if n_valid:
            out["valid"] = rest[len(rest) - n_valid :]
        return out

    # -- batches -----------------------------------------------------------------------
    def _pairs_batch(self, user: np.ndarray, item: np.ndarray, rating: np.ndarray, weights: np.ndarray) -> RecBatch:
        return self._pairs_rows(user, item, rating, weights).batch(self.keys)

    def catalogue_batch(self) -> tuple[np.ndarray, RecBatch]:
        """Every movie of the ratings, each paired with user 0 (no such user): the input from
        which a two-tower model's item vectors are computed for nearest-neighbour search."""
        items = np.unique(self.item)
        none = np.zeros(len(items), dtype=np.int64)
        return items, self._pairs_batch(none, items, np.zeros(len(items), np.float32), np.ones(len(items)))

    def user_batch(self) -> tuple[np.ndarray, RecBatch]:
        """Every user of the ratings, each paired with item 0 (no such item): the input from
        which a two-tower model's user vectors are computed."""
        users = np.unique(self.user)
        none = np.zeros(len(users), dtype=np.int64)
        return users, self._pairs_batch(users, none, np.zeros(len(users), np.float32), np.ones(len(users)))

    def _pairs_rows(self, user: np.ndarray, item: np.ndarray, rating: np.ndarray, weights: np.ndarray) -> Rows:
        dense, ids, _ = self._pair_features(user, item)
        return Rows.of(
            dense,
            ids,
            (rating >= self.threshold).astype(np.float32),
            {"relevance": rating, "weights": weights, "query": user, "log_q": self.item_log_q[item]},
        )

    # -- the Source contract ---------------------------------------------------------------
    def num_batches(self, split: str) -> int:
        """Train: full global batches (the partial last one is dropped, and counted);
        evaluated splits: every row, the last batch padded."""
        rows = len(self.split_rows[split])
        return rows // self.batch_size if split == "train" else -(-rows // self.batch_size)

    def read(self, split: str, epoch: int, index: int, lo: int, hi: int) -> Rows:
        """Train: a new permutation of the train rows every epoch (from the seed). Evaluated
        splits: their rows in order."""
        rows_of = self.split_rows[split]
        if split == "train":
            rows_of = self._permutation(epoch)
        rows = rows_of[index * self.batch_size + lo : index * self.batch_size + hi]
        return self._pairs_rows(self.user[rows], self.item[rows], self.rating[rows], np.ones(len(rows)))

    def device_rows(self, device: torch.device) -> "RatingsOnDevice":
        """``read``'s rows, gathered on ``device`` from the ratings kept there (``movielens_device``)."""
        from hybridrec.data.movielens_device import RatingsOnDevice

        return RatingsOnDevice(self, device)

    def _permutation(self, epoch: int) -> np.ndarray:
        """The train rows in epoch ``epoch``'s order (kept for the epoch: not redrawn per batch)."""
        if self._epoch != epoch:
            self._epoch, self._order = (
                epoch,
                np.random.default_rng([self.seed, 11, epoch]).permutation(self.split_rows["train"]),
            )
        return self._order

    def begin_pass(self, split: str, epoch: int) -> None:
        if split == "train":
            self._report.dropped_tail_rows["train"] = len(self.split_rows["train"]) % self.batch_size


class MovieLensRank(MovieLens):
    """MovieLens as learning-to-rank data: query = user, documents = rated movies,
    relevance = rating.

    Each user's ``eval_fraction`` of ratings (random, or latest with split=time) is held out.
    Training: every epoch, each user's training ratings are shuffled and cut into lists of
    ``list_size`` (the remainder padded, weight 0), ``negatives`` unrated movies are sampled
    into every list (relevance 0), and the lists are shuffled; a global batch is
    ``batch_size / (list_size + negatives)`` whole lists, split over ranks by list. Eval: one
    list per user (held-out ratings + ``eval_negatives`` unrated movies, or every movie not
    rated in training), rows in user order; the last global batch is padded (weight 0)
    rather than cut, so every user's list is complete. Everything is a function of the seed
    and the global position: the same for any world size.
    """

    lists = True
    list_size: int  # always set (Source's is None for sources without lists)
    # No device path: each training list's unrated movies are drawn by NumPy's generator per
    # list, on the CPU (data.device_input=true is refused before launch, naming this class).
    device_rows = None  # type: ignore[assignment]  # the base's method, withdrawn: None = no device path

    @classmethod
    def check_config(cls, cfg: DictConfig, world_size: int) -> None:
        d = cfg
        if d.list_size < 1 or d.negatives < 0 or d.eval_negatives < 0 or d.ranking_k < 1:
            raise ValueError(
                "data.list_size and data.ranking_k must be >= 1, data.negatives and data.eval_negatives >= 0"
            )
        rows = d.list_size + d.negatives
        if d.batch_size % (rows * world_size):
            raise ValueError(
                f"data.batch_size={d.batch_size} must be a whole number of lists of "
                f"data.list_size + data.negatives = {rows} rows on each of the {world_size} rank(s) "
                f"(a multiple of {rows * world_size})"
            )

    def __init__(
        self,
        list_size: int,
        negatives: int,
        negative_sampling: NegativeSampling,
        eval_items: EvalItems,
        eval_negatives: int,
        ranking_k: int,
        **kwargs,
    ) -> None:
        self.list_items, self.negatives = list_size, negatives
        self._lists_epoch: Optional[int] = None  # the lists are drawn once per epoch, when first read
        self._epoch_lists_cache: list[tuple[int, np.ndarray]] = []
        self._dropped = 0  # rows of the lists that do not fill the epoch's last global batch
        self.negative_sampling = NegativeSampling(negative_sampling)
        self.eval_items = EvalItems(eval_items)
        self.eval_negatives, self.ranking_k = eval_negatives, ranking_k
        super().__init__(**kwargs)
        self.list_size = list_size + negatives  # rows per training list: what list losses reshape by
        if self.batch_size % self.list_size:
            raise DataError(f"data.batch_size={self.batch_size} is not a whole number of {self.list_size}-row lists")
        n_users, n_items = self.features[0].num_embeddings, self.features[1].num_embeddings
        self.rated = np.zeros((n_users, n_items), dtype=bool)  # negatives are unrated movies
        self.rated[self.user, self.item] = True
        self.catalogue = np.unique(self.item)  # movies that occur in the ratings
        self.short_negatives = 0  # lists where fewer unrated movies than asked could be sampled
        self.eval_seen_in_train = 0  # catalogue eval: held-out ratings of movies the user also rated in training
        self.eval_rows = {split: self._eval_lists(split) for split in self.splits if split != "train"}

    def _split(self, kind: SplitKind, fraction: float, ts: np.ndarray) -> dict[str, np.ndarray]:
        """Per user: the latest (split=time) or a random ``fraction`` of their ratings."""
        kind = SplitKind(kind)
        rng = np.random.default_rng([self.seed, 7])
        train, valid, held = [], [], []
        for rows in self._user_rows(np.arange(len(self.user))):
            rows = rows[np.argsort(ts[rows], kind="stable")] if kind == SplitKind.time else rng.permutation(rows)
            n_eval = int(round(len(rows) * fraction))
            rest = rows[: len(rows) - n_eval]
            n_valid = int(round(len(rest) * self.valid_fraction))
            train.append(rest[: len(rest) - n_valid])
            valid.append(rest[len(rest) - n_valid :])
            held.append(rows[len(rows) - n_eval :])
        out = {"train": np.sort(np.concatenate(train)), "eval": np.sort(np.concatenate(held))}
        if self.valid_fraction:
            out["valid"] = np.sort(np.concatenate(valid))
        return out

    def _user_rows(self, rows: np.ndarray) -> list[np.ndarray]:
        """``rows`` grouped by user (users in id order, rows in their given order)."""
        rows = rows[np.argsort(self.user[rows], kind="stable")]
        return np.split(rows, np.flatnonzero(np.diff(self.user[rows])) + 1)

    def _eval_lists(self, split: str) -> dict[str, np.ndarray]:
        """(user, item, rating) of every row of an evaluated split, grouped by user."""
        rows = self.split_rows[split]
        rng = np.random.default_rng([self.seed, 13 if split == "eval" else 19])
        users, items, ratings = [], [], []
        train_rated = np.zeros_like(self.rated)
        train_rated[self.user[self.split_rows["train"]], self.item[self.split_rows["train"]]] = True
        for u in np.unique(self.user[rows]):
            mine = rows[self.user[rows] == u]
            if self.eval_items == EvalItems.catalogue:
                cand = self.catalogue[~train_rated[u, self.catalogue]]
                rating = np.zeros(len(cand), dtype=np.float32)
                unseen = ~train_rated[u, self.item[mine]]  # a movie rated again after training is no candidate
                self.eval_seen_in_train += int((~unseen).sum()) if split == "eval" else 0
                rating[np.searchsorted(cand, self.item[mine][unseen])] = self.rating[mine][unseen]
            else:
                negs = self._unrated(u, self.catalogue, self.eval_negatives, rng)
                cand = np.concatenate([self.item[mine], negs])
                rating = np.concatenate([self.rating[mine], np.zeros(len(negs), dtype=np.float32)])
            users.append(np.full(len(cand), u))
            items.append(cand)
            ratings.append(rating)
        return {"user": np.concatenate(users), "item": np.concatenate(items), "rating": np.concatenate(ratings)}

    def _unrated(self, user: int, pool: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
        """Up to k distinct movies from ``pool`` (distinct ids) that ``user`` has not rated."""
        if k == 0:
            return np.zeros(0, dtype=np.int64)
        cand = pool[~self.rated[user, pool]]
        if len(cand) < k:
            self.short_negatives += 1
            return cand
        return rng.choice(cand, size=k, replace=False)

    def _epoch_lists(self, epoch: int) -> list[tuple[int, np.ndarray]]:
        rng = np.random.default_rng([self.seed, 11, epoch])
        lists = []
        for rows in self._user_rows(self.split_rows["train"]):
            rows = rng.permutation(rows)
            lists += [
                (int(self.user[rows[0]]), rows[i : i + self.list_items]) for i in range(0, len(rows), self.list_items)
            ]
        return [lists[i] for i in rng.permutation(len(lists))]

    def _list_rows(self, lists: list[tuple[int, np.ndarray]], pool: np.ndarray, first: int, epoch: int) -> Rows:
        users, items, ratings, weights = [], [], [], []
        for j, (u, rows) in enumerate(lists):
            pad = self.list_items - len(rows)
            rng = np.random.default_rng([self.seed, 17, epoch, first + j])  # per list: rank-independent
            negs = self._unrated(
                u, pool if self.negative_sampling == NegativeSampling.batch else self.catalogue, self.negatives, rng
            )
            missing = self.negatives - len(negs)
            items.append(np.concatenate([self.item[rows], np.zeros(pad, np.int64), negs, np.zeros(missing, np.int64)]))
            ratings.append(np.concatenate([self.rating[rows], np.zeros(pad + self.negatives, np.float32)]))
            weights.append(np.concatenate([np.ones(len(rows)), np.zeros(pad), np.ones(len(negs)), np.zeros(missing)]))
            users.append(np.full(self.list_size, u))
        return self._pairs_rows(*(np.concatenate(a) for a in (users, items, ratings, weights)))

    # -- the Source contract ---------------------------------------------------------------
    def num_batches(self, split: str) -> int:
        """Train: full global batches of whole lists (the remaining lists are dropped and
        counted); evaluated splits: every row of every list, the last batch padded."""
        if split == "train":
            lists = sum(-(-len(r) // self.list_items) for r in self._user_rows(self.split_rows["train"]))
            return lists // (self.batch_size // self.list_size)  # lists per epoch do not depend on the shuffle
        return -(-len(self.eval_rows[split]["user"]) // self.batch_size)

    def read(self, split: str, epoch: int, index: int, lo: int, hi: int) -> Rows:
        if split != "train":
            e = self.eval_rows[split]
            at = slice(
                min(index * self.batch_size + lo, len(e["user"])), min(index * self.batch_size + hi, len(e["user"]))
            )
            return self._pairs_rows(e["user"][at], e["item"][at], e["rating"][at], np.ones(at.stop - at.start))
        per_batch = self.batch_size // self.list_size  # lists per global batch
        lists = self._lists(epoch)
        group = lists[index * per_batch : (index + 1) * per_batch]
        pool = np.unique(np.concatenate([self.item[r] for _, r in group]))  # the whole global batch's items
        first = lo // self.list_size
        return self._list_rows(group[first : hi // self.list_size], pool, index * per_batch + first, epoch)

    def _lists(self, epoch: int) -> list[tuple[int, np.ndarray]]:
        """Epoch ``epoch``'s training lists, kept for the epoch."""
        if self._lists_epoch != epoch:
            self._lists_epoch, self._epoch_lists_cache = epoch, self._epoch_lists(epoch)
            dropped = self._epoch_lists_cache[self.num_batches("train") * (self.batch_size // self.list_size) :]
            self._dropped = int(sum(len(r) for _, r in dropped))
        return self._epoch_lists_cache

    def begin_pass(self, split: str, epoch: int) -> None:
        if split == "train":  # the rows of the lists that do not fill the epoch's last batch
            self._lists(epoch)
            self._report.dropped_tail_rows["train"] = self._dropped

    def report(self) -> dict:
        report = super().report()
        report["short_negative_lists"] = self.short_negatives
        report["eval_ratings_seen_in_train"] = self.eval_seen_in_train
        return report
