"""Elementwise math that gives the same bits on every CPU: what a source uses wherever a
transcendental function's result becomes part of a batch (an id, a label, a dense value).

NumPy's ``exp``, ``log``, ``power``, ``cos`` dispatch at run time to kernels for the CPU's
instruction set (SSE, AVX2, AVX-512, NEON); each is accurate to a few ulps, but not the same
few ulps, so the same seed drew other ids and labels on a CPU with AVX-512 than on one without.
The C library's functions (``math.exp``) differ by their FMA and non-FMA variants in the same way.

Here each function is range reduction by exact operations (``frexp``, ``ldexp``, ``floor``,
subtracting a float's integer part) and then either a polynomial evaluated by Horner's rule
(the float64 functions: within a few ulps) or a table with linear interpolation (the float32
functions ending in ``_f32``: within about 2e-6 relative, for the synthetic log's hot loop,
where they cost a fifth of the polynomials). Both use only additions, multiplications and
divisions, which IEEE 754 rounds exactly on every CPU and in every NumPy kernel (NumPy never
fuses a multiply and an add of two ufunc calls). The coefficients are Python floats of exact
rationals (``1 / 3``, ``1 / 5040``) and the tables are computed by the float64 functions, so
both are the same everywhere. ``tests/test_portable.py`` checks the accuracy against
``decimal``, which computes in software.
"""

from __future__ import annotations

import math

import numpy as np

LN2 = _LN2 = 0.6931471805599453  # ln 2, correctly rounded
LOG2E = _LOG2E = 1.4426950408889634  # 1 / ln 2, correctly rounded
_SQRT2 = 1.4142135623730951
_HALF_PI = 1.5707963267948966

# 2 * atanh(s) / s = 2 * (1 + s^2/3 + s^4/5 + ...): ln(m) for m in [1/sqrt 2, sqrt 2), s = (m-1)/(m+1),
# |s| <= 0.1716, s^2 <= 0.0295: 11 terms leave an error below 1e-17.
_ATANH = [2 / (2 * k + 1) for k in range(11)][::-1]
# e^z = sum z^n / n! for |z| <= ln(2) / 2: 15 terms leave an error below 1e-18.
_EXP = [1 / math.factorial(n) for n in range(15)][::-1]
# cos and sin of theta in [0, pi/2) by Taylor series: 12 terms each (error < 1e-17).
_COS = [(-1) ** k / math.factorial(2 * k) for k in range(12)][::-1]
_SIN = [(-1) ** k / math.factorial(2 * k + 1) for k in range(12)][::-1]
# ln 2 in two parts (fdlibm's): k * _LN2_HI is exact for |k| < 2^11
_LN2_HI, _LN2_LO = 6.93147180369123816490e-01, 1.90821492927058770002e-10


def _horner(coefficients: list[float], x: np.ndarray) -> np.ndarray:
    """sum c_i x^i, highest power first in ``coefficients``."""
    out = np.full_like(x, coefficients[0])
    for c in coefficients[1:]:
        out *= x
        out += c
    return out


def _f64(x: np.ndarray | float) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def ln(x: np.ndarray | float) -> np.ndarray:
    """Natural logarithm of positive finite ``x``, float64 (0 gives -inf, negatives nan)."""
    x = _f64(x)
    with np.errstate(invalid="ignore", divide="ignore"):
        m, e = np.frexp(x)  # x = m * 2^e, m in [0.5, 1): exact
        small = m < _SQRT2 / 2
        m = np.where(small, m * 2.0, m)  # now in [1/sqrt 2, sqrt 2): exact
        e = e - small
        s = (m - 1.0) / (m + 1.0)
        out = _horner(_ATANH, s * s) * s + e * _LN2
    out = np.where(x > 0, out, np.where(x == 0, -np.inf, np.nan))
    return np.where(np.isinf(x) & (x > 0), np.inf, out)


def log1p(x: np.ndarray | float) -> np.ndarray:
    """ln(1 + x) for x > -1, float64: exact for x = 0, and accurate for tiny x (the
    rounding of 1 + x is corrected, as in Goldberg's classic method)."""
    x = _f64(x)
    u = 1.0 + x
    with np.errstate(invalid="ignore", divide="ignore"):
        # ln(u) * x / (u - 1) corrects the rounding of 1 + x (u - 1 is exact)
        out = np.where(u == 1.0, x, ln(u) * (x / (u - 1.0)))
    return out


