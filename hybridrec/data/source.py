"""The contract between a data source and the shared input loop (``hybridrec.data.loader``).

A source describes its data and reads rows; it owns no loop. The loader owns epochs, the
resume position, the end-of-split rule, padding of the last evaluated batch, worker
processes and the merging of read reports. A source implements:

- ``num_batches(split)``: global batches in one pass of the split (an epoch of ``train``),
  or None for a stream without a pass length (synthetic training data, sharded TSV);
- ``read(split, epoch, index, lo, hi)``: rows [lo, hi) of global batch ``index`` of that
  pass, as ``Rows`` (``hybridrec.data.rows``: a few contiguous arrays). An evaluated split
  may return fewer rows at its end (the loader pads them, weight 0); training batches are
  always whole.

What a source offers beyond rows is declared on its class (``lists``,
``user_item_features``, ``per_rank_report``; a source of users and items is a
``UserItemSource``), and the rules of its config fields are its ``check_config``, which
validation runs before any rank starts.

Rank r of N reads rows [r * B/N, (r + 1) * B/N) of every global batch of B rows, so global
batches are the same for every world size; a source whose rank slice is made of several
independent sequential readers (sharded TSV) says so with ``pieces``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Optional, Sequence

import numpy as np
from omegaconf import DictConfig

from hybridrec.config.tasks import Task
from hybridrec.data import ReadReport, RecBatch, SparseFeature
from hybridrec.data.raw_inputs import RawInputs
from hybridrec.data.rows import RANKING_FIELDS, Rows  # noqa: F401  (re-exported: the contract's row type)

SPLITS = ("train", "valid", "eval")


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
    tasks: Sequence[Task] = ()
    """The tasks of ``data.labels`` (``hybridrec.config.tasks``): ``Rows.labels`` is then ``[n, T]``,
    one column per task; empty = one label per row, ``[n]``."""
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
    next_item: ClassVar[bool] = False
    """Rows are users' histories and their next items (``hybridrec.data.sequences``): batches
    carry ``history``, ``next`` and ``negatives`` ids of one item table, and evaluation ranks
    the whole catalogue for each user's held-out item."""
    version: ClassVar[Optional[int]] = None
    """The version of the generator that draws the rows, for a source that computes its rows
    from a seed (the synthetic click log): checkpoints record it, and a run is not resumed
    onto rows another version draws. None: the rows are read from files."""
    ranking_k: Optional[int] = None
    """Set: evaluation scores each query's list with NDCG, MAP and recall at this cut-off."""
    threshold: Optional[float] = None
    """With ``ranking_k``: the relevance at or above which an item counts as relevant."""

    @classmethod  # noqa: B027  (an optional hook: by default, nothing)
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

    def has_split(self, split: str) -> bool:
        """Whether ``split`` can be read: one of ``splits``, or one the source adds (a
        partitioned log's ``partition:<name>``)."""
        return split in self.splits

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

    def merge_report(self, part: ReadReport) -> None:  # noqa: B027  (an optional hook: by default, nothing)
        """Add a report that ``read`` produced (maybe in a worker process) to this one."""

    def fitted(self) -> dict[str, Any]:
        """Data-config keys this source computed from its data when it was built (say, the
        statistics of a standardized column), as config values; {} = none. They are merged
        into the run's data config (``hybridrec.training.build.keep_fitted``), so that the ranks, the
        checkpoints' config.yaml and evaluation use the same numbers."""
        return {}

    def raw_inputs(self) -> Optional[RawInputs]:
        """How this source's raw rows become the model's inputs, as data
        (``hybridrec.data.raw_inputs``): what an export writes into ``preprocessing.json`` so
        that serving rebuilds the inputs from raw rows. None: the source's rows have no raw
        form a server would hold (the export then says so in ``model.json``)."""
        return None

    def begin_pass(self, split: str, epoch: int) -> None:  # noqa: B027  (an optional hook: by default, nothing)
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
