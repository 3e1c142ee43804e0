"""Criteo's binary layout converted on the training device (``data.device_input``): the CPU
copies each rank's rows as the files store them (memory-mapped ranges) into a reused pinned
buffer, one copy to the device; the dtype casts, the id mapping (``modulo`` or ``hash``) and the
data checks run there, with ``CriteoBinary.read``'s result, byte for byte (tested on the CPU
for every stored dtype the layout accepts, both mappings, held-out runs and rows across days).

The checks (a label not 0 or 1, a dense value not finite in float32, a negative id) set a flag
on the device; the trainer reads it where it reads the losses, and a set flag reads the batches
since the last read again on the CPU, which stops the run naming the file and row, as
``read`` does (``hybridrec.data.device_input.DeviceChecks``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hybridrec.config import IdMapping
from hybridrec.data.criteo.common import CAT_FEATURES
from hybridrec.data.device_input import DeviceChecks, Staging, as_signed, widen
from hybridrec.data.rows import Rows

if TYPE_CHECKING:
    from hybridrec.data.criteo.binary import CriteoBinary

_MAX63 = (1 << 63) - 1


def _signed(c: int) -> int:
    """A 64-bit constant as the int64 of its bits (products wrap the same in two's complement)."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _shift(x: torch.Tensor, k: int) -> torch.Tensor:
    """x >> k on the 64 bits as unsigned (torch's >> on int64 copies the sign bit)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """``hybridrec.data.splitmix64`` on int64 holding uint64 bits."""
    x = x ^ _shift(x, 30)
    x = x * _signed(0xBF58476D1CE4E5B9)
    x = x ^ _shift(x, 27)
    x = x * _signed(0x94D049BB133111EB)
    return x ^ _shift(x, 31)


def unsigned_mod(u: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """u mod n, u int64 holding uint64 bits, 0 < n < 2**62: from u's upper 63 bits, so that no
    intermediate is negative or overflows."""
    return ((_shift(u, 1) % n) * 2 + (u & 1)) % n


class BinaryOnDevice:
    """``source.read``'s training rows, converted on ``device``: call it as
    ``(split, index, lo, hi)``; ``check()`` reads the data checks' flag."""

    def __init__(self, source: "CriteoBinary", device: torch.device) -> None:
        self.source, self.device = source, torch.device(device)
        if int(source.sizes.max()) >= 1 << 62:
            raise ValueError("data.device_input: Criteo tables of 2**62 rows or more are mapped on the CPU only")
        self.staging = Staging(self.device)
        self.checks = DeviceChecks(self.device, lambda split, index, lo, hi: source.read(split, 0, index, lo, hi))
        self.sizes = torch.as_tensor(source.sizes, dtype=torch.int64, device=self.device)[:, None]
        self.hash = source.id_mapping == IdMapping.hash

    def check(self) -> None:
        self.checks.check()

    def __call__(self, split: str, index: int, lo: int, hi: int, epoch: int = 0) -> Rows:
        """(``epoch``: the layout's rows are read in the same order every epoch.)"""
        _, dense, sparse, labels = self.source.stored(split, index, lo, hi)
        n = len(labels)
        kinds = (dense.dtype, sparse.dtype, labels.dtype)
        d, x, y = self.staging.put([as_signed(a) for a in (dense, sparse, labels)])
        dense32 = d.to(torch.float32)
        raw = widen(x, kinds[1]).t()  # [26, n]: the batch's id array is feature-major
        label = widen(y, kinds[2]) if kinds[2].kind in "iu" else y
        label = label.reshape(-1)
        bad = ~torch.isfinite(dense32).all() | ((label != 0) & (label != 1)).any()
        if kinds[1].kind == "i":
            bad = bad | (raw < 0).any()
        self.checks.add(bad, split, index, lo, hi)
        ids = unsigned_mod(splitmix64(raw) if self.hash else raw, self.sizes)
        return Rows(
            dense32.contiguous(),
            ids.contiguous().view(-1),
            None,
            label.to(torch.float32),
            CAT_FEATURES,
            totals=[n] * CAT_FEATURES,
        )
