"""The layout of a split for random access: its files with their row groups (``_File``), its
rows as segments of the files laid end to end (``_Split``), and what one process holds open
(``_Open``: file handles, the last decoded row groups)."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


# ------------------------------------------------------------------------------ the layout
@dataclass
class _File:
    path: str
    rows: int
    groups: np.ndarray
    """Cumulative rows at each row group's start, and the file's rows last (len = groups + 1)."""
    stream: int
    """The holdout stream of the file's rows (a hash of its name)."""


class _Split:
    """A split's rows: segments (file, first row, rows) laid end to end."""

    def __init__(self, files: list[_File], seg_file: np.ndarray, seg_start: np.ndarray, seg_count: np.ndarray) -> None:
        keep = seg_count > 0
        self.files = files
        self.seg_file, self.seg_start, self.seg_count = seg_file[keep], seg_start[keep], seg_count[keep]
        self.cum = np.concatenate([[0], np.cumsum(self.seg_count)]).astype(np.int64)
        self.total = int(self.cum[-1])

    def pieces(self, a: int, b: int) -> Iterator[tuple[int, int, int]]:
        """(file index, first row in the file, rows) of split rows [a, b), adjacent ranges of
        a file merged."""
        if a >= b:
            return
        i = int(np.searchsorted(self.cum, a, side="right")) - 1
        last = None
        while a < b:
            take = min(b, int(self.cum[i + 1])) - a
            f, start = int(self.seg_file[i]), int(self.seg_start[i]) + a - int(self.cum[i])
            if last is not None and last[0] == f and last[1] + last[2] == start:
                last = (f, last[1], last[2] + take)
            else:
                if last is not None:
                    yield last
                last = (f, start, take)
            a += take
            i += 1
        assert last is not None  # a < b: the loop ran at least once
        yield last

    def locate(self, row: int) -> tuple[str, int]:
        """The file and row in it of split row ``row``."""
        i = int(np.searchsorted(self.cum, row, side="right")) - 1
        return self.files[int(self.seg_file[i])].path, int(self.seg_start[i]) + row - int(self.cum[i])


class _Open:
    """What one process holds open: ParquetFile handles and the last decoded row groups.
    Never shared across fork: a worker process opens its own (``ParquetSource._state``)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.files: OrderedDict[str, pq.ParquetFile] = OrderedDict()
        self.groups: OrderedDict[tuple[str, int], tuple[frozenset[str], pa.Table]] = OrderedDict()
        self.lock = threading.Lock()
