"""The contract between a data source and the shared input loop (``hybridrec.data.loader``).

A source describes its data and reads rows; it owns no loop. The loader owns epochs, the
resume position, the end-of-split rule, padding of the last evaluated batch, worker
processes and the merging of read reports. A source implements:

- ``num_batches(split)``: global batches in one pass of the split (an epoch of ``train``),
  or None for a stream without a pass length (synthetic training data, sharded TSV);
- ``read(split, epoch, index, lo, hi)``: rows [lo, hi) of global batch ``index`` of that
  pass, as ``Rows``. An evaluated split may return fewer rows at its end (the loader pads
  them, weight 0); training batches are always whole.

What a source offers beyond rows is declared on its class (``lists``,
``user_item_features``, ``per_rank_report``; a source of users and items is a
``UserItemSource``), and the rules of its config fields are its ``check_config``, which
validation runs before any rank starts.

Rank r of N reads rows [r * B/N, (r + 1) * B/N) of every global batch of B rows, so global
batches are the same for every world size; a source whose rank slice is made of several
independent sequential readers (sharded TSV) says so with ``pieces``.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, Sequence

import numpy as np
import torch
from omegaconf import DictConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from hybridrec.data import ReadReport, RecBatch, SparseFeature

SPLITS = ("train", "valid", "eval")
RANKING_FIELDS = ("relevance", "weights", "query", "log_q")
"""RecBatch's fields beside the Batch ones, in its order."""


