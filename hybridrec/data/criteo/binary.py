"""TorchRec's preprocessed binary layout (``data=criteo_binary``): CriteoBinary, which reads
each rank's rows of the ``.npy`` files as memory-mapped ranges."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch
from omegaconf import DictConfig

from hybridrec.config import IdMapping
from hybridrec.data import (
    DataError,
    ReadReport,
    check_disjoint,
    holdout,
)
from hybridrec.data.criteo.common import (
    CAT_FEATURES,
    INT_FEATURES,
    criteo_tables,
    log,
    map_ids,
    resolve_paths,
    validation_fraction,
)
from hybridrec.data.source import Rows, Source, check_table_sizes

if TYPE_CHECKING:
    from hybridrec.data.criteo.binary_device import BinaryOnDevice

_HOLDOUT_RUN = 4096  # binary format: validation rows are held out in runs of this many rows


# The dtypes each file of the .npy layout may have (kinds: f float, i/u integer, b bool): ids
# stored as floats lose integers above 2**24 and are refused, not truncated.
_NPY_KINDS = {"dense": ("f", "floating point"), "sparse": ("iu", "integer ids"), "labels": ("iufb", "numbers 0 or 1")}


class CriteoBinary(Source):
    """TorchRec's preprocessed Criteo format: ``X_dense.npy`` (n, 13) float32, already
    log-transformed, ``X_sparse.npy`` (n, 26) raw ids, ``X_labels.npy`` (n, 1), as written by
    ``torchrec.datasets.criteo.BinaryCriteoUtils.tsv_to_npys``. Each rank reads only its own
    rows of each global batch, from files memory-mapped once per process."""

    @classmethod
    def check_config(cls, cfg: DictConfig, world_size: int) -> None:
        check_table_sizes(cfg)

    def __init__(
        self,
        batch_size: int,
        train_path: str,
        eval_path: str,
        num_embeddings_per_feature: list[int],
        id_mapping: IdMapping,
        eval_batches: Optional[int],
        seed: int,
        valid_path: Optional[str] = None,
        valid_fraction: float = 0.0,
    ) -> None:
        self.features, self.sizes = criteo_tables(num_embeddings_per_feature)
        self.batch_size = batch_size
        specs = {"train": train_path, "eval": eval_path, **({"valid": valid_path} if valid_path else {})}
        self.days = {split: self._days(spec, f"data.{split}_path") for split, spec in specs.items()}
        check_disjoint({f"data.{split}_path": [f"{p}_dense.npy" for p, _ in days] for split, days in self.days.items()})
        fraction = validation_fraction(valid_path, valid_fraction)
        self.splits = ("train", "valid", "eval") if valid_path or fraction else ("train", "eval")
        # Rows of each split as segments (first row, count) of its days laid end to end.
        # valid_fraction holds out a seeded share of the training rows in runs of
        # _HOLDOUT_RUN rows, so that every read stays a few contiguous memory-mapped ranges.
        self.segments = {split: [(0, sum(rows for _, rows in days))] for split, days in self.days.items()}
        if fraction:
            total = self.segments["train"][0][1]
            runs = np.arange(-(-total // _HOLDOUT_RUN))
            held = holdout(seed, 0, runs, fraction)
            self.days["valid"] = self.days["train"]
            for split, mask in (("train", ~held), ("valid", held)):
                self.segments[split] = [
                    (int(r) * _HOLDOUT_RUN, min(_HOLDOUT_RUN, total - int(r) * _HOLDOUT_RUN)) for r in runs[mask]
                ]
        self.num_dense_features = INT_FEATURES
        self.id_mapping = IdMapping(id_mapping)
        self.eval_batches = eval_batches
        self._report = ReadReport()
        for split, days in self.days.items():
            for prefix, rows in days:
                if prefix not in self._report.files:  # validation may be a share of the training files
                    self._report.good(prefix, rows)
            rows = sum(n for _, n in self.segments[split])
            if (rows < batch_size) if split == "train" else rows == 0:  # an evaluated split is padded
                raise DataError(
                    f"data.{split}_path has {rows} rows: "
                    + (f"fewer than one global batch (data.batch_size={batch_size})" if rows else "nothing to evaluate")
                )

    @staticmethod
    def _days(spec: str, key: str) -> list[tuple[str, int]]:
        """(prefix, rows) per day, checked: the three files exist and agree."""
        days = []
        for dense in resolve_paths(spec, key, pattern="*_dense.npy"):
            prefix = dense[: -len("_dense.npy")]
            shapes = {}
            for part, width in (("dense", INT_FEATURES), ("sparse", CAT_FEATURES), ("labels", 1)):
                path = f"{prefix}_{part}.npy"
                if not os.path.isfile(path):
                    raise DataError(f"{key}: {path} is missing (day {os.path.basename(prefix)})")
                try:
                    array = np.load(path, mmap_mode="r")  # the header only: no row is read
                except (ValueError, OSError, EOFError) as e:
                    raise DataError(
                        f"{path}: not a readable .npy file ({e}); {key} names the "
                        f"converted days (python -m hybridrec.data.convert)"
                    ) from None
                if array.ndim != 2 or array.shape[1] != width:
                    raise DataError(f"{path}: shape {array.shape}, expected (rows, {width})")
                if array.dtype.kind not in _NPY_KINDS[part][0]:
                    raise DataError(f"{path}: dtype {array.dtype}, expected {_NPY_KINDS[part][1]}")
                if part == "dense" and array.dtype != np.float32:
                    # said once, at build: the model computes in float32, so the values are cast
                    log.warning(
                        f"{path}: dense features stored as {array.dtype}, read as float32 (the model's "
                        f"precision): "
                        + (
                            "exactly"
                            if array.dtype.itemsize < 4
                            else "rounded to float32's 7 digits; a value beyond its range "
                            "(3.4e38) stops the run as not finite"
                        )
                    )
                shapes[part] = array.shape[0]
            if len(set(shapes.values())) != 1:
                raise DataError(f"{prefix}: dense, sparse and labels disagree on rows: {shapes}")
            days.append((prefix, shapes["dense"]))
        return days

    def report(self) -> dict:
        return self._report.to_dict()

    # -- the Source contract ---------------------------------------------------------------
    def num_batches(self, split: str) -> int:
        """Train: full global batches (the partial last one is dropped, and counted); evaluated
        splits: every row, the last batch padded."""
        total = sum(n for _, n in self.segments[split])
        return total // self.batch_size if split == "train" else -(-total // self.batch_size)

    def begin_pass(self, split: str, epoch: int) -> None:
        if split == "train":
            self._report.dropped_tail_rows["train"] = sum(n for _, n in self.segments["train"]) % self.batch_size

    def read(self, split: str, epoch: int, index: int, lo: int, hi: int) -> Rows:
        """The rows, memory-mapped ranges of the days: the same order every epoch."""
        first, dense, sparse, labels = self.stored(split, index, lo, hi)
        stored = dense.reshape(-1, INT_FEATURES)
        with np.errstate(over="ignore"):  # a value beyond float32's range becomes inf: named by the check
            dense = np.array(stored, dtype=np.float32)  # a copy (the file stays read-only); a wider dtype rounded
        self._check_values(split, first, dense, sparse.reshape(-1, CAT_FEATURES), labels.reshape(-1), stored)
        ids = map_ids(sparse.reshape(-1, CAT_FEATURES), self.sizes, self.id_mapping, feature_major=True)
        # a copy: labels stored as float32 would otherwise be a view of the read-only mapping
        return Rows.one_hot(dense, ids, np.array(labels.reshape(-1), dtype=np.float32))

    def stored(self, split: str, index: int, lo: int, hi: int) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
        """Rows [lo, hi) of global batch ``index`` as the files store them: the split's first
        row read, then dense ``[n, 13]``, sparse ``[n, 26]`` and labels ``[n, 1]`` (views of the
        memory-mapped files, or one array when the rows span days or held-out runs)."""
        total = sum(n for _, n in self.segments[split])
        first = min(index * self.batch_size + lo, total)
        count = min(index * self.batch_size + hi, total) - first
        dense, sparse, labels = (
            self._rows(self.days[split], self.segments[split], part, first, count)
            for part in ("dense", "sparse", "labels")
        )
        return first, dense, sparse, labels

    def device_rows(self, device: torch.device) -> "BinaryOnDevice":
        """``read``'s rows, converted on ``device`` from the stored bytes (``binary_device``)."""
        from hybridrec.data.criteo.binary_device import BinaryOnDevice

        return BinaryOnDevice(self, device)

    def _check_values(
        self, split: str, first: int, dense: np.ndarray, sparse: np.ndarray, labels: np.ndarray, stored: np.ndarray
    ) -> None:
        """Values the dtypes allow but the model cannot use: a label other than 0 or 1, a
        NaN or infinite dense value, a negative id. The layout's rows are taken by position
        (every global batch, at every world size), so a bad row cannot be skipped as the TSV
        reader skips it: the run stops, naming the file and row (0-based, as NumPy indexes)."""
        # One pass each over the whole batch first; the row-by-row masks only when one fails.
        if (
            np.isfinite(dense).all()
            and (sparse.dtype.kind != "i" or len(sparse) == 0 or sparse.min() >= 0)
            and not ((labels != 0) & (labels != 1)).any()
        ):
            return
        checks = (
            ("labels", (labels != 0) & (labels != 1)),
            ("dense", ~np.isfinite(dense).all(axis=1)),
            ("sparse", (sparse < 0).any(axis=1) if sparse.dtype.kind == "i" else np.zeros(len(sparse), bool)),
        )
        for part, bad in checks:
            if bad.any():
                i = int(np.argmax(bad))
                prefix, row = self._locate(split, first + i)
                value = {
                    "labels": lambda: f"label {labels[i]:g} is not 0 or 1",
                    "dense": lambda: _not_finite(stored[i][~np.isfinite(dense[i])][0]),
                    "sparse": lambda: f"id {sparse[i][sparse[i] < 0][0]} is negative",
                }[part]()
                raise DataError(
                    f"{prefix}_{part}.npy row {row}: {value}. The .npy layout's rows are read by "
                    f"position, so a bad row cannot be skipped: fix the file (or convert the TSV again)"
                )

    def _locate(self, split: str, index: int) -> tuple[str, int]:
        """The day (prefix) and row in it of row ``index`` of ``split``."""
        offset = 0
        for first, n in self.segments[split]:
            if index < offset + n:
                row = first + index - offset
                break
            offset += n
        for prefix, rows in self.days[split]:
            if row < rows:
                return prefix, row
            row -= rows
        raise IndexError(index)

    def _rows(
        self, days: list[tuple[str, int]], segments: list[tuple[int, int]], part: str, start: int, count: int
    ) -> np.ndarray:
        """Rows [start, start + count) of a split whose rows are ``segments`` of the days: a
        view of the file when they are one range of one day, else one array."""
        out, offset = [], 0
        for first, n in segments:
            if count and start < offset + n:
                lo = max(start - offset, 0)
                take = min(n - lo, count)
                out += self._range(days, part, first + lo, take)
                start, count = start + take, count - take
            offset += n
        return out[0] if len(out) == 1 else np.concatenate(out) if out else np.zeros(0, dtype=np.float32)

    def _range(self, days: list[tuple[str, int]], part: str, start: int, count: int) -> list[np.ndarray]:
        """Rows [start, start + count) of the concatenated days, as views of their memory-mapped
        files. TorchRec's ``BinaryCriteoUtils.load_npy_range`` maps the file and parses its
        header at every call, which cost more than the rest of a read: each file is mapped
        once per process here (a forked worker inherits the mappings)."""
        out, offset = [], 0
        for prefix, rows in days:
            if count and start < offset + rows:
                lo = max(start - offset, 0)
                take = min(rows - lo, count)
                out.append(self._mapped(f"{prefix}_{part}.npy")[lo : lo + take])
                start, count = start + take, count - take
            offset += rows
        return out

    def _mapped(self, path: str) -> np.ndarray:
        maps = self.__dict__.setdefault("_maps", {})
        if (array := maps.get(path)) is None:
            array = maps[path] = np.load(path, mmap_mode="r")
        return array


def _not_finite(value: np.floating) -> str:
    """Why a dense value (as the file stores it) is unusable: NaN or infinite, or finite in
    its wider dtype and beyond float32's range, where the model computes."""
    if np.isfinite(value):
        return f"dense value {value:g} ({value.dtype}) is beyond float32's range (3.4e38)"
    return f"dense value {value} is not finite"
