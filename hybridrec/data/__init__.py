"""Data sources (one module each) and what they share: errors, read reports, RecBatch (the
batch type of every source).

The contract a source implements is ``hybridrec.data.source.Source`` ("rows [a, b) of global
batch k", and the number of global batches); the input loop every source shares, with
epochs, resume, padding and worker processes, is ``hybridrec.data.loader``.

May import: base, config.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any, Optional, cast

import numpy as np
import torch
from torchrec.datasets.utils import Batch

POOLINGS = ("sum", "mean")


@dataclass(frozen=True)
class SparseFeature:
    """A categorical feature: ids per row (any number, also none) looked up in an embedding
    table and pooled into one vector per row."""

    name: str
    num_embeddings: int
    pooling_factor: float = 1.0
    """Expected ids per sample: the planner's estimate of lookup and communication cost."""
    table: Optional[str] = None
    """The embedding table this feature looks up. Features naming the same table share its
    rows (one TorchRec EmbeddingBagConfig with several feature names) and must agree on
    ``num_embeddings`` and ``pooling``. None = a table of its own, ``t_<name>``: the name
    checkpoints written before tables could be shared hold."""
    pooling: str = "sum"
    """How a row's ids become one vector: "sum" or "mean" (TorchRec's PoolingType). The mean
    of a weighted feature is sum(weight * embedding) / number of ids (TorchRec's
    definition); a row without ids pools to zeros either way."""
    weighted: bool = False
    """The source gives a float weight per id (``Rows.id_weights``) and pooling multiplies
    each id's embedding by it."""

    def __post_init__(self) -> None:
        if self.pooling not in POOLINGS:
            raise ValueError(f"sparse feature {self.name}: pooling={self.pooling!r}, expected one of {POOLINGS}")
        if self.table is not None and not self.table:
            raise ValueError(f"sparse feature {self.name}: table is empty (None = a table of its own)")

    @property
    def table_name(self) -> str:
        """The name of the table this feature looks up."""
        return self.table if self.table is not None else f"t_{self.name}"


class DataError(ValueError):
    """Input that cannot be read: a missing path, an empty dataset, or (data.bad_rows=fail)
    the first bad row, with file:line and the reason."""


LOADER_KEYS = ("num_workers", "prefetch", "input_thread", "device_input", "device_graph")


def build_source(cfg: Any, seed: int) -> Any:
    """The data source of ``cfg`` (the ``data`` node). A source refuses bad input with a
    DataError (a ValueError) naming the key; Hydra's instantiate wraps it in a generic
    InstantiationException, so it is unwrapped here to reach the user as one line."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    # num_workers and prefetch configure the loader (hybridrec.data.loader), not the source
    container = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True))  # cfg is a DictConfig: a dict
    node = {k: v for k, v in container.items() if k not in LOADER_KEYS}
    try:
        return instantiate(node, seed=seed)
    except InstantiationException as e:
        if isinstance(e.__cause__, ValueError):
            raise e.__cause__ from None
        raise


def check_disjoint(paths: dict[str, list[str]]) -> None:
    """Refuse a file that two splits would both read (``{"data.train_path": [...], ...}``):
    training on the rows a model is selected or tested on makes every metric a lie."""
    seen: dict[str, str] = {}
    for key, files in paths.items():
        for path in files:
            real = os.path.realpath(path)
            if real in seen and seen[real] != key:
                raise DataError(
                    f"{path} is in both {seen[real]} and {key}: the splits would share rows. Point "
                    f"{seen[real]} at files without it (a narrower directory or glob)"
                )
            seen[real] = key


def splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on uint64 values (a new array; the multiplications wrap on
    purpose): the 64-bit mix of hashed ids, held-out rows and string hashes."""
    x = x.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return x


def holdout(seed: int, stream: int, rows: np.ndarray, fraction: float) -> np.ndarray:
    """Whether each row (by its index in a stream: a file's line, a rating) is held out for
    validation: a hash of (seed, stream, row) below ``fraction``. A pure function of the row,
    so the same rows are held out however the data are read, split over ranks or resumed."""
    x = splitmix64(
        rows.astype(np.uint64) + np.uint64((seed * 0x9E3779B97F4A7C15 + stream * 0xD1B54A32D192ED03) % 2**64)
    )
    return (x >> np.uint64(11)).astype(np.float64) / 2.0**53 < fraction


@dataclass
class RecBatch(Batch):
    """The batch every source yields: torchrec's Batch and the fields ranking objectives and
    metrics need beside the binary label, None where the source has none (click logs), so
    that a one-hot batch carries no tensor beyond the Batch ones.

    Rows of a list source come in lists of a fixed size (the loss reshapes by it), so every
    rank's slice of a global batch holds whole lists. ``to``/``record_stream``/``pin_memory``
    move every field that is set, which is what TorchRec's train pipelines call on a batch.
    """

    relevance: Optional[torch.Tensor] = None
    """Graded relevance (the rating); 0 for sampled unrated items and for padding."""
    weights: Optional[torch.Tensor] = None
    """1 for a real row, 0 for padding (lists shorter than the list size, the eval tail);
    None = every row counts fully."""
    query: Optional[torch.Tensor] = None
    """The list a row belongs to (the user): ranking metrics group by it."""
    log_q: Optional[torch.Tensor] = None
    """log of the row's item frequency among training rows: the log-q correction of
    in-batch sampled softmax."""
    times: Optional[torch.Tensor] = None
    """int64 ``[B, max_length]``: the timestamp of each item of a row's history (next-item
    sources), left-aligned with its ids, 0 after the history's end."""

    def to(self, device: torch.device, non_blocking: bool = False) -> "RecBatch":
        return RecBatch(
            **{
                f.name: v if (v := getattr(self, f.name)) is None else v.to(device=device, non_blocking=non_blocking)
                for f in fields(self)
            }
        )

    def record_stream(self, stream: torch.Stream) -> None:
        for f in fields(self):
            if (v := getattr(self, f.name)) is not None:
                v.record_stream(stream)

    def pin_memory(self) -> "RecBatch":
        return RecBatch(**{f.name: v if (v := getattr(self, f.name)) is None else v.pin_memory() for f in fields(self)})


