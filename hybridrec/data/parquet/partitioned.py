"""The partitioned side of ParquetSource (a mixin): the train split laid out as time
partitions in order (``set_partitions``), each also an evaluated split ``partition:<name>``,
and the managed-id version each read uses (``hybridrec.data.parquet.managed``); the rules of
``data.partitions``."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Iterator, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from hybridrec.config.schema import ParquetIdMapping
from hybridrec.data import ReadReport
from hybridrec.data.parquet.columns import _kind, _plain_array
from hybridrec.data.parquet.layout import _File, _Split
from hybridrec.data.parquet.partitions import Partition, parse_until, pattern_regex
from hybridrec.data.source import Rows

if TYPE_CHECKING:
    import threading

    from hybridrec.data.parquet.columns import _Part
    from hybridrec.data.parquet.config import _Sparse
    from hybridrec.data.parquet.managed import ManagedIds

PARTITION = "partition:"
"""The evaluated split of one partition: ``partition:<name>``."""


class _Partitioned:
    """ParquetSource's partitions and managed-id versions (it reads the source's settings:
    partitioning, batch_size, sparse, managed, _splits, _index, _layout, _ranges, _rows,
    _convert_all, columns)."""

    if TYPE_CHECKING:  # what ParquetSource (and its _Columns side) gives this mixin, for the type checker
        partitioning: Optional[dict[str, Any]]
        batch_size: int
        sparse: list[_Sparse]
        managed: Optional[ManagedIds]
        columns: list[str]
        partitions: list[dict[str, Any]]
        _splits: dict[str, _Split]
        _indexed: dict[str, _File]
        _local: threading.local

        def _index(self, path: str, key: str) -> _File: ...

        def _layout(self, files: list[_File], held: Optional[bool]) -> _Split: ...

        def _ranges(self, split: str, a: int, b: int, columns: list[str]) -> Iterator[tuple[str, int, pa.Table]]: ...

        def _keys(self, flat: pa.Array, kind: str) -> np.ndarray: ...

        def _rows(self, parts: list[_Part]) -> Rows: ...

        def _convert_all(
            self, ranges: list[tuple[str, int, pa.Table]], report: Optional[ReadReport]
        ) -> list[_Part]: ...

    def set_partitions(self, listed: list[Partition]) -> None:
        """Lay the train split out as ``listed``, in order, each partition in global batches
        of its own (its last one padded with rows of weight 0: every row is trained on, and
        no batch mixes two days), none of a partition after ``train_until``. Each partition
        is also an evaluated split, ``partition:<name>``: what progressive validation scores.
        Called at build and again when partitions arrive (every rank with the same list)."""
        assert self.partitioning is not None  # called only for a partitioned source
        until = self.partitioning.get("train_until")
        until = parse_until(str(until), pattern_regex(self.partitioning["pattern"])) if until else None
        trained_files: list[_File] = []
        before = [p["name"] for p in getattr(self, "partitions", [])]
        self.partitions = []
        first = 0
        for p in listed:
            fs = []
            for path in p.files:
                if path not in self._indexed:
                    self._indexed[path] = self._index(path, "data.train_path")
                fs.append(self._indexed[path])
            self._splits[PARTITION + p.name] = whole = self._layout(fs, None)
            trained = until is None or p.time <= until
            batches = -(-whole.total // self.batch_size) if trained else 0
            self.partitions.append(
                {
                    "name": p.name,
                    "rows": whole.total,
                    "batches": batches,
                    "trained": trained,
                    "first_batch": first,
                    "files": list(p.files),
                    "index": len(self.partitions),
                }
            )
            first += batches
            trained_files += fs if trained else []
        # The trained rows end to end: what the pooling factors are estimated on.
        self._splits["train"] = self._layout(trained_files, None)
        self._batch_starts = np.array([q["first_batch"] for q in self.partitions if q["batches"]], np.int64)
        self._batch_parts = [q for q in self.partitions if q["batches"]]
        if hasattr(self, "_counting"):  # arrived partitions: the train split's new rows are counted too
            self._counting.pop("train", None)
        self._partition_index = {p["name"]: p["index"] for p in self.partitions}
        trained_indices = [p["index"] for p in self.partitions if p["trained"]]
        self._last_trained = trained_indices[-1] if trained_indices else 0
        if self.managed and [p["name"] for p in self.partitions[: len(before)]] != before:
            self.managed.reset()  # versions are made from the partitions in order: not the same ones

    # -- managed ids --------------------------------------------------------------------------
    def _version(self) -> int:
        """The managed-id version a read uses (``read`` sets it per thread)."""
        version = getattr(self._local, "version", None)
        return self._last_trained if version is None else version

    def _version_of(self, split: str, index: int) -> int:
        """Partition p is read with version p, up to the last partition trained on (a model
        trained once keeps its ids); every other split with that last version."""
        if split == "train" and self.partitioning:
            p = self._batch_parts[int(np.searchsorted(self._batch_starts, index, side="right")) - 1]["index"]
        elif split.startswith(PARTITION):
            p = self._partition_index[split[len(PARTITION) :]]
        else:
            p = self._last_trained
        return min(p, self._last_trained)

    def partition_ids(self, p: int, f: Any, as_read: bool = True) -> list[pa.Array]:
        """Every id of feature ``f`` in partition p, flat, nulls left out, one array per file
        (files may type their ids differently); ``as_read``: lists cut to max_length where
        truncate is set, as training reads them."""
        parts = []
        for path in self.partitions[p]["files"]:
            column = _plain_array(pq.read_table(path, columns=[f.column]).column(f.column))
            if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
                if as_read and f.truncate:
                    column = pc.list_slice(column, 0, f.max_length)
                column = _plain_array(pc.list_flatten(column))
            parts.append(column.drop_null())
        return parts

    def partition_keys(self, p: int) -> dict[str, np.ndarray]:
        """The 64-bit keys of partition p's ids, per managed table (every occurrence, as
        training reads them)."""
        out: dict[str, list[np.ndarray]] = {}
        for f in self.sparse:
            if f.id_mapping == ParquetIdMapping.managed.value:
                for ids in self.partition_ids(p, f):
                    out.setdefault(f.table_name, []).append(self._keys(ids, _kind(ids.type)))
        return {t: np.concatenate(k) for t, k in out.items()}

    def reused_rows(self, p: int) -> dict[str, np.ndarray]:
        """Per managed table, the rows that version p gives to new ids after another id held
        them; empty past the last partition trained on (its version is the one read)."""
        if not self.managed or p > self._last_trained:
            return {}
        return {t: self.managed.version(t, p).reused for t in self.managed.tables}

    def managed_stats(self, p: int) -> dict[str, dict[str, int]]:
        """Partition p's lookups of each managed table against the version it is read with."""
        if not self.managed:
            return {}
        keys = self.partition_keys(p)
        v = min(p, self._last_trained)
        return {t: self.managed.stats(t, v, keys.get(t, np.zeros(0, np.uint64))) for t in self.managed.tables}

    def _partition_rows(self, index: int, lo: int, hi: int, report: Optional[ReadReport]) -> Rows:
        """Rows [lo, hi) of global batch ``index`` of a partitioned train split: the
        partition's rows, padded at its end (weight 0)."""
        p = self._batch_parts[int(np.searchsorted(self._batch_starts, index, side="right")) - 1]
        split, at = PARTITION + p["name"], (index - p["first_batch"]) * self.batch_size
        total = self._splits[split].total
        ranges = list(self._ranges(split, min(at + lo, total), min(at + hi, total), self.columns))
        return self._rows(self._convert_all(ranges, report)).padded(hi - lo)


