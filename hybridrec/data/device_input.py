"""What every source that converts its rows on the training device shares (``data.device_input``):
host buffers reused for the copy to the device, and data checks that never make the host wait.

- ``Staging``: the host side of a batch (a file's bytes, as stored) goes into one of a few
  reused buffers, pinned on a GPU, then to the device in one asynchronous copy; a buffer is
  written again only after the event recorded behind its copy has completed. On the CPU
  (``torch.device("cpu")``, which the tests run) the arrays are copied into fresh tensors.
- ``DeviceChecks``: a check that finds a bad value on the device sets a flag there instead of
  reading it back; ``check()``, which the trainer calls where it already reads the losses, reads
  the flag once for every batch since the last call and, when it is set, reads those batches
  again on the CPU, whose reader names the file and row (``Source.read`` raises the DataError).
- ``resident``, ``gather_ranges``, ``one_hot``: for sources whose arrays stay on the device
  (the next-item histories, MovieLens' ratings), which gather each batch there by index.
- ``log1p``: ``hybridrec.data.portable.log1p`` on the device, the same operations in the same
  order, so the same bits as the CPU's reader.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np
import torch

from hybridrec.data import portable

_ALIGN = 16  # each array's offset in a staging buffer: any dtype's view of it is aligned


def _dtype(a: np.ndarray) -> torch.dtype:
    return torch.from_numpy(np.empty(0, a.dtype)).dtype


def as_signed(a: np.ndarray) -> np.ndarray:
    """Unsigned integers as the signed ones of their width, the same bytes (torch's unsigned
    dtypes above 8 bits support few operations): ``widen`` gives the values back on the device."""
    return a.view(f"i{a.dtype.itemsize}") if a.dtype.kind == "u" and a.dtype.itemsize > 1 else a


def widen(t: torch.Tensor, stored: np.dtype) -> torch.Tensor:
    """int64 of what ``as_signed`` transferred: the stored values (a uint64 above 2**63 keeps its
    bits, which unsigned arithmetic then reads as such)."""
    x = t.to(torch.int64)
    if stored.kind == "u" and 1 < stored.itemsize < 8:
        x = x & ((1 << (8 * stored.itemsize)) - 1)
    return x


def resident(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A source's array on ``device`` for the run: copied once, when the reader is made (a copy
    on the CPU too: the source's arrays may be read-only views of Arrow's buffers)."""
    return torch.from_numpy(np.array(a)).to(device)


def gather_ranges(values: torch.Tensor, begins: torch.Tensor, lengths: torch.Tensor, total: int) -> torch.Tensor:
    """``values[begins[i] : begins[i] + lengths[i]]`` of every i, one after the other (int64
    ``begins`` and ``lengths`` on ``values``' device). ``total``, the sum of ``lengths``, comes
    from the host's copy of the index arrays: on a GPU, a size counted on the device would make
    the host wait for it before it could size the output."""
    if total == 0:
        return values[:0]
    device = values.device
    row = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths, output_size=total)
    shift = begins - (torch.cumsum(lengths, 0) - lengths)  # a row's first value, less its place in the output
    return values[shift[row] + torch.arange(total, device=device)]


def _ln(x: torch.Tensor) -> torch.Tensor:
    """``portable.ln`` (float64)."""
    m, e = torch.frexp(x)
    small = m < portable._SQRT2 / 2
    m = torch.where(small, m * 2.0, m)
    s = (m - 1.0) / (m + 1.0)
    z = s * s
    out = torch.full_like(z, portable._ATANH[0])
    for c in portable._ATANH[1:]:  # Horner's rule, one rounding per operation as in NumPy
        out = out * z + c
    out = out * s + (e - small.to(e.dtype)).to(torch.float64) * portable._LN2
    out = torch.where(x > 0, out, torch.where(x == 0, -torch.inf, torch.nan))
    return torch.where(torch.isinf(x) & (x > 0), torch.inf, out)


def log1p(x: torch.Tensor) -> torch.Tensor:
    """``portable.log1p`` of float64 ``x``."""
    u = 1.0 + x
    return torch.where(u == 1.0, x, _ln(u) * (x / (u - 1.0)))


def one_hot(lengths: Sequence[np.ndarray]) -> bool:
    """Whether ``Rows.of`` lays out unweighted rows of these ids per feature and row (host
    arrays) one-hot, without lengths: every feature one id in every row, or no rows."""
    return all(bool((k == 1).all()) for k in lengths)


class Staging:
    """``put(arrays)``: the NumPy arrays as tensors on ``device``, through ``depth`` reused host
    buffers (pinned, on a GPU)."""

    def __init__(self, device: torch.device, depth: int = 3) -> None:
        self.device, self.depth = torch.device(device), depth
        self.slots: list[Optional[tuple[torch.Tensor, Optional[torch.cuda.Event]]]] = [None] * depth
        self.next = 0

    def put(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        if self.device.type == "cpu":  # no copy to make asynchronous: the rows are the batch
            return [torch.from_numpy(np.array(a)) for a in arrays]
        offsets, size = [], 0
        for a in arrays:
            offsets.append(size)
            size += -(-a.nbytes // _ALIGN) * _ALIGN
        buffer = self._buffer(max(size, _ALIGN))
        host = buffer.numpy()
        for a, at in zip(arrays, offsets):
            host[at : at + a.nbytes].view(a.dtype).reshape(a.shape)[...] = a  # the one host copy: file -> pinned
        on_device = buffer[:size].to(self.device, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.slots[self.next] = (buffer, event)
        self.next = (self.next + 1) % self.depth
        return [on_device[at : at + a.nbytes].view(_dtype(a)).view(a.shape) for a, at in zip(arrays, offsets)]

    def _buffer(self, size: int) -> torch.Tensor:
        """The next slot's buffer, once the copy that last read it has completed (waiting only
        when ``depth`` copies are still in flight); grown when too small."""
        slot = self.slots[self.next]
        if slot is not None:
            buffer, event = slot
            if event is not None:
                event.synchronize()
            if buffer.numel() >= size:
                return buffer
        return torch.empty(size, dtype=torch.uint8, pin_memory=True)


class DeviceChecks:
    """Flags set on the device by a batch's data checks, and the batches they cover."""

    def __init__(self, device: torch.device, reread: Callable[[str, int, int, int], object]) -> None:
        self.flag = torch.zeros((), dtype=torch.bool, device=device)
        self.pending: list[tuple[str, int, int, int]] = []
        self.reread = reread

    def add(self, bad: torch.Tensor, split: str, index: int, lo: int, hi: int) -> None:
        """One batch's result (a 0-dim bool on the device: True = a bad value somewhere)."""
        self.flag |= bad
        self.pending.append((split, index, lo, hi))

    def check(self) -> None:
        """Read the flag (the one host-device synchronization); if a batch since the last check
        had a bad value, read the batches again on the CPU, which raises the reader's DataError
        naming the file and row."""
        if not self.pending:
            return
        if bool(self.flag):
            for coordinates in self.pending:
                self.reread(*coordinates)
            raise AssertionError(f"the device flagged a bad value the CPU's reader accepts, in {self.pending}")
        self.pending.clear()
