"""The input loop every source shares: epochs, resume position, end of split, padding of the
last evaluated batch, worker processes and read-report merging.

``batches(source, split, rank, world_size, ...)`` yields this rank's ``RecBatch`` of global
batches ``start`` .. ``num_batches - 1`` of ``split``. Training passes over the split again
and again (epochs); a partial last global batch is dropped by the source and counted.
An evaluated split (``valid``, ``eval``) is one pass that scores every row: its last batch
is padded with rows of weight 0 (dense 0, id 0 of id weight 1.0 in every feature), and
``EvalBatch.real`` marks the rows that count and ``EvalBatch.rows`` names each row. Ranks can
run out at different batches (sharded sources); the evaluation (``hybridrec.evaluation``)
agrees on the end with one all-reduce per batch.

Workers: ``num_workers`` > 0 builds batches in ``torch.utils.data.DataLoader`` worker
processes (forked: the source is not pickled), ``prefetch`` batches ahead each. Batch k of
a random-access source is built by worker k mod W, and DataLoader returns the workers'
outputs round-robin, so the batches are the same for any number of workers. A sharded
source's pieces are read by the worker that owns their shard (a sequential reader never
changes process). Errors in a worker reach the training process as the same one-line
DataError, not as DataLoader's wrapped traceback.
"""

from __future__ import annotations

import logging
import math
import queue
import re
import signal
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generator, Iterator, Optional, Protocol, Union, cast

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from hybridrec.base.compat import dataloader_worker_exits
from hybridrec.base.signals import Killed, signal_name
from hybridrec.data import DataError, RecBatch
from hybridrec.data.handoff import Handle, SlotRing, slot_bytes_for
from hybridrec.data.source import Rows, Source

if TYPE_CHECKING:
    from hybridrec.data.sequences import NextItemSource

log = logging.getLogger(__name__)


class DeviceRows(Protocol):
    """Rows [lo, hi) of global batch ``index`` of ``split`` in ``epoch``, made on the training
    device: ``device_rows(split, index, lo, hi, epoch=epoch)`` (a source whose rows are the
    same every epoch ignores it)."""

    def __call__(self, split: str, index: int, lo: int, hi: int, epoch: int = 0) -> Rows: ...


@dataclass
class EvalBatch:
    """A batch of an evaluated split and which of its rows are real (not padding)."""

    batch: RecBatch
    real: torch.Tensor
    rows: torch.Tensor
    """int64: each row's index in the split, ``global batch * batch_size + position in the
    global batch``. Global batches are the same for every world size, so the index is too:
    it names the row however many ranks scored it (a random-access source's real rows are
    0 .. n-1; a sharded source's last batch may leave gaps). -1 for padding rows."""


@dataclass
class _Piece:
    index: int  # the global batch
    piece: int  # which of the rank's P pieces
    rows: Union[Rows, Handle]  # fewer rows than asked, or none: the end of an evaluated split (a Handle: in a slot)
    end: bool = False  # past the end: carries only the read report


@dataclass
class _Failed:
    """An error raised while reading, sent to the training process as its message: the
    DataLoader would re-raise it wrapped in a worker traceback."""

    message: str


def plan_pieces(source: Source, world_size: int, rank: int) -> list[tuple[int, int]]:
    """The [lo, hi) row ranges of global batch rows that this rank's pieces read."""
    local = source.batch_size // world_size
    pieces = source.pieces(world_size)
    per = local // pieces
    return [(rank * local + p * per, rank * local + (p + 1) * per) for p in range(pieces)]


