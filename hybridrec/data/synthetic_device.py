"""The synthetic click log drawn by torch on the training device: the same bytes as
``SyntheticClickLog``'s NumPy generator, on a CPU or a GPU.

A GPU rank then builds its batch where it consumes it: a few dozen elementwise kernels over the
batch's ``rows x columns`` random numbers, issued inside TorchRec's pipeline on its copy stream,
so that they overlap the previous step; no host work per row, no pinned copy, no host-device
transfer. On one GPU this is what lets the input keep up with the step (docs/performance.md).

Why the bytes are equal: the NumPy generator uses only integer hashes and the exactly rounded
IEEE operations of ``hybridrec.data.portable`` (additions, multiplications, divisions, square
roots, ``frexp``, table lookups). Each line below is the same operation on the same dtype, one
torch op per NumPy op (torch's eager kernels never fuse a multiply and an add), with four
differences that change no bit, each justified where it is made:

- unsigned 32-bit arithmetic runs in int64 and is masked to 32 bits (torch has no uint32
  multiply); a product that passes 2**63 wraps, and its low 32 bits are the same;
- ``rank * _SCATTER % n`` (up to 2**64, unsigned in NumPy) is reduced in two halves, so that no
  int64 intermediate overflows;
- the float32 square root is corrected to the correctly rounded one (``_sqrt_f32``);
- ``ldexp`` builds the power of two from its exponent bits (``torch.ldexp`` multiplies by
  ``pow(2, e)``, whose rounding is the device library's).

``tests/test_synthetic_device.py`` compares the bytes with NumPy's for every dense
distribution, one-hot and multi-hot rows and both Zipf branches; the GPU tier compares them on
the GPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from hybridrec.config import DenseDistribution
from hybridrec.data import DataError, portable
from hybridrec.data.rows import Rows

if TYPE_CHECKING:
    from hybridrec.data.synthetic import SyntheticClickLog

_M32 = 0xFFFFFFFF
_F32 = lambda c: float(np.float32(c))  # noqa: E731  (a constant rounded as NumPy's float32 scalar is)


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """``synthetic._fmix32`` on int64 holding uint32 values."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def _pow2_f32(e: torch.Tensor) -> torch.Tensor:
    """2**e as float32, exactly, for integer ``e`` in [-126, 127] (from its exponent bits)."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def _pow2_f64(e: torch.Tensor) -> torch.Tensor:
    """2**e as float64, exactly, for integer ``e`` in [-1022, 1023]."""
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)


class _Tables:
    """``portable``'s float32 interpolation tables on one device."""

    def __init__(self, device: torch.device) -> None:
        def put(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device)

        self.log2 = put(portable._LOG2_KNOTS), put(portable._SLOPES[id(portable._LOG2_KNOTS)])
        self.exp2 = put(portable._EXP2_KNOTS), put(portable._SLOPES[id(portable._EXP2_KNOTS)])
        self.cos = put(portable._COS_KNOTS), put(portable._SLOPES[id(portable._COS_KNOTS)])


def _interpolate(table: tuple[torch.Tensor, torch.Tensor], t: torch.Tensor) -> torch.Tensor:
    knots, slopes = table
    i = t.to(torch.int32)  # t >= 0: truncation is floor, as NumPy's astype
    frac = t - i.to(torch.float32)  # exact (NumPy: in float64, then rounded: the same exact value)
    flat = i.reshape(-1).long()
    return slopes[flat].view_as(t) * frac + knots[flat].view_as(t)


def _log2_f32(x: torch.Tensor, tab: _Tables) -> torch.Tensor:
    m, e = torch.frexp(x)
    m = m * _F32(2 * portable._K) - _F32(portable._K)
    # NumPy adds the int32 exponent in float64 and rounds once: the same as one float32 addition
    return _interpolate(tab.log2, m) + e.to(torch.float32)


def _exp2_f32(x: torch.Tensor, tab: _Tables) -> torch.Tensor:
    whole = torch.floor(x)
    r = (x - whole) * _F32(portable._K)
    return _interpolate(tab.exp2, r) * _pow2_f32(whole)


