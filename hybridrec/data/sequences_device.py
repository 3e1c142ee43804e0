"""The next-item sources' batches made on the training device (``data.device_input``): the
bytes of ``NextItemSource.read``, for every split (tested on the CPU, for 1 and 2 ranks and
every ``data.train_windows``, in tests/test_device_sources.py).

Every user's items and times, each training window's [begin, end) range of them and each
user's, are copied to the device once; a batch is then index arithmetic there: its rows'
ranges gathered, a training window split into its history and its next items, the history's
times padded to ``max_length``. The host keeps the same index arrays and sizes each batch from
them (ids per feature, ``Rows.totals``), so no kernel waits for a size read back from the
device. What the host still sends: each epoch's order of the training windows (one array per
epoch), and a training batch's sampled negatives (``data.train_negatives`` ids, which NumPy's
generator draws per global batch), through reused pinned buffers (``Staging``); the whole
catalogue (an evaluated split's negatives, or ``train_negatives=0``) is made on the device once.

No data checks here: the sources check every row as they read their files, at construction
(an id outside the table, a time that is not finite, ...), so the arrays copied to the device
hold only rows that passed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from hybridrec.data.device_input import Staging, gather_ranges, one_hot, resident
from hybridrec.data.rows import Rows

if TYPE_CHECKING:
    from hybridrec.data.sequences import NextItemSource

_HELD_OUT = {"valid": 2, "eval": 1}  # an evaluated split's target: this many items from a history's end


class SequencesOnDevice:
    """``source.read``'s rows, made on ``device``: call it as ``(split, index, lo, hi, epoch)``."""

    def __init__(self, source: "NextItemSource", device: torch.device) -> None:
        self.source, self.device = source, torch.device(device)

        def put(a: np.ndarray) -> torch.Tensor:
            return resident(a, self.device)

        self.items, self.times = put(source.items), put(source.times)
        self.window_begins, self.window_ends = put(source.window_begins), put(source.window_ends)
        self.window_context = put(source.window_context)
        self.starts, self.ends = put(source.starts), put(source.ends)
        self.users = torch.arange(source.users, device=self.device)  # an evaluated split's rows, in order
        self.catalogue = torch.arange(1, source.catalogue, dtype=torch.int64, device=self.device)
        self.positions = torch.arange(source.max_length, device=self.device)
        self.staging = Staging(self.device)
        self._epoch: Optional[int] = None
        self._order = (np.zeros(0, np.int64), self.users[:0])

    def _rows(self, split: str, epoch: int) -> tuple[np.ndarray, torch.Tensor]:
        """The rows of a pass, on the host and on the device: training's order drawn on the host
        and copied once per epoch (``NextItemSource._order``)."""
        if split != "train":
            return np.arange(self.source.users), self.users
        if self._epoch != epoch:
            order = self.source._order("train", epoch)
            self._epoch, self._order = epoch, (order, self.staging.put([order])[0])
        return self._order

    def __call__(self, split: str, index: int, lo: int, hi: int, epoch: int = 0) -> Rows:
        s, device = self.source, self.device
        order_host, order = self._rows(split, epoch)
        first = index * s.batch_size
        at = slice(first + lo, min(first + hi, len(order_host)))
        rows_host, rows = order_host[at], order[at]
        n = len(rows_host)
        if split == "train":  # a window: its history and, one item further on, its targets
            hist_len_host = s.window_ends[rows_host] - s.window_begins[rows_host] - 1
            next_len_host = hist_len_host
            begins = self.window_begins[rows]
            hist_len = self.window_ends[rows] - begins - 1
            hist_total = int(hist_len_host.sum())
            hist = gather_ranges(self.items, begins, hist_len, hist_total)
            nxt = gather_ranges(self.items, begins + 1, hist_len, hist_total)
            if s.train_windows == "overlap":  # a window's context-only targets: id 0, no target
                row = torch.repeat_interleave(torch.arange(n, device=device), hist_len, output_size=hist_total)
                position = torch.arange(hist_total, device=device) - (torch.cumsum(hist_len, 0) - hist_len)[row]
                nxt = torch.where(position < self.window_context[rows][row], 0, nxt)
            next_len = hist_len
        else:  # the items before the held-out one (at most max_length), then the held-out one
            ends_host = s.ends[rows_host] - _HELD_OUT[split]
            hist_len_host = ends_host - np.maximum(s.starts[rows_host], ends_host - s.max_length)
            next_len_host = np.ones(n, np.int64)
            ends = self.ends[rows] - _HELD_OUT[split]
            begins = torch.maximum(self.starts[rows], ends - s.max_length)
            hist_len = ends - begins
            hist = gather_ranges(self.items, begins, hist_len, int(hist_len_host.sum()))
            nxt = self.items[ends]
            next_len = torch.ones(n, dtype=torch.int64, device=device)
        # the history's times, each row padded with 0 to max_length (a gather: no scatter)
        where = begins[:, None] + self.positions
        times = self.times[where.clamp(max=len(s.times) - 1)]
        times = torch.where(self.positions < hist_len[:, None], times, 0)
        negatives = self._negatives(split, epoch, index) if n else self.catalogue[:0]
        neg_len_host = np.zeros(n, np.int64)
        neg_len = torch.zeros(n, dtype=torch.int64, device=device)
        if n:  # carried in the first row of the rank's slice
            neg_len_host[0] = neg_len[0] = len(negatives)
        lengths = torch.stack([hist_len, next_len, neg_len]).to(torch.int32)
        return Rows(
            torch.zeros((n, 0), dtype=torch.float32, device=device),
            torch.cat([hist, nxt, negatives]),
            None if one_hot([hist_len_host, next_len_host, neg_len_host]) else lengths,
            torch.zeros(n, dtype=torch.float32, device=device),
            3,
            {"times": times},
            totals=[int(hist_len_host.sum()), int(next_len_host.sum()), len(negatives)],
        )

    def _negatives(self, split: str, epoch: int, index: int) -> torch.Tensor:
        """``NextItemSource._negatives`` on the device: the catalogue made there once; sampled
        ids drawn on the host (NumPy's generator, per global batch) and copied."""
        if split != "train" or not self.source.train_negatives:
            return self.catalogue
        return self.staging.put([self.source._negatives(split, epoch, index)])[0]
