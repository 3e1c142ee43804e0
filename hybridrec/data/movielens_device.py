"""MovieLens' ratings (``data=movielens``) made on the training device (``data.device_input``):
the bytes of ``MovieLens.read``, for every split (tested on the CPU, with and without the side
files, for 1 and 2 ranks, in tests/test_device_sources.py).

A batch is a gather of per-rating arrays: the ratings' user, item, rating and label, each
user's side ids and age and each movie's release year and genres are copied to the device once,
and a batch gathers its rows' values there by index. Each per-row value that ``read`` computes
in float64 and rounds to float32 (the dense inputs, ``log_q``) is computed once per user or
movie on the host, in the same operations, then rounded: the gathered float32 is that row's. The
host keeps the index arrays too and sizes each batch from them (the genres per row, the one
feature of several ids), so no kernel waits for a size read back from the device; it sends
each epoch's order of the training ratings (one array per epoch, through a reused pinned buffer,
``Staging``).

``MovieLensRank`` (data=movielens_rank) has no device path: each training list's unrated movies
are drawn by NumPy's generator per list, on the CPU.

No data checks here: ``read_table`` checks every rating, user and movie row as the files are
read, at construction, so the arrays copied to the device hold only rows that passed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, cast

import numpy as np
import torch

from hybridrec.data.device_input import Staging, gather_ranges, one_hot, resident
from hybridrec.data.rows import Rows

if TYPE_CHECKING:
    from hybridrec.data.movielens import MovieLens


class RatingsOnDevice:
    """``source.read``'s rows, made on ``device``: call it as ``(split, index, lo, hi, epoch)``."""

    def __init__(self, source: "MovieLens", device: torch.device) -> None:
        self.source, self.device = source, torch.device(device)

        def put(a: np.ndarray) -> torch.Tensor:
            return resident(a, self.device)

        self.user, self.item, self.rating = put(source.user), put(source.item), put(source.rating)
        # per rating, as read computes them from its rows (elementwise: a row's value is the same)
        self.label = put((source.rating >= cast(float, source.threshold)).astype(np.float32))  # always set here
        self.log_q = put(source.item_log_q.astype(np.float32))
        self.split_rows = {split: put(rows) for split, rows in source.split_rows.items() if split != "train"}
        self.side = source.side_features
        if self.side:
            self.user_dense = put((source.user_age / 100.0).astype(np.float32))
            self.item_dense = put(((source.item_year - 1900.0) / 100.0).astype(np.float32))
            self.user_side = [put(ids) for ids in source.user_side.values()]  # in read's order
            self.genre_count_host = np.array([len(g) for g in source.item_genres], np.int64)
            self.genre_count = put(self.genre_count_host)
            self.genre_first = put(np.cumsum(self.genre_count_host) - self.genre_count_host)
            self.genres = put(np.concatenate([np.asarray(g, np.int64) for g in source.item_genres]))
        self.staging = Staging(self.device)
        self._epoch: Optional[int] = None
        self._order = self.user[:0]

    def _rows(self, split: str, epoch: int) -> tuple[np.ndarray, torch.Tensor]:
        """The split's rows on the host and on the device: training's order drawn on the host
        (``MovieLens._permutation``) and copied once per epoch."""
        if split != "train":
            return self.source.split_rows[split], self.split_rows[split]
        order = self.source._permutation(epoch)
        if self._epoch != epoch:
            self._epoch, self._order = epoch, self.staging.put([order])[0]
        return order, self._order

    def __call__(self, split: str, index: int, lo: int, hi: int, epoch: int = 0) -> Rows:
        order_host, order = self._rows(split, epoch)
        first = index * self.source.batch_size
        rows_host, rows = order_host[first + lo : first + hi], order[first + lo : first + hi]
        n, device = len(rows_host), self.device
        user, item = self.user[rows], self.item[rows]
        ids = [user, item]
        totals = [n, n]
        lengths: Optional[torch.Tensor] = None
        if self.side:
            ids += [side[user] for side in self.user_side]
            genre_len_host = self.genre_count_host[self.source.item[rows_host]]
            genre_len = self.genre_count[item]
            total = int(genre_len_host.sum())
            ids.append(gather_ranges(self.genres, self.genre_first[item], genre_len, total))
            totals += [n] * len(self.user_side) + [total]
            if not one_hot([genre_len_host]):  # the other features have one id a row
                ones = torch.ones((len(ids) - 1, n), dtype=torch.int32, device=device)
                lengths = torch.cat([ones, genre_len.to(torch.int32)[None]])
            dense = torch.stack([self.user_dense[user], self.item_dense[item]], 1)
        else:
            dense = torch.ones((n, 1), dtype=torch.float32, device=device)
        return Rows(
            dense,
            torch.cat(ids),
            lengths,
            self.label[rows],
            len(ids),
            {
                "relevance": self.rating[rows],
                "weights": torch.ones(n, dtype=torch.float32, device=device),
                "query": user,
                "log_q": self.log_q[item],
            },
            totals=totals,
        )