def exp(x: np.ndarray | float) -> np.ndarray:
    """e^x, float64; overflows to inf and underflows to 0 as float64 does."""
    x = _f64(x)
    with np.errstate(over="ignore", invalid="ignore"):
        k = np.floor(x * _LOG2E + 0.5)  # e^x = 2^k e^z
        k = np.clip(k, -1100, 1100)
        # z = x - k ln 2 in two parts (Cody and Waite): k * hi is exact, so z keeps its bits
        z = (x - k * _LN2_HI) - k * _LN2_LO
        out = np.ldexp(_horner(_EXP, z), k.astype(np.int32))
    out = np.where(x > 709.79, np.inf, np.where(x < -745.2, 0.0, out))  # beyond float64's range
    return np.where(np.isnan(x), np.nan, out)


def power(x: np.ndarray | float, y: float) -> np.ndarray:
    """x^y for positive ``x`` and a scalar ``y``, float64."""
    return exp(y * ln(x))


def sigmoid(x: np.ndarray | float) -> np.ndarray:
    """1 / (1 + e^-x), float64."""
    return 1.0 / (1.0 + exp(-_f64(x)))


def cos_2pi(t: np.ndarray) -> np.ndarray:
    """cos(2 pi t) for ``t`` in [0, 1), float64: the quadrant ``floor(4 t)`` is exact, then a
    series in the angle within it."""
    t = _f64(t) * 4.0
    q = np.floor(t)
    theta = (t - q) * _HALF_PI
    q = q.astype(np.int64) % 4
    z = theta * theta
    c, s = _horner(_COS, z), _horner(_SIN, z) * theta
    return np.choose(q, [c, -s, -c, s])


def normal(u1: np.ndarray, u2: np.ndarray) -> np.ndarray:
    """Standard normal deviates from two arrays of uniforms in (0, 1) (Box and Muller),
    float64."""
    return np.sqrt(-2.0 * ln(u1)) * cos_2pi(u2)


# ------------------------------------------------------------------ float32, by table
# Linear interpolation between _K + 1 knots: the error is at most (1/_K)^2 / 8 of the second
# derivative, 1e-8 for log2 on [0.5, 1] and 2^r on [0, 1], below float32's resolution.
_K = 4096
_LOG2_KNOTS = (ln(0.5 + np.arange(_K + 1) / (2 * _K)) * _LOG2E).astype(np.float32)  # log2 on [0.5, 1]
_EXP2_KNOTS = exp(np.arange(_K + 1) / _K * _LN2).astype(np.float32)  # 2^r on [0, 1]
_COS_K = 4 * _K  # cos(2 pi t) varies faster: (2 pi / 16384)^2 / 8 = 1.8e-8
_COS_KNOTS = cos_2pi(np.arange(_COS_K + 1) / _COS_K).astype(np.float32)
_SLOPES = {id(t): np.diff(t).astype(np.float32) for t in (_LOG2_KNOTS, _EXP2_KNOTS, _COS_KNOTS)}


def _interpolate(knots: np.ndarray, t: np.ndarray) -> np.ndarray:
    """``knots`` interpolated at ``t`` in [0, len(knots) - 1), float32 (``t`` is consumed)."""
    i = t.astype(np.int32)
    t -= i  # the fraction: exact
    out = np.take(_SLOPES[id(knots)], i)
    out *= t
    out += np.take(knots, i)
    return out


def log2_f32(x: np.ndarray) -> np.ndarray:
    """log2 of positive finite float32 ``x``."""
    m, e = np.frexp(np.asarray(x, dtype=np.float32))  # m in [0.5, 1): exact
    m *= np.float32(2 * _K)
    m -= np.float32(_K)  # [0, K): exact
    out = _interpolate(_LOG2_KNOTS, m)
    out += e
    return out


def exp2_f32(x: np.ndarray) -> np.ndarray:
    """2^x for float32 ``x`` within float32's range."""
    x = np.asarray(x, dtype=np.float32)
    whole = np.floor(x)
    r = x - whole  # [0, 1): exact
    r *= np.float32(_K)
    return np.ldexp(_interpolate(_EXP2_KNOTS, r), whole.astype(np.int32))


def cos_2pi_f32(t: np.ndarray) -> np.ndarray:
    """cos(2 pi t) for float32 ``t`` >= 0 (periodic: 1 is 0)."""
    t = np.asarray(t, dtype=np.float32)
    t = t - np.floor(t)  # [0, 1): exact
    t *= np.float32(_COS_K)
    return _interpolate(_COS_KNOTS, t)


def normal_f32(u1: np.ndarray, u2: np.ndarray) -> np.ndarray:
    """Standard normal deviates from two float32 arrays of uniforms in (0, 1) (Box and Muller)."""
    r = log2_f32(u1)
    r *= np.float32(-2 * _LN2)
    np.sqrt(r, out=r)
    r *= cos_2pi_f32(u2)
    return r