class _Stream(IterableDataset):
    """The pieces of this rank's batches, for the worker it runs in (all of them inline)."""

    def __init__(
        self,
        source: Source,
        split: str,
        ranges: list[tuple[int, int]],
        start: int,
        stop: Optional[int],
        per_epoch: Optional[int],
        ring: Optional[SlotRing] = None,
        device_rows: Optional[DeviceRows] = None,
    ) -> None:
        self.source, self.split, self.ranges = source, split, ranges
        self.start, self.stop, self.per_epoch = start, stop, per_epoch
        self.ring, self.device_rows = ring, device_rows

    def __iter__(self) -> Iterator[Union[_Piece, _Failed]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        pieces = len(self.ranges)
        try:
            index = self.start
            while self.stop is None or index < self.stop:
                epoch, at = divmod(index, self.per_epoch) if self.per_epoch else (0, index)
                out = []
                for p, (lo, hi) in enumerate(self.ranges):
                    # unit u = (batch, piece) goes to worker u mod W; with W dividing P every
                    # worker keeps the same pieces (shards), with P = 1 whole batches alternate
                    if ((index - self.start) * pieces + p) % workers == worker:
                        if self.device_rows is not None:
                            rows = self.device_rows(self.split, at, lo, hi, epoch=epoch)
                        else:
                            rows = self.source.read(self.split, epoch, at, lo, hi)
                        out.append(_Piece(index, p, rows))
                # a pass of unknown length ends when every reader of this worker runs dry
                # (other workers' pieces of the batch, if any, are padded by the loader)
                if (
                    out
                    and self.per_epoch is None
                    and self.split != "train"
                    and not any(len(cast(Rows, o.rows)) for o in out)
                ):
                    for o in out:  # no batch, but what the last reads counted (a broken file)
                        o.end = True
                        yield o
                    return
                for o in out:
                    if self.ring is not None and (handle := self.ring.put(worker, cast(Rows, o.rows))) is not None:
                        o.rows = handle  # only the slot's description crosses the queue
                    yield o
                index += 1
        except DataError as e:
            yield _Failed(str(e))


def check_splits(source: Source) -> None:
    """Refuse a split with nothing to train on or to score, before training starts."""
    for split in source.splits:
        n = source.num_batches(split)
        if n == 0 or (n is None and not source.has_rows(split)):
            raise _empty(source, split)


def _empty(source: Source, split: str) -> DataError:
    if why := source.why_empty(split):
        return DataError(f"the {split} split has no usable rows: {why}")
    return DataError(
        f"the {split} split has "
        + (
            f"fewer rows than one global batch (data.batch_size={source.batch_size})"
            if split == "train"
            else "no rows to evaluate"
        )
    )


def batches(
    source: Source,
    split: str,
    rank: int,
    world_size: int,
    num_batches: Optional[int] = None,
    start: int = 0,
    num_workers: int = 0,
    prefetch: int = 2,
    pin_memory: bool = False,
    thread: bool = False,
    device_rows: Optional[DeviceRows] = None,
) -> Iterator[Union[RecBatch, EvalBatch]]:
    """This rank's batches of ``split``: global batches ``start`` .. ``num_batches - 1``
    (training: endless when None; an evaluated split: one pass, capped by ``num_batches`` or
    ``source.eval_batches``). Training yields ``RecBatch``; an evaluated split ``EvalBatch``.
    ``thread`` (with no workers): built ``prefetch`` ahead on a background thread.
    ``device_rows`` (no workers, no thread): the source's rows made on the training device
    (the ``device_rows(device)`` of ``SyntheticClickLog``, ``CriteoBinary``, ``MovieLens`` and
    the next-item sources), read in place of ``source.read``."""
    if device_rows is not None and (num_workers or thread):
        raise ValueError("rows drawn on the device are drawn by the training thread: no workers, no input thread")
    inline = _batches(
        source, split, rank, world_size, num_batches, start, num_workers, prefetch, pin_memory, device_rows
    )
    return ahead(inline, prefetch) if thread and not num_workers else inline


# One batch is built at a time in a process: a training stream's thread and an evaluation's
# never read a source at once (sources keep read reports and sequential readers).
_BUILDING = threading.Lock()
_END = object()


def ahead(items: Generator, depth: int) -> Iterator:
    """``items``, produced by a background thread up to ``depth`` ahead of the consumer.

    torch.utils.data has no thread-based loader (DataLoader's workers are processes), and a
    process per rank costs memory and a copy of every batch; the heavy parts of building a
    batch (PyArrow parsing, NumPy, torch ops) release the GIL, so a thread overlaps them with
    the step. The order is the producer's, so the batches are those of the inline loop. An
    error while building is raised here, at the batch it replaced; closing this iterator (a
    run that stops early, an exception in the step) stops the thread at its next batch."""
    queue_: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                queue_.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            while not stop.is_set():
                with _BUILDING:  # held while building only: never while waiting for the consumer
                    item = next(items, _END)
                if not put((item, None)) or item is _END:
                    return
        except BaseException as e:  # handed to the consumer, raised there with its own traceback
            put((_END, e))
        finally:
            with _BUILDING:
                items.close()

    producer = threading.Thread(target=produce, name="hybridrec-input", daemon=True)
    producer.start()
    try:
        while True:
            item, error = queue_.get()
            if item is _END:
                if error is not None:
                    raise error
                return
            yield item
    finally:
        stop.set()
        producer.join()


def _batches(
    source: Source,
    split: str,
    rank: int,
    world_size: int,
    num_batches: Optional[int],
    start: int,
    num_workers: int,
    prefetch: int,
    pin_memory: bool,
    device_rows: Optional[DeviceRows] = None,
) -> Generator[Union[RecBatch, EvalBatch], None, None]:
    train = split == "train"
    if not source.has_split(split):
        raise DataError(f"this data source has no {split} split (it has {', '.join(source.splits)})")
    per_epoch = source.num_batches(split)
    if per_epoch == 0:
        raise _empty(source, split)
    if train:
        stop = num_batches
    else:
        cap = num_batches if num_batches is not None else source.eval_batches
        stop = per_epoch if cap is None else (cap if per_epoch is None else min(cap, per_epoch))
    ranges = plan_pieces(source, world_size, rank)
    # (batch, piece) units are dealt to workers round-robin. A sequential reader must stay in
    # one worker (else every worker would read, and count, the rows the others return), so a
    # sequential source with P pieces uses gcd(W, P) workers; a random-access one uses all W.
    workers = math.gcd(num_workers, len(ranges)) if source.sequential and num_workers else num_workers
    source.begin_pass(split, start // per_epoch if per_epoch else 0)
    local = source.batch_size // world_size
    per = local // len(ranges)
    # A worker's pieces reach this process through shared-memory slots: at most ``prefetch``
    # wait in DataLoader's queue per worker, one is being written, one spare.
    ring = SlotRing(workers, prefetch + 2, _slot_bytes(source, per)) if workers else None
    stream = _Stream(source, split, ranges, start, stop, per_epoch, ring, device_rows)
    if workers:
        pieces: Iterator = _watched(
            iter(
                DataLoader(
                    stream,
                    batch_size=None,
                    num_workers=workers,
                    prefetch_factor=prefetch,
                    persistent_workers=False,
                    multiprocessing_context="fork",
                )
            ),
            rank,
        )
    else:
        pieces = iter(stream)
    pending: dict[int, Rows] = {}
    index = None
    for item in pieces:
        if isinstance(item, _Failed):
            raise DataError(item.message)
        if isinstance(item.rows, Handle):
            assert ring is not None  # (a Handle comes from a worker, and workers have the ring)
            item.rows = ring.take(item.rows)  # copied out at once: the worker's slot is free again
        elif ring is not None and not item.end:
            _said_oversized(item.rows, ring)
        if item.end:
            if item.rows.report is not None:
                source.merge_report(item.rows.report)
            continue
        if index is not None and item.index != index:
            yield _assemble(source, pending, len(ranges), per, train, pin_memory, index, ranges[0][0])
            pending = {}
        index = item.index
        if item.rows.report is not None:
            source.merge_report(item.rows.report)
            item.rows.report = None
        pending[item.piece] = item.rows
    if pending:
        assert index is not None  # (set with the first piece)
        yield _assemble(source, pending, len(ranges), per, train, pin_memory, index, ranges[0][0])


def _no_rows(source: Source, key: str) -> torch.Tensor:
    """No rows of the ranking or sequence field ``key``: its dtype and row shape."""
    if key == "times":
        return torch.zeros(0, cast("NextItemSource", source).max_length, dtype=torch.int64)  # (times: next-item rows)
    return torch.zeros(0, dtype=torch.int64 if key == "query" else torch.float32)


def _slot_bytes(source: Source, rows: int) -> int:
    """A slot for ``rows`` rows of ``source``: its ids per row estimated by the features'
    pooling factors (twice that for room)."""
    ids = sum(f.pooling_factor for f in source.features)
    extra = len(source.extra_fields) + (
        cast("NextItemSource", source).max_length - 1 if "times" in source.extra_fields else 0
    )
    return slot_bytes_for(rows, source.num_dense_features, len(source.features), ids, source.weighted, extra)


_oversized_said = False


def _said_oversized(rows: Rows, ring: SlotRing) -> None:
    """Rows a worker sent pickled, too large for its slot: said once per process."""
    global _oversized_said
    if not _oversized_said:
        _oversized_said = True
        size = sum(t.numel() * t.element_size() for t in (rows.dense, rows.values, rows.labels))
        log.warning(
            f"data: a worker's rows ({size / 2**20:.1f} MiB, {len(rows.values):,} ids) did not fit its "
            f"shared-memory slot ({ring.slot_bytes / 2**20:.1f} MiB, sized by the features' expected ids "
            f"per row): such rows go through DataLoader's queue, pickled, slower but the same"
        )


def _watched(pieces: Iterator, rank: int) -> Iterator:
    """A DataLoader's items; a worker that a signal ended (``kill -9``, the OOM killer) is
    named with its pid and the signal (``Killed``): DataLoader's own error says only that a
    worker "exited unexpectedly", with the traceback of its polling."""
    try:
        yield from pieces
    except RuntimeError as e:
        dead = [(pid, code) for pid, code in dataloader_worker_exits(pieces) if code < 0]
        if not dead:
            raise worker_killed(e, rank) or e  # noqa: B904  (e itself, or the line naming it: its context is e)
        pid, code = dead[0]
        raise _worker_killed(rank, pid, -code) from None


def worker_killed(error: BaseException, rank: int) -> Optional[Killed]:
    """``error`` as ``Killed`` when it is DataLoader's report of a worker a signal ended, raised
    wherever the training process was (torch's SIGCHLD handler raises it in the middle of a
    step: "DataLoader worker (pid N) is killed by signal: Killed."); None for any other."""
    found = re.search(r"DataLoader worker \(pid (\d+)\) is killed by signal: (.+?)\.?\s*$", str(error))
    if not found:
        return None
    signum = next((s for s in signal.Signals if signal.strsignal(s) == found.group(2)), None)
    return _worker_killed(rank, int(found.group(1)), int(signum)) if signum else None


def _worker_killed(rank: int, pid: int, signum: int) -> Killed:
    return Killed(
        f"rank {rank}: DataLoader worker (pid {pid}) was killed by {signal_name(signum)}; its batches were "
        f"lost with it (data.num_workers=0 reads in the rank itself)",
        signum,
    )


def _assemble(
    source: Source,
    pending: dict[int, Rows],
    pieces: int,
    per: int,
    train: bool,
    pin_memory: bool,
    index: int,
    first: int,
) -> Union[RecBatch, EvalBatch]:
    """One batch (global batch ``index``, of which this rank's pieces start at row ``first``)
    from its pieces; an evaluated split's missing or short pieces are padded."""
    if not train:  # a piece whose reader ran out early (a shard of a sharded source) is padding
        like = next(iter(pending.values()))
        pending = {p: pending.get(p, like.none_like()).padded(per) for p in range(pieces)}
    rows = Rows.cat([pending[p] for p in range(pieces)])
    if train and len(rows) != per * pieces:
        raise AssertionError(f"a training batch of {len(rows)} rows, expected {per * pieces}")  # a source bug
    batch = rows.batch(source.keys, source.weighted)
    if pin_memory and rows.labels.device.type == "cpu":
        batch = batch.pin_memory()
    if train:
        return batch
    real = rows.real_mask()
    # The pieces are consecutive and each padded to `per` rows: position i of this rank's
    # batch is row first + i of the global batch.
    index_of = torch.arange(len(rows), dtype=torch.int64) + index * source.batch_size + first
    return EvalBatch(batch, real, torch.where(real, index_of, -1))


def padding_batch(source: Source, world_size: int) -> EvalBatch:
    """A batch of padding only: what a rank whose split ran out feeds while others finish."""
    n = source.batch_size // world_size
    rows = Rows(
        torch.zeros(0, source.num_dense_features),
        torch.zeros(0, dtype=torch.int64),
        None,
        torch.zeros(0),
        len(source.features),
        {k: _no_rows(source, k) for k in source.extra_fields},
        id_weights=torch.zeros(0) if source.weighted else None,
    )
    rows = rows.padded(n)
    return EvalBatch(
        rows.batch(source.keys, source.weighted), rows.real_mask(), torch.full((n,), -1, dtype=torch.int64)
    )