def _cos_2pi_f32(t: torch.Tensor, tab: _Tables) -> torch.Tensor:
    t = (t - torch.floor(t)) * _F32(portable._COS_K)
    return _interpolate(tab.cos, t)


def _sqrt_f32(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded float32 square root of non-negative ``x``, as NumPy's (the CPU's
    instruction). torch's CPU kernel for float32 is vectorized by SLEEF to within 0.5001 ulp,
    not correctly rounded (it differed from NumPy in 15% of a batch's normals): here the
    float64 root rounded to float32 is corrected against the midpoints between it and its
    neighbours, whose squares float64 holds exactly (25-bit numbers, 50-bit squares)."""
    s = torch.sqrt(x.to(torch.float64)).to(torch.float32)
    x64, s64 = x.to(torch.float64), s.to(torch.float64)
    above = (s64 + torch.nextafter(s, torch.full_like(s, torch.inf)).to(torch.float64)) * 0.5
    below = (s64 + torch.nextafter(s, torch.zeros_like(s)).to(torch.float64)) * 0.5
    s = torch.where(above * above < x64, torch.nextafter(s, torch.full_like(s, torch.inf)), s)
    return torch.where((below * below > x64) & (s > 0), torch.nextafter(s, torch.zeros_like(s)), s)


def _normal_f32(u1: torch.Tensor, u2: torch.Tensor, tab: _Tables) -> torch.Tensor:
    r = _sqrt_f32(_log2_f32(u1, tab) * _F32(-2 * portable._LN2))
    return r * _cos_2pi_f32(u2, tab)


def _horner(coefficients: list[float], x: torch.Tensor) -> torch.Tensor:
    out = torch.full_like(x, coefficients[0])
    for c in coefficients[1:]:
        out = out * x
        out = out + c
    return out


def _sigmoid_f64(x: torch.Tensor) -> torch.Tensor:
    """``portable.sigmoid`` (float64)."""
    x = -x
    k = torch.clamp(torch.floor(x * portable._LOG2E + 0.5), -1100, 1100)
    z = (x - k * portable._LN2_HI) - k * portable._LN2_LO
    # ldexp by two exact powers of two, so that k in [-1100, 1100] stays in float64's exponents
    half = torch.div(k, 2, rounding_mode="floor")
    e = _horner(portable._EXP, z) * _pow2_f64(half) * _pow2_f64(k - half)
    e = torch.where(x > 709.79, torch.inf, torch.where(x < -745.2, 0.0, e))
    e = torch.where(torch.isnan(x), torch.nan, e)
    return 1.0 / (1.0 + e)


class DeviceGenerator:
    """``log``'s rows drawn by torch on ``device``: ``rows(split, index, lo, hi)``; with
    ``graph`` (a GPU), replayed from a CUDA graph of the draw (``GraphedDraw``)."""

    def __init__(self, log: "SyntheticClickLog", device: torch.device, scatter: int, graph: bool = False) -> None:
        self.log, self.device = log, torch.device(device)
        self.tab = _Tables(self.device)

        def put(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.as_tensor(np.ascontiguousarray(a), dtype=dtype, device=self.device)

        self.column_rows = put(log._column_rows.astype(np.int64), torch.int64)
        self.log2_rows = put(log._log2_rows, torch.float32)
        self.zipf_scale = put(log._zipf_scale, torch.float32)
        self.salt = put(log._feature_salt.astype(np.int64), torch.int64)
        # the dense weights as float64 (NumPy multiplies a float32 column by its float64 scalar)
        self.dense_w = put(np.asarray([float(w) for w in log._dense_w], np.float64).reshape(-1, 1), torch.float64)
        # features grouped by their ids per row k: each group's means are one gather and k
        # elementwise kernels over all its features, not 4 kernels per feature (the host's
        # kernel launches, not the GPU, bound a drawn batch)
        by_k: dict[int, list[int]] = {}
        for f, k in enumerate(log._sizes):
            by_k.setdefault(k, []).append(f)
        self.groups = [
            (
                k,
                put(np.asarray(fs, np.int64), torch.int64),
                put(np.asarray([log._offsets[f] + j for f in fs for j in range(k)], np.int64), torch.int64),
            )
            for k, fs in by_k.items()
        ]
        # rank * scatter % n in two halves: (rank * hi % n) * 2**16 + rank * lo, all < 2**49
        self.scatter_hi, self.scatter_lo = scatter >> 16, scatter & 0xFFFF
        self.lengths: dict[int, torch.Tensor] = {}  # multi-hot lengths [F, rows], for the last shape
        self._draw = GraphedDraw(self.draw, self.device) if graph else self._eager

    def uniforms(self, key: torch.Tensor, lo: torch.Tensor, n: int) -> torch.Tensor:
        """The ``[columns, n]`` uniforms of rows ``lo .. lo + n`` of the batch whose hash key is
        ``key`` (both 0-dim int64 tensors on the device, so that a CUDA graph of the draw takes
        them as inputs)."""
        total = self.log._columns
        c = torch.arange(total, dtype=torch.int64, device=self.device)[:, None]
        r = torch.arange(n, dtype=torch.int64, device=self.device) + lo
        h = (c + r * total) ^ key
        h = _fmix32(h) >> 8
        return (h.to(torch.float32) + 0.5) * _F32(2.0**-24)

    def zipf(self, u: torch.Tensor) -> torch.Tensor:
        a, n = self.log.zipf_exponent, self.column_rows
        if abs(a - 1.0) < 1e-9:
            x = _exp2_f32(u * self.log2_rows, self.tab)
        else:
            x = _log2_f32(u * self.zipf_scale + 1.0, self.tab) * _F32(1 / (1 - a))
            x = _exp2_f32(x, self.tab)
        rank = torch.minimum(x.to(torch.int64) - 1, n - 1)  # x >= 1: truncation as NumPy's astype(uint64)
        return ((rank * self.scatter_hi) % n * 65536 + rank * self.scatter_lo) % n

    def planted_weights(self, ids: torch.Tensor) -> torch.Tensor:
        h = ((ids & _M32) * 0x9E3779B1 + self.salt) & _M32
        return _fmix32(h).to(torch.float32) * _F32(2.0**-31) - 1.0

    def rows(self, split: str, index: int, lo: int, hi: int, epoch: int = 0) -> Rows:
        """(``epoch``: the log has none; a batch is drawn from its split and index alone.)"""
        log, n = self.log, hi - lo
        dense, ids, labels = self._draw(int(log._key(split, index)), lo, n)
        if log._one_hot:
            return Rows(dense, ids.reshape(-1), None, labels, len(log._sizes), totals=[n] * len(log._sizes))
        values = torch.cat([ids[first : first + k].t().reshape(-1) for first, k in zip(log._offsets, log._sizes)])
        if n not in self.lengths:  # the KeyedJaggedTensor never writes its lengths: shared by batches
            self.lengths = {n: torch.tensor(log._sizes, dtype=torch.int32, device=self.device)[:, None].repeat(1, n)}
        lengths = self.lengths[n]
        return Rows(dense, values, lengths, labels, len(log._sizes), totals=[n * k for k in log._sizes])

    def _eager(self, key: int, lo: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        def scalar(v: int) -> torch.Tensor:  # a fill kernel on a GPU: no host-device copy
            return torch.full((), v, dtype=torch.int64, device=self.device)

        return self.draw(scalar(key), scalar(lo), n)

    def draw(self, key: torch.Tensor, lo: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The dense ``[n, d]``, ids ``[ids, n]`` and labels ``[n]`` of ``uniforms(key, lo, n)``:
        device work only (no host value read, no host-device copy), which a CUDA graph can
        capture (``GraphedDraw``)."""
        log, tab = self.log, self.tab
        d = log.num_dense_features
        u = self.uniforms(key, lo, n)
        if log.dense_distribution == DenseDistribution.uniform:
            columns = u[:d]
            signal = (columns - 0.5) * _F32(3.4)
        else:
            z = _normal_f32(u[:d], u[d : 2 * d], tab)
            if log.dense_distribution == DenseDistribution.lognormal:
                e = _exp2_f32(z * _F32(1.5 * portable.LOG2E), tab) + 1.0
                columns = _log2_f32(e, tab) * _F32(portable.LN2)
                signal = (columns - 1.0) / _F32(0.8)
            else:
                columns = signal = z
        dense = columns.t().contiguous()
        ids = self.zipf(u[2 * d : 2 * d + log._ids])
        weights = self.planted_weights(ids)
        logit = torch.full((n,), -1.0, dtype=torch.float64, device=self.device)
        # each term as NumPy's (float32 x a float64 scalar is float64), all in one kernel; the
        # sum in NumPy's order, one addition per term, so that every rounding is the same
        terms = 1.5 * (signal.to(torch.float64) * self.dense_w)
        for j in range(d):
            logit = logit + terms[j]
        scale = float(3.0 / np.sqrt(len(log._sizes)))  # a float64 scalar in NumPy: the product is float64
        means = torch.empty((len(log._sizes), n), dtype=torch.float64, device=self.device)
        for k, features, id_rows in self.groups:
            w = weights.index_select(0, id_rows).view(len(features), k, n)
            total = w[:, 0]
            for j in range(1, k):  # a row's k ids summed in NumPy's order
                total = total + w[:, j]
            means.index_copy_(0, features, scale * (total / _F32(k)).to(torch.float64))
        for f in range(len(log._sizes)):
            logit = logit + means[f]
        labels = (u[-1].to(torch.float64) < _sigmoid_f64(logit)).to(torch.float32)
        return dense, ids, labels


class GraphedDraw:
    """``DeviceGenerator.draw`` replayed from a CUDA graph, one per batch size.

    A drawn batch is some 240 small elementwise kernels, and on a GPU the host's time to issue
    them, not the GPU's to run them, is what a drawn batch costs (docs/performance.md). A
    replay issues the same kernels in one launch: per batch the host writes the key and the
    first row into the graph's two input tensors (fill kernels), replays, and copies the three
    outputs out, since the next replay rewrites them while the pipeline still holds this batch.
    The bytes are the eager draw's (the same kernels on the same inputs)."""

    def __init__(self, draw: Callable[..., tuple[torch.Tensor, ...]], device: torch.device) -> None:
        self.draw, self.device = draw, device
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]] = {}

    def __call__(self, key: int, lo: int, n: int) -> tuple[torch.Tensor, ...]:
        if n not in self.graphs:
            self.graphs[n] = self._capture(n)
        graph, key_in, lo_in, out = self.graphs[n]
        key_in.fill_(key)
        lo_in.fill_(lo)
        graph.replay()
        return tuple(t.clone() for t in out)

    def _capture(self, n: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
        key_in = torch.zeros((), dtype=torch.int64, device=self.device)
        lo_in = torch.zeros((), dtype=torch.int64, device=self.device)
        # one eager draw on a side stream first, as torch's CUDA graph guide does: kernels'
        # lazy loading and the allocator's first blocks happen outside the capture
        side, current = torch.cuda.Stream(self.device), torch.cuda.current_stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            self.draw(key_in, lo_in, n)
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: CUDA calls of other threads (the NCCL watchdog's event queries)
            # during the capture must not invalidate it
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                out = self.draw(key_in, lo_in, n)
        except torch.OutOfMemoryError:
            raise  # the rank's one line for a device out of memory
        except RuntimeError as e:
            said = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DataError(
                f"data.device_graph=true: the synthetic log's draw of {n} rows could not be captured in a "
                f"CUDA graph on {self.device} ({said}); leave data.device_graph unset (the eager draw)"
            ) from e
        return graph, key_in, lo_in, out
