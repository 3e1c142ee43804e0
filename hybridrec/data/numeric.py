"""Numbers as embeddings: a numeric column read as ids of a table of its own, the encodings
a feature log's dense columns may take (``data.dense[i].encoding``) beside ``scalar``.

- ``bucketized``: the column's knots ``k_0 < ... < k_m`` (quantiles of the train split) cut
  the numbers into m buckets; a number is the id of its bucket (one id per row, a table of m
  rows). Below ``k_1`` is bucket 0, from ``k_{m-1}`` up the last one.
- ``piecewise_linear``: a number between knots ``k_t`` and ``k_{t+1}`` is two ids, t and
  t + 1, weighted ``1 - f`` and ``f`` (f its position between them), sum-pooled: its vector
  is the linear interpolation of the knots' learned vectors (a table of m + 1 rows), numbers
  outside the knots take the nearest knot's. That is a learned piecewise-linear function of
  the number per embedding dimension, the function class of Gorishniy et al.'s
  piecewise-linear encoding followed by a linear layer (2022), with two ids per row instead
  of m weights. A TorchRec table with per-id weights computes it, so the planner shards it
  like every table.

The same functions encode the training rows (``hybridrec.data.parquet``) and serving's raw
rows (``hybridrec.serving.preprocess``), from the knots the run's config carries.

May import: nothing of hybridrec.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

ENCODINGS = ("scalar", "bucketized", "piecewise_linear")
MAX_BUCKETS = 65_536
"""The most buckets a column is cut into."""
SAMPLE = 1_000_000
"""Values per column the knots are fitted on: every k-th training row, k = ceil(rows / SAMPLE)."""


def fit_knots(values: np.ndarray, buckets: int) -> list[float]:
    """The knots of ``buckets`` equal-count buckets over the finite ``values``: their
    quantiles at 0, 1/buckets, ..., 1, ties merged (a column of few distinct values, or one
    mostly 0, gets fewer buckets). Fewer than 2 knots (one distinct value) is []: nothing to
    encode, which the caller reports."""
    x = values[np.isfinite(values)]
    if not len(x):
        return []
    knots = np.unique(np.quantile(x.astype(np.float64), np.linspace(0.0, 1.0, buckets + 1)))
    return [float(k) for k in knots] if len(knots) >= 2 else []


def rows_of(encoding: str, knots: list[float]) -> int:
    """Rows of the table an encoded column looks up."""
    return len(knots) - 1 if encoding == "bucketized" else len(knots)


def encode(x: np.ndarray, encoding: str, knots: list[float]) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
    """Finite numbers ``x`` (float64) as (table rows flat, ids per row, id weights or None)."""
    k = np.asarray(knots, np.float64)
    n = len(x)
    if encoding == "bucketized":
        return np.searchsorted(k[1:-1], x, side="right").astype(np.int64), np.ones(n, np.int32), None
    t = np.clip(np.searchsorted(k, x, side="right") - 1, 0, len(k) - 2)
    with np.errstate(over="ignore"):  # a number far outside the knots: +-inf, clipped to the nearest knot
        f = np.clip((x - k[t]) / (k[t + 1] - k[t]), 0.0, 1.0)
    ids = np.stack([t, t + 1], axis=1).reshape(-1).astype(np.int64)
    weights = np.stack([1.0 - f, f], axis=1).reshape(-1).astype(np.float32)
    return ids, np.full(n, 2, np.int32), weights


def check_knots(knots: object) -> Optional[str]:
    """Why ``knots`` (a config's or an export's) cannot be knots, or None: at least 2
    finite numbers, strictly increasing."""
    if not isinstance(knots, (list, tuple)) or len(knots) < 2:
        return "a list of at least 2 numbers"
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v) for v in knots):
        return "finite numbers"
    if any(b <= a for a, b in zip(knots, knots[1:])):
        return "strictly increasing numbers"
    return None
