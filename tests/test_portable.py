"""hybridrec.data.portable: the same bits on every CPU, and close to the true values (checked
against ``decimal``, which computes in software, to 40 digits)."""

from decimal import Decimal, localcontext

import numpy as np
import pytest

from hybridrec.data import portable

pytestmark = pytest.mark.unit


def _ulps(got: np.ndarray, exact: list[Decimal]) -> float:
    want = np.array([float(x) for x in exact])
    return float(np.max(np.abs(got - want) / np.spacing(np.abs(want))))


def _exact(fn, xs) -> list[Decimal]:
    with localcontext() as c:
        c.prec = 40
        return [fn(Decimal(float(x))) for x in xs]


RNG = np.random.default_rng(0)
POSITIVE = np.concatenate(
    [
        RNG.random(300) * 1e-3,
        RNG.random(300) * 100,
        np.exp(RNG.normal(0, 30, 300)),
        [1.0, 2.0, 0.5, 1e-300, 1e300, 5e-324],
    ]
)
REALS = np.concatenate([RNG.normal(0, 1, 300), RNG.normal(0, 200, 300).clip(-740, 705), [0.0, 1e-12, -1e-12]])


def test_ln_exp_and_log1p_are_within_a_few_ulps():
    assert _ulps(portable.ln(POSITIVE), _exact(Decimal.ln, POSITIVE)) <= 2
    assert _ulps(portable.exp(REALS), _exact(Decimal.exp, REALS)) <= 2
    small = np.concatenate([POSITIVE[:600], -RNG.random(100) * 0.9, [1e-20, -1e-20]])
    assert _ulps(portable.log1p(small), _exact(lambda d: (d + 1).ln(), small)) <= 4
    assert portable.log1p(0.0) == 0.0 and portable.ln(1.0) == 0.0 and portable.exp(0.0) == 1.0


def test_edges_behave_as_numpy_s():
    with np.errstate(all="ignore"):
        x = np.array([0.0, -1.0, np.inf, np.nan])
        np.testing.assert_array_equal(portable.ln(x), np.log(x))
        e = np.array([-1000.0, 1000.0, np.nan, -745.1, 709.7])
        np.testing.assert_allclose(portable.exp(e), np.exp(e), rtol=1e-15)
        assert portable.log1p(-1.0) == -np.inf


def test_cos_sigmoid_power_and_normal():
    t = RNG.random(1000)
    np.testing.assert_allclose(portable.cos_2pi(t), np.cos(2 * np.pi * t), atol=1e-15)
    np.testing.assert_allclose(portable.sigmoid(REALS), 1 / (1 + np.exp(-REALS)), rtol=1e-14)
    np.testing.assert_allclose(portable.power(POSITIVE[:600], -1.05), POSITIVE[:600] ** -1.05, rtol=1e-13)
    z = portable.normal(1 - RNG.random(200_000), RNG.random(200_000))
    assert abs(z.mean()) < 0.01 and abs(z.std() - 1) < 0.01


def test_the_float32_tables_are_accurate_to_a_few_millionths():
    u = RNG.random(100_000, dtype=np.float32) * np.float32(0.999) + np.float32(1e-4)
    assert np.max(np.abs(portable.log2_f32(u) - np.log2(u.astype(np.float64)))) < 2e-6
    x = (u * 40 - 20).astype(np.float32)
    assert np.max(np.abs(portable.exp2_f32(x) / np.exp2(x.astype(np.float64)) - 1)) < 2e-6
    assert np.max(np.abs(portable.cos_2pi_f32(u) - np.cos(2 * np.pi * u.astype(np.float64)))) < 1e-6
    assert portable.cos_2pi_f32(np.float32([1.0]))[0] == portable.cos_2pi_f32(np.float32([0.0]))[0]
    z = portable.normal_f32(u, RNG.random(100_000, dtype=np.float32))
    assert z.dtype == np.float32 and abs(z.mean()) < 0.02 and abs(z.std() - 1) < 0.02


def test_the_results_are_pinned():
    """A change of any coefficient, table or step changes these bits: the generators built on
    these functions would draw other data (a new generator version)."""
    x = np.array([0.3, 1.7, 12.5, 1e-7])
    assert portable.ln(x).tobytes().hex() == "20a7bdfc7843f3bf91a91419e8fae03fb7fe2e38b134044073aa3e843b1e30c0"
    assert portable.exp(x).tobytes().hex() == "961a8c8c0599f53fa6f80d7752e5154066ba6525c5601041b1f2d71a0000f03f"
    f = np.float32([0.3, 0.9, 0.01, 0.5])
    assert (
        portable.log2_f32(f).tobytes().hex(),
        portable.exp2_f32(f).tobytes().hex(),
        portable.cos_2pi_f32(f).tobytes().hex(),
    ) == ("e354debfb6a61bbe789ad4c0000080bf", "24969d3f40dbee3fece3803ff304b53f", "7c379ebebb1b4f3fad7e7f3f000080bf")