def _clip(reason: str, limit: int = 300) -> str:
    """A reason from any source, bounded: the last guard against a huge value in a report."""
    return reason if len(reason) <= limit else f"{reason[:limit]}…({len(reason.encode())} bytes)"


# The datasets hybridrec ships, by the folder their make target writes: a missing one is
# named with the command that writes it.
SHIPPED = {
    "data/example_days": "make data-example",
    "data/example": "make data-example",
    "data/ml-100k": "make data-movielens",
}


def missing_hint(path: str) -> str:
    """`` (run `make ...`)`` when ``path`` is inside a shipped dataset's folder that is not
    there (the dataset was never written); "" otherwise."""
    try:
        rel = os.path.relpath(os.path.abspath(path), os.getcwd())
    except ValueError:  # another drive (Windows)
        return ""
    for folder, target in SHIPPED.items():
        if (rel == folder or rel.startswith(folder + os.sep)) and not os.path.isdir(folder):
            return f" (run `{target}` first: it writes {folder}/)"
    return ""


def shorten(value: Any, limit: int = 40) -> str:
    """A value as an error message quotes it: repr, cut to ``limit`` characters with its full
    size, so that a 3 MB field does not become a 3 MB warning and summary.json."""
    text = str(value)
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}…({len(text.encode())} bytes)"


def _error_order(error: str) -> int:
    """A "file:line: reason" error's line (the first errors of a file are kept)."""
    try:
        return int(error.split(": ", 1)[0].rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return 2**62


@dataclass
class FileReport:
    rows: int = 0
    """Lines kept."""
    bad_rows: int = 0
    """Lines skipped; rows + bad_rows = the lines read (a broken file: those before the break)."""
    errors: list[str] = field(default_factory=list)  # the first few "file:line: reason"
    unreadable: Optional[str] = None
    """Where and why the rest of the file could not be read (a truncated gzip), or None."""


@dataclass
class ReadReport:
    """What a source read: rows kept and rows skipped per file, the first offending
    locations, rows dropped at the end of a split (partial global batch), and id collisions
    in the tables. Nothing is dropped without being counted here."""

    files: dict[str, FileReport] = field(default_factory=dict)
    dropped_tail_rows: dict[str, int] = field(default_factory=dict)
    collisions: dict[str, Any] = field(default_factory=dict)
    max_errors: int = 5
    null_ids: dict[str, int] = field(default_factory=dict)
    """Rows kept without ids because their id column was null, by column (data.sparse's
    null_ids=empty): not bad rows, but no silent ones either."""

    def bad(self, path: str, line: Optional[int], reason: str) -> None:
        f = self.files.setdefault(path, FileReport())
        f.bad_rows += 1
        if len(f.errors) < self.max_errors:
            f.errors.append(f"{path}:{line if line is not None else '?'}: {_clip(reason)}")

    def unreadable(self, path: str, line: int, reason: str) -> None:
        """The rest of ``path`` from ``line`` on could not be read: not rows, so not counted."""
        self.files.setdefault(path, FileReport()).unreadable = f"unreadable from {path}:{line} ({_clip(reason)})"

    def good(self, path: str, rows: int) -> None:
        self.files.setdefault(path, FileReport()).rows += rows

    def merge(self, other: "ReadReport") -> None:
        """Add what another reader (a worker process, a rank) counted."""
        for path, f in other.files.items():
            mine = self.files.setdefault(path, FileReport())
            mine.rows += f.rows
            mine.bad_rows += f.bad_rows
            mine.errors = sorted(mine.errors + f.errors, key=_error_order)[: self.max_errors]
            mine.unreadable = mine.unreadable or f.unreadable
        for split, rows in other.dropped_tail_rows.items():
            self.dropped_tail_rows[split] = self.dropped_tail_rows.get(split, 0) + rows
        for column, rows in other.null_ids.items():
            self.null_ids[column] = self.null_ids.get(column, 0) + rows
        self.collisions = other.collisions or self.collisions

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "ReadReport":
        r = ReadReport(
            files={p: FileReport(**f) for p, f in d["files"].items()},
            dropped_tail_rows=dict(d["dropped_tail_rows"]),
            collisions=d["collisions"],
            null_ids=dict(d.get("null_ids", {})),
        )
        return r

    def to_dict(self) -> dict[str, Any]:
        return {
            "rows": sum(f.rows for f in self.files.values()),
            "bad_rows": sum(f.bad_rows for f in self.files.values()),
            "unreadable": [f.unreadable for f in self.files.values() if f.unreadable],
            "files": {p: vars(f) for p, f in self.files.items()},
            "dropped_tail_rows": self.dropped_tail_rows,
            "collisions": self.collisions,
            **({"null_ids": self.null_ids} if self.null_ids else {}),
        }
