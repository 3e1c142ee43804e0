"""Criteo's columns and what both formats share: the files a path names (``resolve_paths``),
the 26 tables (``criteo_tables``) and how raw ids map into them (``map_ids``), the estimate of
and the warning about ids that collide in a table, and the checked validation fraction."""

from __future__ import annotations

import glob
import logging
import os
from typing import Optional

import numpy as np

from hybridrec.config import IdMapping
from hybridrec.data import DataError, SparseFeature, missing_hint, splitmix64

log = logging.getLogger("hybridrec.data.criteo")  # the package's name: its log lines read as before the split

INT_FEATURES, CAT_FEATURES = 13, 26
COLUMNS = ["label"] + [f"int_{i}" for i in range(INT_FEATURES)] + [f"cat_{i}" for i in range(CAT_FEATURES)]


def resolve_paths(spec: Optional[str], key: str, pattern: str = "*") -> list[str]:
    """A file, a directory (its files matching ``pattern``, sorted) or a glob."""
    if not spec:
        raise DataError(f"{key} is not set")
    if any(ch in spec for ch in "*?["):
        paths = sorted(p for p in glob.glob(spec) if os.path.isfile(p))
    elif os.path.isdir(spec):
        paths = sorted(glob.glob(os.path.join(spec, pattern)))
    else:
        paths = [spec] if os.path.isfile(spec) else []
    if not paths:
        raise DataError(f"{key}={spec}: no such file, or no file in that directory / glob{missing_hint(spec)}")
    return paths


def criteo_tables(num_embeddings_per_feature: list[int]) -> tuple[list[SparseFeature], np.ndarray]:
    """The 26 categorical features and their table sizes, checked."""
    if len(num_embeddings_per_feature) != CAT_FEATURES:
        raise DataError(
            f"data.num_embeddings_per_feature needs {CAT_FEATURES} sizes for Criteo, "
            f"got {len(num_embeddings_per_feature)}"
        )
    features = [SparseFeature(f"cat_{i}", int(n)) for i, n in enumerate(num_embeddings_per_feature)]
    return features, np.array(num_embeddings_per_feature, dtype=np.int64)


def map_ids(raw: np.ndarray, sizes: np.ndarray, mapping: IdMapping, feature_major: bool = False) -> np.ndarray:
    """Raw 32-bit ids (n, F) into table rows, (n, F) int64, or ``[F, n]`` with
    ``feature_major`` (a batch's id array: ``Rows.one_hot``): ``modulo`` (TorchRec's
    convention) or ``hash`` (a 64-bit mix first, so that ids differing in low bits do not
    collide in patterns). Computed in place in one uint64 array, laid out as returned."""
    x = (raw.T if feature_major else raw).astype(np.uint64, order="C")
    if mapping == IdMapping.hash:
        x = splitmix64(x)
    divisors = sizes.astype(np.uint64)
    np.remainder(x, divisors[:, None] if feature_major else divisors, out=x)
    return x.view(np.int64)  # every row < 2**63: the same bits


def estimate_collisions(raw: np.ndarray, mapped: np.ndarray, names: list[str]) -> dict:
    """Per table, over a sample of rows: distinct raw ids, the distinct rows they landed on,
    and the share of those ids that share their row with another id."""
    out = {}
    for f, name in enumerate(names):
        pairs = np.unique(np.stack([mapped[:, f].astype(np.int64), raw[:, f].astype(np.int64)], axis=1), axis=0)
        ids = len(pairs)
        _, per_row = np.unique(pairs[:, 0], return_counts=True)
        if ids > len(per_row):
            out[name] = {
                "distinct_ids": ids,
                "distinct_rows": len(per_row),
                "sample_rows": len(raw),
                "colliding_share": round(float(per_row[per_row > 1].sum()) / ids, 4),
            }
    return out


def warn_collisions(collisions: dict, names: list[str], sizes: np.ndarray) -> None:
    """A table where most ids share rows has collapsed: the model cannot tell them apart."""
    bad = {name: c for name, c in collisions.items() if c["colliding_share"] > 0.5}
    if bad:
        tables = "; ".join(
            f"t_{name}: {int(sizes[names.index(name)]):,} rows for {c['distinct_ids']:,} ids, "
            f"{c['colliding_share']:.0%} share a row"
            for name, c in bad.items()
        )
        first = next(iter(bad.values()))["sample_rows"]
        log.warning(
            f"data: most ids collide in {len(bad)} table(s) over the first {first:,} training rows ({tables}). "
            f"Raise data.num_embeddings_per_feature at index "
            f"{', '.join(str(names.index(n)) for n in bad)}, or use data.id_mapping=hash if ids share low bits"
        )


def validation_fraction(valid_path: Optional[str], valid_fraction: float) -> float:
    if not 0 <= valid_fraction < 1:
        raise DataError(f"data.valid_fraction must be in [0, 1), got {valid_fraction}")
    if valid_path and valid_fraction:
        raise DataError("data.valid_path and data.valid_fraction are both set: choose one source of validation rows")
    return valid_fraction
