"""Managed ids (``id_mapping: managed``): a table holds the ids the log has shown, each in a
row of its own, for a log whose ids never stop arriving (no vocabulary can be fixed before
training, and hashing into a table shares rows between ids).

The mapping is versioned by partition: partition p is read (trained on and scored) with
version p, made from the ids of partitions 0 .. p: an id gets a row in the partition where it
reaches ``min_count`` occurrences (counted per partition), as TorchRec's managed-collision
modules give one at the lookup that admits it; until then it reads row 0, the table's row for
ids without one. Only which ids a partition holds is used, never its labels, so scoring a
partition before training on it stays progressive. When the table is full, an id
that ranks above the lowest-ranked one holding a row takes that row (eviction): ``lfu`` ranks
by occurrences so far (then by the last partition seen), ``lru`` by the last partition seen
(then by occurrences); ties keep the id that holds the row. Row 0 is never given.

Why not TorchRec's managed-collision modules (``MCHManagedCollisionModule``): they remap
inside the model, batch by batch, with state that every rank updates from the ids of its own
batches, and run sharded only row-wise, through their own sharder and module. Here the remap
is a pure function of the partitions up to the one read: every rank, worker process and
resumed run computes the same versions from the same files, with no state to synchronize,
checkpoint or reshard. What it gives up: rows change hands at partition boundaries (an hour,
with hourly partitions) rather than at any batch, and the counts live in each reading
process's memory (24 bytes per distinct id seen, 16 per row), not in the planner's budget.

A row that changes hands (``reused``: an evicted id's row given to a new id) is set back to
its initial values and a fresh optimizer state before the partition is read, as TorchRec's
managed-collision modules reset an evicted row (``hybridrec.parallel.reset_rows``; on every
rank, from the same versions). With ``data.managed_ids.reset=false`` the new id starts from
the evicted id's vector and optimizer state instead, as a hash collision would.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

EVICTIONS = ("lfu", "lru")


@dataclass
class _Version:
    keys: np.ndarray  # uint64, sorted: the ids (64-bit keys) holding a row
    rows: np.ndarray  # int64: each one's row
    admitted: int = 0
    evicted: int = 0
    reused: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # rows an evicted id held


@dataclass
class _Table:
    capacity: int  # rows that can be given: num_embeddings - 1 (row 0 is the shared one)
    seen: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))  # sorted keys seen so far
    count: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    last: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    versions: list[_Version] = field(default_factory=list)


class ManagedIds:
    """The versions of every managed table (see the module docstring). ``keys_of(p)`` gives
    partition p's ids per table (all of its managed features' keys, with repeats); versions
    are made on demand, in order, and kept."""

    def __init__(
        self, capacities: dict[str, int], min_count: int, eviction: str, keys_of: Callable[[int], dict[str, np.ndarray]]
    ) -> None:
        if eviction not in EVICTIONS:
            raise ValueError(f"data.managed_ids.eviction={eviction!r}: one of {', '.join(EVICTIONS)}")
        self.tables = {name: _Table(capacity - 1) for name, capacity in capacities.items()}
        self.min_count, self.eviction, self.keys_of = min_count, eviction, keys_of

    def reset(self) -> None:
        """Forget every version (the partitions were laid out again)."""
        for t in self.tables.values():
            t.seen, t.count, t.last = np.zeros(0, np.uint64), np.zeros(0, np.int64), np.zeros(0, np.int64)
            t.versions.clear()

    def version(self, table: str, p: int) -> _Version:
        t = self.tables[table]
        while len(t.versions) <= p:
            self._advance(len(t.versions))
        return t.versions[p]

    def rows(self, table: str, keys: np.ndarray, p: int) -> np.ndarray:
        """The rows of ``keys`` in version ``p`` (0 for an id without one)."""
        v = self.version(table, p)
        if not len(v.keys):
            return np.zeros(len(keys), np.int64)
        at = np.minimum(np.searchsorted(v.keys, keys), len(v.keys) - 1)
        return np.where(v.keys[at] == keys, v.rows[at], 0)

    def _advance(self, p: int) -> None:
        """Make version p of every table from version p - 1 and partition p's ids."""
        ids = self.keys_of(p)
        for name, t in self.tables.items():
            keys, counts = np.unique(ids.get(name, np.zeros(0, np.uint64)), return_counts=True)
            seen = np.union1d(t.seen, keys)
            count, last = np.zeros(len(seen), np.int64), np.full(len(seen), -1, np.int64)
            old = np.searchsorted(seen, t.seen)
            count[old], last[old] = t.count, t.last
            new = np.searchsorted(seen, keys)
            count[new] += counts
            last[new] = p
            t.seen, t.count, t.last = seen, count, last
            t.versions.append(
                self._assign(
                    t, t.versions[-1] if t.versions else _Version(np.zeros(0, np.uint64), np.zeros(0, np.int64))
                )
            )

    def _assign(self, t: _Table, before: _Version) -> _Version:
        """The next version: the ``capacity`` best-ranked ids of those holding a row and those
        seen ``min_count`` times; kept ids keep their rows, new ones take the freed rows."""
        eligible = t.count >= self.min_count
        holding = np.zeros(len(t.seen), bool)
        holding[np.searchsorted(t.seen, before.keys)] = True
        pool = np.flatnonzero(eligible | holding)
        if len(pool) > t.capacity:
            primary, secondary = (t.count, t.last) if self.eviction == "lfu" else (t.last, t.count)
            # lexsort: the last key is the primary; best first, ties to the holder, then by key
            order = np.lexsort((t.seen[pool], ~holding[pool], -secondary[pool], -primary[pool]))
            pool = np.sort(pool[order[: t.capacity]])
        keys = t.seen[pool]
        kept = holding[pool]
        rows = np.zeros(len(pool), np.int64)
        at = np.searchsorted(before.keys, keys[kept])
        rows[kept] = before.rows[at]
        used = np.zeros(t.capacity + 1, bool)
        used[0] = True
        used[rows[kept]] = True
        free = np.flatnonzero(~used)
        rows[~kept] = free[: int((~kept).sum())]
        # the rows the evicted ids held, now given to new ones (a row never given is still as
        # the table started)
        reused = np.intersect1d(rows[~kept], before.rows)
        return _Version(
            keys, rows, admitted=int((~kept).sum()), evicted=int(len(before.keys) - kept.sum()), reused=reused
        )

    def stats(self, table: str, p: int, keys: np.ndarray) -> dict[str, int]:
        """Partition p's lookups of ``table`` (``keys``, with repeats) against version p: hits
        (an id with a row), misses (row 0: below min_count, or ranked out of a full table),
        and the version's rows used, admissions and evictions."""
        v = self.version(table, p)
        hits = int((self.rows(table, keys, p) > 0).sum())
        return {
            "rows_used": len(v.keys),
            "rows": self.tables[table].capacity + 1,
            "hits": hits,
            "misses": len(keys) - hits,
            "admitted": v.admitted,
            "evicted": v.evicted,
        }
