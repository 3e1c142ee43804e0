"""Worker processes hand their rows over through shared-memory slots: the batches are the
recorded ones, rows too large for a slot still arrive (pickled, said once), and nothing is
left in /dev/shm after a pass."""

import json
import logging
import os
import time
from multiprocessing import shared_memory

import pytest

from batch_sources import GOLDEN, digests
from hybridrec.data import handoff, loader

pytestmark = pytest.mark.slow  # forks DataLoader workers

with open(GOLDEN) as f:
    RECORDED = json.load(f)


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def test_rows_larger_than_a_slot_arrive_pickled_and_are_said_once(monkeypatch, caplog):
    monkeypatch.setattr(loader, "_slot_bytes", lambda source, rows: 256)  # every piece too large
    monkeypatch.setattr(loader, "_oversized_said", False)
    with caplog.at_level(logging.WARNING, logger="hybridrec.data.loader"):
        assert digests("parquet multi-hot weighted", workers=2) == RECORDED["parquet multi-hot weighted"]
    said = [r.getMessage() for r in caplog.records if "did not fit its shared-memory slot" in r.getMessage()]
    assert len(said) == 1 and "go through DataLoader's queue, pickled, slower but the same" in said[0], said


def _left_by_this_pass(before: set[str]) -> set[str]:
    """The names the pass added to /dev/shm and left there.

    /dev/shm is the machine's, and `make test` runs two test files at once (pytest-xdist): the
    other file's launches come and go meanwhile. Two kinds of names are theirs, never the
    pass's: a named semaphore (``sem.mp-*``) is a forkserver or spawn context's, the elastic
    launcher's; the ring's and DataLoader's semaphores are fork-context ones, unlinked as they
    are made. And a name still gone within two seconds was a short-lived one, not a leak."""
    added = {n for n in _shm() - before if not n.startswith("sem.mp-")}
    deadline = time.monotonic() + 2.0
    while added and time.monotonic() < deadline:
        time.sleep(0.1)
        added &= _shm()
    return added


def test_a_pass_with_workers_leaves_nothing_in_dev_shm():
    before = _shm()
    assert digests("criteo binary", workers=2) == RECORDED["criteo binary"]
    assert not _left_by_this_pass(before)


def test_the_leak_check_sees_a_segment_the_pass_leaves():
    before = _shm()
    leaked = shared_memory.SharedMemory(create=True, size=4096)  # what a leaking pass would leave
    try:
        assert leaked.name.lstrip("/") in _left_by_this_pass(before)
    finally:
        leaked.close()
        leaked.unlink()


def test_a_slot_holds_the_rows_and_frees_itself_once_copied():
    import numpy as np

    from hybridrec.data.rows import Rows

    ring = handoff.SlotRing(workers=1, slots=2, slot_bytes=1 << 16)
    rows = Rows.of(
        np.ones((3, 2)),
        [(np.array([1, 2, 3, 4]), np.array([2, 1, 1]))],
        np.array([0, 1, 0]),
        {"times": np.arange(12).reshape(3, 4)},
    )
    handles = [ring.put(0, rows), ring.put(0, rows)]
    assert not ring.free[0].acquire(block=False)  # both slots taken until copied out
    back = ring.take(handles[0])
    assert back.values.tolist() == [1, 2, 3, 4] and back.lengths.tolist() == [[2, 1, 1]]
    assert back.extra["times"].tolist() == rows.extra["times"].tolist() and back.features == 1
    assert ring.put(0, rows).slot == 0  # the slot copied out is the next one written
    assert ring.put(0, Rows.of(np.ones((10_000, 2)), [], np.zeros(10_000))) is None  # too large: pickled