@dataclass
class Rows:
    """Rows of a batch as column tensors: what a source reads and a worker process sends.

    ``ids[f]`` and ``lengths[f]`` are feature f's values and per-row lengths, ``id_weights[f]``
    the weight of each of those ids when the source has a weighted feature. ``extra`` holds
    the ranking fields (``RANKING_FIELDS``) of list sources. ``real`` marks padding rows
    (False); None = every row is real. ``report`` is what reading these rows counted (bad
    rows, file rows): the loader merges it into the source's report in the training
    process, whichever process read the rows."""

    dense: torch.Tensor
    ids: list[torch.Tensor]
    lengths: list[torch.Tensor]
    labels: torch.Tensor
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    real: Optional[torch.Tensor] = None
    report: Optional[ReadReport] = None
    packed: Optional[list[int]] = None
    """After ``pack``: the number of ids of each feature in the one ids tensor."""
    id_weights: Optional[list[torch.Tensor]] = None
    """float32, one per id (``len(id_weights[f]) == len(ids[f])``): set for every feature
    when any feature of the source is ``weighted`` (1.0 for the others), else None."""

    def __len__(self) -> int:
        return len(self.labels)

    @staticmethod
    def of(dense: np.ndarray, ids: Sequence[tuple[np.ndarray, np.ndarray]], labels: np.ndarray,
           extra: Optional[dict[str, np.ndarray]] = None,
           weights: Optional[Sequence[Optional[np.ndarray]]] = None) -> "Rows":
        """From NumPy: dense (n, d), per feature (values, lengths), labels (n,), extra fields,
        and (a source with weighted features) per feature the weight of each value, None for
        an unweighted feature: its ids weigh 1.0."""
        t = lambda a, dtype: torch.from_numpy(np.ascontiguousarray(a, dtype=dtype))
        id_weights = None
        if weights is not None:
            if len(weights) != len(ids):
                raise ValueError(f"weights for {len(weights)} features, ids for {len(ids)}")
            id_weights = [torch.ones(len(v)) if w is None else t(w, np.float32) for (v, _), w in zip(ids, weights)]
        return Rows(
            t(dense, np.float32), [t(v, np.int64) for v, _ in ids], [t(n, np.int32) for _, n in ids],
            t(labels, np.float32),
            {k: t(v, np.int64 if k == "query" else np.float32) for k, v in (extra or {}).items()},
            id_weights=id_weights,
        )

    def real_mask(self) -> torch.Tensor:
        return torch.ones(len(self), dtype=torch.bool) if self.real is None else self.real

    def padded(self, n: int) -> "Rows":
        """These rows and ``n - len(self)`` padding rows after them: dense 0, one id 0 per
        feature (models may rely on one item id per row) of id weight 1.0, label 0, row
        weight 0, not real. The id weight is 1.0, not 0, so that padding is the same lookup
        whether a feature is weighted or not (id 0, counted once); the row weight 0 already
        keeps its score out of every loss and metric."""
        pad = n - len(self)
        if pad <= 0:
            return self
        zeros = lambda t: torch.zeros((pad, *t.shape[1:]), dtype=t.dtype)
        cat = lambda t: torch.cat([t, zeros(t)])
        ones = lambda t: torch.cat([t, torch.ones(pad, dtype=t.dtype)])
        return Rows(cat(self.dense), [cat(i) for i in self.ids], [ones(n_) for n_ in self.lengths], cat(self.labels),
                    {k: cat(v) for k, v in self.extra.items()},
                    torch.cat([self.real_mask(), torch.zeros(pad, dtype=torch.bool)]), self.report,
                    id_weights=None if self.id_weights is None else [ones(w) for w in self.id_weights])

    @staticmethod
    def cat(parts: list["Rows"]) -> "Rows":
        """Rows of several parts, in order (a rank's slice read by several readers)."""
        if len(parts) == 1:
            return parts[0]
        first = parts[0]
        real = None if all(p.real is None for p in parts) else torch.cat([p.real_mask() for p in parts])
        id_weights = None
        if any(p.id_weights is not None for p in parts):
            id_weights = [torch.cat([p.weights_of(f) for p in parts]) for f in range(len(first.ids))]
        return Rows(
            torch.cat([p.dense for p in parts]),
            [torch.cat([p.ids[f] for p in parts]) for f in range(len(first.ids))],
            [torch.cat([p.lengths[f] for p in parts]) for f in range(len(first.lengths))],
            torch.cat([p.labels for p in parts]),
            {k: torch.cat([p.extra[k] for p in parts]) for k in first.extra},
            real,
            id_weights=id_weights,
        )

    def weights_of(self, f: int) -> torch.Tensor:
        """Feature f's id weights: ``id_weights[f]``, or 1.0 per id when the rows have none."""
        return torch.ones(len(self.ids[f])) if self.id_weights is None else self.id_weights[f]

    def pack(self) -> "Rows":
        """The same rows in a few large tensors (all ids in one, the lengths as one (F, n)
        tensor), for a worker process to send: DataLoader passes each tensor through its own
        shared-memory segment, and 2 x 26 small ones cost more than building the batch."""
        if not self.ids:
            return self
        return dataclasses.replace(self, ids=[torch.cat(self.ids)], lengths=[torch.stack(self.lengths)],
                                   packed=[len(i) for i in self.ids],
                                   id_weights=None if self.id_weights is None else [torch.cat(self.id_weights)])

    def unpack(self, features: int) -> "Rows":
        """``pack`` undone (views, no copy)."""
        if self.packed is None:
            return self
        return dataclasses.replace(self, ids=list(self.ids[0].split(self.packed)),
                                   lengths=list(self.lengths[0].unbind(0)), packed=None,
                                   id_weights=None if self.id_weights is None else
                                   list(self.id_weights[0].split(self.packed)))

    def batch(self, keys: list[str], weighted: bool = False) -> RecBatch:
        """The batch the model and pipeline take, its ranking fields those of ``extra``
        (None for a source without them). The KeyedJaggedTensor carries ``id_weights`` as
        its weights when the rows have them; ``weighted`` (the source has a weighted
        feature): always, 1.0 per id for rows without them, since a weighted embedding
        collection reads weights of every batch."""
        weights = None
        if self.id_weights is not None or weighted:
            weights = torch.cat([self.weights_of(f) for f in range(len(self.ids))])
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=keys, values=torch.cat(self.ids), lengths=torch.cat(self.lengths), weights=weights
        )
        extra = dict(self.extra)
        if "weights" in extra and self.real is not None:
            extra["weights"] = extra["weights"] * self.real
        return RecBatch(dense_features=self.dense, sparse_features=kjt, labels=self.labels, **extra)


