"""Worker processes hand their rows to the training process through shared memory.

torch's DataLoader sends a worker's output as pickled tensors: each tensor's storage is moved
into a shared-memory file of its own (created, sized, mapped, sent as a file descriptor and
mapped again by the receiver), and the pages of every new file are faulted in again on both
sides. For a batch of a few contiguous arrays that costs more than building it (measured:
two workers delivered 0.26x the rows of one inline reader). Here each worker writes into a
ring of slots of one anonymous shared mapping, made once before the workers fork, and only a
small ``Handle`` (which slot, the arrays' dtypes, shapes and offsets, the read report)
crosses DataLoader's queue. The training process copies the arrays out of the slot into
batches of its own, then frees the slot.

Flow control: each worker has ``slots`` slots and a semaphore counting the free ones; it
takes one before writing and the training process gives it back after copying. The
mapping is anonymous: it has no name, uses no /dev/shm file, and disappears with the last
process that maps it, however the processes end (``kill -9`` included): nothing to leak.

Rows larger than a slot (a multi-hot batch far above its expected ids) travel the ordinary
way, pickled, and the run says so once: ``Handle`` is only an optimization of the transport,
never a change of what arrives.
"""

from __future__ import annotations

import mmap
import multiprocessing
import os
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from hybridrec.data import ReadReport
from hybridrec.data.rows import Rows

_ALIGN = 64  # every array starts on a cache line
_TENSORS = ("dense", "values", "lengths", "labels", "real", "id_weights")
_WAIT_S = 1.0  # a worker waiting for a free slot looks at its parent this often


@dataclass
class Handle:
    """Where a worker's rows are: its slot, and each array's name, dtype, shape and offset."""

    worker: int
    slot: int
    arrays: list[tuple[str, str, tuple[int, ...], int]]
    features: int
    report: Optional[ReadReport] = None
    extra: list[str] = field(default_factory=list)
    """The names of ``Rows.extra``'s arrays (stored as ``extra.<name>``), in order."""


class SlotRing:
    """``slots`` slots of ``slot_bytes`` for each of ``workers`` workers, in one anonymous
    shared mapping: build it in the training process before the workers fork."""

    def __init__(self, workers: int, slots: int, slot_bytes: int) -> None:
        self.workers, self.slots = workers, slots
        self.slot_bytes = -(-slot_bytes // _ALIGN) * _ALIGN
        # MAP_SHARED | MAP_ANONYMOUS: inherited by forked workers, shared both ways
        self.memory = mmap.mmap(-1, workers * slots * self.slot_bytes)
        context = multiprocessing.get_context("fork")
        self.free = [context.Semaphore(slots) for _ in range(workers)]
        self.next_slot = [0] * workers  # each worker's own counter, in its own process
        self.parent = os.getpid()

    @property
    def bytes(self) -> int:
        return len(self.memory)

    def _view(self, worker: int, slot: int) -> memoryview:
        start = (worker * self.slots + slot) * self.slot_bytes
        return memoryview(self.memory)[start : start + self.slot_bytes]

    # -- in a worker -----------------------------------------------------------------------
    def put(self, worker: int, rows: Rows) -> Optional[Handle]:
        """Write ``rows`` into this worker's next slot once it is free; None when they do not
        fit in a slot (the caller sends them pickled)."""
        arrays = [(name, t) for name in _TENSORS if (t := getattr(rows, name)) is not None]
        arrays += [(f"extra.{k}", v) for k, v in rows.extra.items()]
        layout, offset = [], 0
        for name, t in arrays:
            layout.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset))
            offset += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        if offset > self.slot_bytes:
            return None
        while not self.free[worker].acquire(timeout=_WAIT_S):
            if os.getppid() != self.parent:  # the training process is gone: nobody will free a slot
                os._exit(1)
        slot = self.next_slot[worker]
        self.next_slot[worker] = (slot + 1) % self.slots
        view = self._view(worker, slot)
        for (_name, _dtype, _shape, at), (_, t) in zip(layout, arrays):
            if n := t.numel() * t.element_size():
                np.frombuffer(view, np.uint8, n, at)[:] = t.contiguous().reshape(-1).view(torch.uint8).numpy()
        return Handle(worker, slot, layout, rows.features, rows.report, list(rows.extra))

    # -- in the training process -------------------------------------------------------------
    def take(self, handle: Handle) -> Rows:
        """The rows of ``handle``, copied out of its slot, which is then free again."""
        view = self._view(handle.worker, handle.slot)
        out: dict[str, torch.Tensor] = {}
        try:
            for name, dtype, shape, at in handle.arrays:
                torch_dtype = getattr(torch, dtype)
                count = int(np.prod(shape, dtype=np.int64))
                if count == 0:
                    out[name] = torch.empty(shape, dtype=torch_dtype)
                    continue
                raw = np.frombuffer(view, np.uint8, count * torch_dtype.itemsize, at)
                out[name] = torch.from_numpy(raw.copy()).view(torch_dtype).reshape(shape)
        finally:
            view.release()
            self.free[handle.worker].release()
        return Rows(
            out["dense"],
            out["values"],
            out.get("lengths"),
            out["labels"],
            handle.features,
            {k: out[f"extra.{k}"] for k in handle.extra},
            out.get("real"),
            handle.report,
            out.get("id_weights"),
        )

    def close(self) -> None:
        try:
            self.memory.close()
        except BufferError:  # a view still exported: the mapping goes with the last reference
            pass


def slot_bytes_for(rows: int, dense: int, features: int, ids_per_row: float, weighted: bool, extra: int) -> int:
    """Bytes of a slot for ``rows`` rows: dense, labels, ids (int64, ``ids_per_row`` each on
    average, twice that for room), their lengths, weights and the ranking fields, and the
    padding mask."""
    ids = int(rows * max(1.0, ids_per_row) * 2) + features
    return (
        rows * (4 * dense + 4 + 1 + 8 * extra + 4 * features)
        + ids * (8 + (4 if weighted else 0))
        + (len(_TENSORS) + extra) * _ALIGN
    )


def describe(ring: SlotRing) -> str:
    return (
        f"{ring.workers} worker(s) x {ring.slots} slots of {ring.slot_bytes / 2**20:.1f} MiB "
        f"({ring.bytes / 2**20:.0f} MiB of shared memory)"
    )