def check_partitions(parts: dict[str, Any], valid_fraction: float, shards: Optional[int]) -> None:
    """``data.partitions``'s rules (a ValueError naming the key)."""
    regex = pattern_regex(parts.get("pattern") or "")
    if valid_fraction:
        raise ValueError(
            "data.valid_fraction carves validation out of the training files; with data.partitions "
            "every partition is scored before it is trained on (progressive validation): unset "
            "data.valid_fraction, or give data.valid_path (the days after the log)"
        )
    if shards:
        raise ValueError("data.shards and data.partitions do not go together yet: unset data.shards")
    until = parts.get("train_until")
    if until is not None and parse_until(str(until), regex) is None:
        raise ValueError(
            f"data.partitions.train_until={until!r} is neither a partition name of the pattern "
            f"{parts.get('pattern')!r} nor a date (2026-11-07)"
        )
    marker = parts.get("ready_marker")
    if marker is not None and (not marker or marker in (".", "..") or "/" in marker or os.sep in marker):
        raise ValueError(
            f"data.partitions.ready_marker={marker!r}: the name of a file inside each partition "
            "(Spark's _SUCCESS), not a path"
        )
    if parts.get("follow") and not parts.get("ready_marker"):
        raise ValueError(
            "data.partitions.follow=true reads partitions while they are written: set "
            "data.partitions.ready_marker (the file a writer leaves in a complete partition, "
            "Spark's _SUCCESS) so that none is read half-written"
        )
    for key in ("poll_s", "stop_after_idle_s"):
        value = parts.get(key)
        if value is not None and not value > 0:
            raise ValueError(
                f"data.partitions.{key} must be > 0"
                + (", or null: never stop" if key != "poll_s" else "")
                + f", got {value}"
            )