class Source(ABC):
    """A data source (see the module docstring). Attributes every source sets:
    ``features`` (one SparseFeature per feature of a row, in ``Rows.ids`` order; with
    ``weighted`` ones, ``read`` gives ``Rows.id_weights``), ``num_dense_features``, ``batch_size``
    (global rows per step) and ``splits`` (``train``, ``eval`` = the test set, and
    ``valid`` when a validation split is configured)."""

    features: list[SparseFeature]
    num_dense_features: int
    batch_size: int
    splits: tuple[str, ...]
    eval_batches: Optional[int] = None
    """Cap on the global batches of an evaluated split (None = all of it)."""
    sequential: bool = False
    """``read`` of one piece must be called in batch order by one process (a stream reader);
    False = any batch can be read anywhere (random access)."""
    extra_fields: tuple[str, ...] = ()
    """The RecBatch ranking fields its batches set (RANKING_FIELDS: MovieLens); the others
    are None."""
    lists: ClassVar[bool] = False
    """Rows come as whole lists of ``list_size`` rows (one user's items), never split
    between ranks: what list losses (``Loss.needs_lists``) need."""
    list_size: Optional[int] = None
    """Rows per list when ``lists``."""
    user_item_features: ClassVar[bool] = False
    """The features are a user side and an item side (an ``item`` feature among them), and
    batches carry each item's sampling frequency (``log_q``): what two towers need. True
    exactly for a ``UserItemSource``, which also gives the batches of every item and user."""
    per_rank_report: ClassVar[bool] = False
    """Each rank reads, and so counts, rows no other rank reads (its own shards): the run's
    read report is the sum of the ranks' reports. False = every rank reads the same files
    and rank 0's report is the run's."""
    ranking_k: Optional[int] = None
    """Set: evaluation scores each query's list with NDCG, MAP and recall at this cut-off."""
    threshold: Optional[float] = None
    """With ``ranking_k``: the relevance at or above which an item counts as relevant."""

    @classmethod
    def check_config(cls, cfg: DictConfig, world_size: int) -> None:
        """Refuse, with a ValueError naming the key, a ``data`` config (``cfg``) that this
        source cannot serve on ``world_size`` ranks: checked before any rank starts, so the
        source itself does not repeat it. Nothing by default."""

    @abstractmethod
    def num_batches(self, split: str) -> Optional[int]:
        """Global batches in one pass of ``split`` (an epoch of ``train``); None = unknown
        or endless: the pass ends when ``read`` comes up short."""

    @abstractmethod
    def read(self, split: str, epoch: int, index: int, lo: int, hi: int) -> Rows:
        """Rows [lo, hi) of global batch ``index`` of pass ``epoch`` of ``split``. Calls come
        in increasing ``index`` within a pass (a sequential reader may rely on it)."""

    def has_rows(self, split: str) -> bool:
        """Whether a split of unknown length has at least one row (checked before training)."""
        return True

    def why_empty(self, split: str) -> Optional[str]:
        """Why ``split`` has no usable rows (its files empty, every row bad: the first one's
        reason), for the one line that refuses it; None = nothing more to say."""
        return None

    def pieces(self, world_size: int) -> int:
        """Independent sequential readers that make up one rank's slice (1 = random access).
        With P pieces, ``read`` is called once per piece, with [lo, hi) the piece's rows."""
        return 1

    def report(self) -> Optional[dict]:
        """What was read (file sources): rows, bad rows, dropped tails; None = nothing."""
        return None

    def merge_report(self, part: ReadReport) -> None:
        """Add a report that ``read`` produced (maybe in a worker process) to this one."""

    def fitted(self) -> dict[str, Any]:
        """Data-config keys this source computed from its data when it was built (say, the
        statistics of a standardized column), as config values; {} = none. They are merged
        into the run's data config (``hybridrec.build.keep_fitted``), so that the ranks, the
        checkpoints' config.yaml and evaluation use the same numbers."""
        return {}

    def begin_pass(self, split: str, epoch: int) -> None:
        """Called in the training process before each pass: a source counts a split's
        files on its first pass only."""

    @property
    def keys(self) -> list[str]:
        return [f.name for f in self.features]

    @property
    def weighted(self) -> bool:
        """Some feature is ``weighted``: every batch carries id weights (``Rows.id_weights``)."""
        return any(f.weighted for f in self.features)


class UserItemSource(Source):
    """A source whose features are a user side and an item side (``user_item_features``):
    beside its rows it gives every item and every user as one batch each, from which
    ``hybridrec.export`` writes a two-tower model's item and user vectors."""

    user_item_features = True

    @abstractmethod
    def catalogue_batch(self) -> tuple[np.ndarray, RecBatch]:
        """The ids of every item of the data and a batch of one row per item (no user):
        the input of the item tower."""

    @abstractmethod
    def user_batch(self) -> tuple[np.ndarray, RecBatch]:
        """The ids of every user of the data and a batch of one row per user (no item):
        the input of the user tower."""


def check_table_sizes(cfg: DictConfig) -> None:
    """``data.num_embeddings_per_feature`` (``cfg``: the data config), for the sources whose config sets the table sizes."""
    sizes = list(cfg.num_embeddings_per_feature)
    if not sizes or min(sizes) < 1:
        raise ValueError(f"data.num_embeddings_per_feature must be non-empty and >= 1: {sizes}")
