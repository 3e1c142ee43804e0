"""What a feature log's dense entries leave to be fitted on the train split: a standardized
column's mean and std, an encoded column's knots (``hybridrec.data.numeric``)."""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Iterable, Optional

import numpy as np
import pyarrow as pa

from hybridrec.data import DataError, numeric
from hybridrec.data.parquet.columns import _floats, _plain_array
from hybridrec.data.parquet.config import _Dense


def fit_dense(
    dense: list[_Dense], tables: Callable[[list[str]], Iterable[pa.Table]], rows: int
) -> Optional[list[_Dense]]:
    """``dense`` with the values it left unset fitted on the split that ``tables(columns)``
    reads (its ``rows`` rows, in order), or None when nothing is left to fit. The mean and
    std of each standardize column over every row, one table at a time (Chan's parallel
    update: the same numbers whatever the row groups' sizes); the knots of each encoded
    column on every k-th row (``numeric.SAMPLE``). Nulls and non-finite values (bad rows)
    are left out. A column with nothing to fit on is a DataError naming its entry."""
    todo = [
        i
        for i, d in enumerate(dense)
        if d.scalar and d.transform == "standardize" and (d.mean is None or d.std is None)
    ]
    to_encode = [i for i, d in enumerate(dense) if not d.scalar and d.knots is None]
    if not todo and not to_encode:
        return None
    columns = list(dict.fromkeys(dense[i].column for i in todo))
    stats = {c: (0, 0.0, 0.0) for c in columns}
    sampled = list(dict.fromkeys(dense[i].column for i in to_encode))
    samples: dict[str, list[np.ndarray]] = {c: [] for c in sampled}
    stride, at = max(1, -(-rows // numeric.SAMPLE)), 0
    for table in tables(list(dict.fromkeys(columns + sampled))):
        for c in sampled:  # rows 0, stride, 2 * stride, ... of the split
            x, _ = _floats(_plain_array(table.column(c)))
            samples[c].append(x[(-at) % stride :: stride])
        at += table.num_rows
        for c in columns:
            x, _ = _floats(_plain_array(table.column(c)))
            x = x[np.isfinite(x)]
            if not len(x):
                continue
            n, mean, m2 = stats[c]
            k, mk = len(x), float(x.mean())
            m2k = float(((x - mk) ** 2).sum())
            count = n + k
            delta = mk - mean
            stats[c] = (count, mean + delta * k / count, m2 + m2k + delta * delta * n * k / count)
    out = list(dense)
    for i in todo:
        d = dense[i]
        n, mean, m2 = stats[d.column]
        std = math.sqrt(m2 / n) if n else 0.0
        if not n or not std > 0:
            raise DataError(
                f"data.dense[{i}] ({d.column}): "
                + (
                    "no finite value in the train split to fit its mean and std"
                    if not n
                    else f"every training value is {mean:g}: a constant feature cannot be standardized (drop it, or set "
                    f"data.dense[{i}].mean and std)"
                )
            )
        out[i] = dataclasses.replace(d, mean=mean, std=std)
    for i in to_encode:
        d = dense[i]
        values = np.concatenate(samples[d.column]) if samples[d.column] else np.zeros(0)
        knots = numeric.fit_knots(values, d.buckets)
        if not knots:
            raise DataError(
                f"data.dense[{i}] ({d.column}): "
                + (
                    "no finite value in the train split to fit its knots"
                    if not np.isfinite(values).any()
                    else "one value only in the train split: a constant column cannot be encoded "
                    f"(drop it, or set data.dense[{i}].knots)"
                )
            )
        out[i] = dataclasses.replace(d, knots=tuple(knots))
    return out
