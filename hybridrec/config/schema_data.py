"""The schemas of the data group (``conf/data``): one dataclass per source and the enums of their keys."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

from omegaconf import MISSING


# ---------------------------------------------------------------------------- data
@dataclass
class DataConfig:
    _target_: str = MISSING
    batch_size: int = 1024
    """Global batch size: each of the world_size ranks takes batch_size / world_size rows."""
    num_workers: int = 0
    """Worker processes that build each rank's batches (torch DataLoader workers, forked);
    0 = on the training thread. Batches are the same for any number of workers."""
    prefetch: int = 2
    """Batches each worker builds ahead (DataLoader's prefetch_factor); with input_thread, the
    batches the thread builds ahead."""
    input_thread: Optional[bool] = None
    """With num_workers=0: build the next batches on a background thread of the training
    process while the current step computes (the same batches, in the same order); false =
    on the training thread, when it asks for them; unset = on a thread when training on a GPU
    (the GPU waits for every batch built on the training thread), not on CPU ranks (whose
    compute uses every core: measured slower, benchmarks/results/INPUT_THREAD.md)."""
    device_input: Optional[bool] = None
    """Make the training batches on the training device, for a source that can, the same bytes
    as on the CPU: the synthetic log draws them there (``hybridrec.data.synthetic_device``);
    Criteo's binary layout copies the stored bytes through reused pinned buffers and converts
    them there (``hybridrec.data.criteo.binary_device``); the next-item histories
    (data=movielens_seq, parquet_seq) and MovieLens' ratings (data=movielens) keep their arrays
    there and gather each batch by index (``hybridrec.data.sequences_device``,
    ``hybridrec.data.movielens_device``; not data=movielens_rank, whose lists are drawn per
    list on the CPU). Unset = on when training on a GPU
    with no workers and no input thread asked for. true with a source that cannot, or with
    data.num_workers > 0, is refused before launch. The evaluated splits are read as without it
    (they are scored once per evaluation)."""
    device_graph: bool = False
    """With the synthetic log drawn on a GPU (data.device_input): replay each batch's draw from
    a CUDA graph, one launch instead of some 240 small kernels whose issuing bounds a drawn
    batch (``hybridrec.data.synthetic_device.GraphedDraw``; the same bytes). Off by default:
    its rate has not been measured on a GPU yet (``make bench-gpu`` runs both)."""


class TaskKind(str, Enum):
    binary = "binary"
    """0/1 labels: a logit, cross-entropy; AUC, NE, log loss, calibration, accuracy."""
    regression = "regression"
    """Real labels: squared error; RMSE and MAE."""
    ordinal = "ordinal"
    """Grades 0 .. levels - 1: a score and learned cut-points (proportional odds); RMSE, MAE and
    accuracy of the expected grade."""


@dataclass
class TaskConfig:
    """One task of a multi-task model (``data.labels``, ``hybridrec.config.tasks``)."""

    name: str = MISSING
    """The task's name: its metrics are ``<name>.auc``, ``<name>.logloss``, ...; ``train.objective``
    can name one (``valid.<name>.auc``)."""
    column: Optional[str] = None
    """The label column (a file source's column; the synthetic log's planted tasks: click,
    conversion); unset = the name."""
    kind: TaskKind = TaskKind.binary
    weight: float = 1.0
    """The task's weight in the training loss (>= 0, not all 0) and in the weighted
    validation metrics (``valid.auc``, ``valid.logloss``)."""
    after: Optional[str] = None
    """A task listed earlier that this one is observed after (a conversion after a click):
    the model predicts P(after and this) = P(after) * P(this | after), ESMM's factorization."""
    threshold: Optional[float] = None
    """A file source's binary label from a numeric column: value > threshold."""
    levels: Optional[int] = None
    """An ordinal task's number of grades (its labels 0 .. levels - 1)."""


class DenseDistribution(str, Enum):
    normal = "normal"
    """Standard normal: features already normalized."""
    lognormal = "lognormal"
    """Heavy-tailed positive values, like raw counts; the model sees log(1 + x)."""
    uniform = "uniform"
    """Uniform on [0, 1)."""


@dataclass
class SyntheticDataConfig(DataConfig):
    _target_: str = "hybridrec.data.synthetic.SyntheticClickLog"
    num_dense_features: int = 13
    """Dense (continuous) features per sample, as Criteo's 13 integer features."""
    num_embeddings_per_feature: list[int] = field(
        default_factory=lambda: [100_000, 50_000, 20_000, 10_000, 5_000, 1_000, 500, 100]
    )
    """One categorical feature (and one embedding table) per entry: its number of rows."""
    ids_per_feature: int = 1
    """Ids per sample and feature (1 = one-hot, more = multi-hot, pooled by sum)."""
    multi_hot_sizes: list[int] = field(default_factory=list)
    """Ids per sample for each feature (as MLPerf's multi-hot Criteo); empty = ids_per_feature."""
    zipf_exponent: float = 1.05
    """Popularity skew of the ids: P(rank k) ~ k^-a, as in real click logs."""
    dense_distribution: DenseDistribution = DenseDistribution.normal
    """Distribution of the dense features."""
    eval_batches: int = 8
    """Test global batches, scored at the end of training (the `eval` metrics)."""
    valid_batches: int = 4
    """Validation global batches (a third stream of the planted model), scored every
    train.eval_every steps and at the end; 0 = no validation split."""
    labels: Optional[list[TaskConfig]] = None
    """Several tasks per row (a multi-task model): the planted ``click`` and ``conversion``
    (observed only after a click, its own planted model sharing the click's id weights);
    unset = the click label alone."""


class IdMapping(str, Enum):
    modulo = "modulo"
    """row = id % table size (TorchRec's Criteo convention)."""
    hash = "hash"
    """row = mix64(id) % table size: ids that differ in low bits do not collide in patterns."""


class BadRows(str, Enum):
    skip = "skip"
    """Drop the row, count it per file and report it (summary.json data.bad_rows)."""
    fail = "fail"
    """Stop at the first bad row with file:line and the reason."""


# Criteo Kaggle's table sizes capped at 100k rows: CPU-sized; ids map by data.id_mapping.
CRITEO_KAGGLE_CAPPED = [
    1460,
    583,
    100000,
    100000,
    305,
    24,
    12517,
    633,
    3,
    93145,
    5683,
    100000,
    3194,
    27,
    14992,
    100000,
    10,
    5652,
    2173,
    4,
    100000,
    18,
    15,
    100000,
    105,
    100000,
]


@dataclass
class CriteoDataConfig(DataConfig):
    _target_: str = "hybridrec.data.criteo.CriteoTSV"
    train_path: str = MISSING
    """Criteo TSV for training: a file, a directory or a glob; plain or .gz."""
    eval_path: str = MISSING
    """Criteo TSV for the test metrics (same forms); scored once, at the end."""
    valid_path: Optional[str] = None
    """Criteo TSV for validation (same forms): scored every train.eval_every steps and at the
    end, kept apart from the test set. Must not share a file with train or eval."""
    valid_fraction: float = 0.0
    """Instead of valid_path: this share of the training rows, chosen by the seed (a hash of
    the file and the line's byte offset), held out for validation."""
    num_embeddings_per_feature: list[int] = field(default_factory=lambda: list(CRITEO_KAGGLE_CAPPED))
    """Rows of each of the 26 tables."""
    id_mapping: IdMapping = IdMapping.modulo
    bad_rows: BadRows = BadRows.skip
    block_size_mb: int = 16
    """At most this many MiB of (decompressed) text per block of whole lines, the unit that
    is parsed and dealt to shards (small inputs get smaller blocks: about 4 per shard).
    Changing it changes which shard a line belongs to, hence the order of rows."""
    shards: int = 8
    """Independent sequential readers of the input: block j of the i-th file belongs to
    shard (i + j) mod shards, and every global batch takes batch_size / shards rows from
    each shard. Rank r reads only its shards (shards / world_size of them), so a rank
    parses 1/world_size of the rows. Must be a multiple of the world size and divide
    data.batch_size; the global batches are the same for every such world size.
    1 = the files' rows in order."""
    eval_batches: Optional[int] = None
    """Cap on eval global batches; None = the whole eval set."""


@dataclass
class CriteoBinaryDataConfig(DataConfig):
    _target_: str = "hybridrec.data.criteo.CriteoBinary"
    train_path: str = MISSING
    """Directory or glob of TorchRec's `<day>_dense.npy` (with `_sparse` and `_labels` beside)."""
    eval_path: str = MISSING
    """The test day(s), same forms; must not be among the training days."""
    valid_path: Optional[str] = None
    """Validation day(s), same forms (e.g. one half of day 23, the other being eval_path)."""
    valid_fraction: float = 0.0
    """Instead of valid_path: this share of the training rows, in seeded runs of 4096 rows."""
    num_embeddings_per_feature: list[int] = field(default_factory=lambda: list(CRITEO_KAGGLE_CAPPED))
    id_mapping: IdMapping = IdMapping.modulo
    eval_batches: Optional[int] = None


class SplitKind(str, Enum):
    random = "random"
    """A fixed random eval fraction, from the seed."""
    time = "time"
    """The latest ratings are the eval set."""


@dataclass
class MovieLensDataConfig(DataConfig):
    _target_: str = "hybridrec.data.movielens.MovieLens"
    path: str = "data/ml-100k"
    """Directory with u.data (and u.user, u.item for side features): `make data-movielens`."""
    label_threshold: float = 4.0
    """label = rating >= this."""
    split: SplitKind = SplitKind.random
    eval_fraction: float = 0.2
    """Share of the ratings held out as the test set (the `eval` metrics)."""
    valid_fraction: float = 0.0
    """Share of the remaining (training) ratings held out for validation, chosen by the seed
    (by time with split=time: the latest training ratings); 0 = no validation split."""
    side_features: bool = True
    """Age, gender, occupation, zip prefix and genres beside user and item."""
    bad_rows: BadRows = BadRows.skip
    eval_batches: Optional[int] = None


class NegativeSampling(str, Enum):
    catalogue = "catalogue"
    """Uniform over the movies the user has not rated."""
    batch = "batch"
    """From the movies of the other lists of the same global batch (in-batch negatives:
    popularity-distributed), excluding the user's rated movies."""


class EvalItems(str, Enum):
    sampled = "sampled"
    """Each user's held-out rated movies plus eval_negatives unrated movies."""
    catalogue = "catalogue"
    """Every movie the user did not rate in training: full-catalogue retrieval metrics."""


@dataclass
class MovieLensRankDataConfig(MovieLensDataConfig):
    _target_: str = "hybridrec.data.movielens.MovieLensRank"
    batch_size: int = 1280
    """Global batch in rows: a whole number of lists (list_size + negatives rows) per rank."""
    list_size: int = 10
    """Rated movies per training list (a user's shorter remainder is padded, weight 0)."""
    negatives: int = 10
    """Unrated movies sampled into every training list (relevance 0, label 0)."""
    negative_sampling: NegativeSampling = NegativeSampling.catalogue
    eval_items: EvalItems = EvalItems.sampled
    eval_negatives: int = 50
    """Unrated movies added to each user's eval list (eval_items=sampled)."""
    ranking_k: int = 10
    """Cut-off of NDCG@k and recall@k."""


class DenseTransform(str, Enum):
    none = "none"
    """The value as it is."""
    log1p = "log1p"
    """log(1 + max(x, 0)): heavy-tailed counts; negatives clamp to 0 (the DLRM convention)."""
    standardize = "standardize"
    """(x - mean) / std, with the column's mean and std (given, or fitted on the train split)."""


class NumericEncoding(str, Enum):
    scalar = "scalar"
    """One dense input: the value through data.dense[i].transform."""
    bucketized = "bucketized"
    """The id of the value's bucket in a table of its own (knots: quantiles of the train split)."""
    piecewise_linear = "piecewise_linear"
    """Two weighted ids of a table of its own: the linear interpolation of the learned vectors
    of the knots around the value (``hybridrec.data.numeric``)."""


class Pooling(str, Enum):
    sum = "sum"
    """The sum of the ids' (weighted) embeddings."""
    mean = "mean"
    """Their sum divided by the number of ids."""


class ParquetIdMapping(str, Enum):
    none = "none"
    """The column holds table rows already: integers in [0, num_embeddings), else a bad row."""
    hash = "hash"
    """row = splitmix64(id, data.hash_seed) % num_embeddings; integer or string ids."""
    vocabulary = "vocabulary"
    """row = 1 + the id's position in a vocabulary file (``python -m hybridrec.data.vocab``);
    an id not in it goes to row 0, the out-of-vocabulary row."""
    managed = "managed"
    """A row of its own per id the log has shown, given at partition boundaries, with
    eviction when the table is full (data.managed_ids; needs data.partitions); an id
    without a row reads row 0."""


class NullIds(str, Enum):
    empty = "empty"
    """A null is a row without ids: the feature pools to zeros (a missing value, as Criteo's
    empty categorical cells). Counted per feature in the read report, and said once."""
    bad = "bad"
    """A null makes a bad row (data.bad_rows: skipped and counted with file:row, or fatal)."""


@dataclass
class ParquetLabelConfig:
    column: str = MISSING
    """The label column (numeric or boolean)."""
    threshold: Optional[float] = None
    """Set: label = value > threshold. Unset: the value itself, which must be 0 or 1 (else a bad row)."""


@dataclass
class ParquetDenseConfig:
    column: str = MISSING
    """A numeric column; a null or non-finite value makes a bad row."""
    transform: DenseTransform = DenseTransform.none
    """What the model sees of the value."""
    mean: Optional[float] = None
    """transform=standardize: the mean subtracted; unset = fitted on the train split at build."""
    std: Optional[float] = None
    """transform=standardize: the divisor (> 0); unset = fitted on the train split with the mean."""
    encoding: Optional[NumericEncoding] = None
    """How the model sees the column; unset = data.numeric_encoding. bucketized and
    piecewise_linear read the raw value (transform is for scalar only) as ids of a table of
    its own, named like a sparse feature (``name``) and sharded like every table."""
    buckets: Optional[int] = None
    """bucketized / piecewise_linear: equal-count buckets fitted on the train split (ties
    merged: fewer for a column of few values); unset = data.numeric_buckets."""
    knots: Optional[list[float]] = None
    """bucketized / piecewise_linear: the bucket edges, first and last included (strictly
    increasing); unset = fitted on the train split. They travel with the run's config, its
    checkpoints and its export."""
    name: Optional[str] = None
    """bucketized / piecewise_linear: the feature's name (unique among data.sparse's);
    unset = num_<column>."""


@dataclass
class ParquetSparseConfig:
    name: str = MISSING
    """The feature's name (its key in the batch; unique)."""
    column: str = MISSING
    """Its ids: a scalar column (one id per row) or a list column (any number of ids per row);
    integers or strings. A null (id or list) is what null_ids says."""
    num_embeddings: int = MISSING
    """Rows of its table (>= vocabulary size + 1 with id_mapping=vocabulary)."""
    table: Optional[str] = None
    """Features naming the same table share its rows, and must agree on num_embeddings,
    pooling, id_mapping and vocabulary. Unset = a table of its own."""
    pooling: Pooling = Pooling.sum
    """How a row's ids become one vector."""
    weights_column: Optional[str] = None
    """A float weight per id, shaped like the ids (a list of the same length, or a scalar):
    pooling multiplies each id's embedding by it. A missing, non-finite or mismatched weight
    makes a bad row."""
    max_length: Optional[int] = None
    """A list column's longest allowed list: a longer one is a bad row (or cut, see
    truncate). Unset = any length."""
    truncate: bool = False
    """With max_length: keep the first max_length ids (and weights) of a longer list instead
    of counting the row as bad."""
    id_mapping: ParquetIdMapping = ParquetIdMapping.none
    """How the column's ids become table rows."""
    vocabulary: Optional[str] = None
    """id_mapping=vocabulary: the vocabulary file (Parquet, as ``python -m hybridrec.data.vocab`` writes it)."""
    null_ids: NullIds = NullIds.empty
    """A row whose column is null: a row without ids (empty: counted per feature and said
    once) or a bad row (bad). A null inside a list is always a bad row."""


class Eviction(str, Enum):
    lfu = "lfu"
    """When the table is full, the id seen least often so far gives up its row."""
    lru = "lru"
    """When the table is full, the id not seen for the most partitions gives up its row."""


@dataclass
class ManagedIdsConfig:
    """``data.managed_ids``: how id_mapping=managed tables give and take back rows
    (``hybridrec.data.parquet.managed``)."""

    min_count: int = 1
    """Occurrences (over the partitions read so far) before an id gets a row."""
    eviction: Eviction = Eviction.lfu
    reset: bool = True
    """A row an evicted id held starts over for the id it is given to: the table's initial
    values for that row and a fresh optimizer state (as TorchRec's managed-collision modules
    reset it). false: the new id inherits the evicted id's vector and optimizer state."""


@dataclass
class PartitionsConfig:
    """``data.partitions``: data.train_path is a directory of time partitions
    (``hybridrec.data.parquet.partitions``), read in the order of their times."""

    pattern: str = "day=%Y-%m-%d"
    """A partition directory's name, with strftime codes (%Y, %m, %d, %H) where its time is."""
    ready_marker: Optional[str] = None
    """A file a complete partition holds (Spark's _SUCCESS): partitions without it are not read
    yet. None = every partition present is complete."""
    skip_unready: bool = False
    """train.schedule=continuous: a partition without ready_marker while a later one has it
    stops the run before it (it cannot be trained in order later); true trains past it
    instead, recorded in the run (its checkpoint's stream state and summary.json)."""
    train_until: Optional[str] = None
    """The last partition to train on: its name or its date (2026-11-07); later ones are
    scored only, by the model as it was then. None = train on every partition."""
    follow: bool = False
    """With train.schedule=continuous: after the last partition, wait for new ones (checked
    every poll_s) and train on each as it completes: a run that is a service."""
    poll_s: float = 60.0
    """Seconds between looks at data.train_path when following."""
    stop_after_idle_s: Optional[float] = None
    """Following: stop (with the final evaluation) when no partition arrived for this long;
    None = never (stop it with SIGTERM: it ends as a signalled run does, its last save kept)."""


@dataclass
class ParquetDataConfig(DataConfig):
    _target_: str = "hybridrec.data.parquet.ParquetSource"
    train_path: str = MISSING
    """Parquet for training: a file, a directory (its *.parquet files) or a glob; files are
    read in name order, row groups in file order."""
    eval_path: str = MISSING
    """Parquet for the test metrics (same forms); must not share a file with the other splits."""
    valid_path: Optional[str] = None
    """Parquet for validation (same forms), scored every train.eval_every steps and at the end."""
    valid_fraction: float = 0.0
    """Instead of valid_path: this share of the training rows, in seeded runs of 4096 rows of a file."""
    label: ParquetLabelConfig = field(default_factory=ParquetLabelConfig)
    """Where the label comes from (one task; data.labels for several)."""
    labels: Optional[list[TaskConfig]] = None
    """Several label columns, one task each, for a multi-task model (``hybridrec.config.tasks``):
    then data.label is not read."""
    weight: Optional[str] = None
    """A per-row sample weight column (finite, >= 0): the loss weighs each row by it. Unset = 1."""
    dense: list[ParquetDenseConfig] = field(default_factory=list)
    """The dense features, in order."""
    sparse: list[ParquetSparseConfig] = field(default_factory=list)
    """The sparse features, in order (at least one)."""
    hash_seed: int = 0
    """Seed of id_mapping=hash: part of the model (serving must hash ids the same way), so
    not the run's seed."""
    bad_rows: BadRows = BadRows.skip
    """skip: a bad row stays in its batch with weight 0 (no loss, no metric) and is counted
    with file:row; fail: the first one stops the run."""
    eval_batches: Optional[int] = None
    """Cap on evaluated global batches; None = the whole split."""
    shards: Optional[int] = None
    """None: global batch k is the split's rows [kB, (k+1)B), and every rank decodes each row
    group it takes rows from, a cost that grows with the world size once a row group spans
    more than one global batch. S: the split is cut into S contiguous shards and global batch
    k is B/S rows of each; a rank reads only its shards (a multiple of the world size, dividing
    data.batch_size), so its cost stays flat. The batches depend on S, not on the world size.
    A process keeps the last two decoded row groups of each shard it reads."""
    managed_ids: ManagedIdsConfig = field(default_factory=ManagedIdsConfig)
    """The rows of id_mapping=managed features: when an id gets one, which id gives one up."""
    partitions: Optional[PartitionsConfig] = None
    """Set: data.train_path is a directory of time partitions, trained in time order
    (train.schedule=continuous trains on each and scores it first); None = its files."""
    numeric_encoding: NumericEncoding = NumericEncoding.scalar
    """The encoding of every data.dense entry that leaves its own unset: one key to sweep."""
    numeric_buckets: int = 16
    """The buckets of every encoded data.dense entry that leaves its own unset."""


class NegativeSampler(str, Enum):
    uniform = "uniform"
    """Every item equally likely (no log-q correction needed)."""
    popularity = "popularity"
    """In proportion to the item's training interactions, log-q corrected by the loss."""


class TrainWindows(str, Enum):
    last = "last"
    """One training row per user: its newest max_length + 1 training items (SASRec's sampler);
    a longer history's older items are never targets."""
    all = "all"
    """Each user's training items cut into windows of max_length + 1 from the newest: every
    training item is a target once per epoch."""
    overlap = "overlap"
    """Windows of max_length + 1 every max_length / 2 items from the newest: each window's
    newer half are its targets, its older half context only (a window of ``all`` gives its
    first targets almost none), so every target but a history's first ones sees at least
    max_length / 2 items before it; still each training item a target once per epoch."""


@dataclass
class SequenceDataConfig(DataConfig):
    max_length: int = 200
    """The most recent items of a history a row keeps (at most model.max_length)."""
    train_windows: TrainWindows = TrainWindows.last
    train_negatives: int = 0
    """Ids drawn per global batch for the training loss to score against; 0 = every item of
    the catalogue (a full softmax, for small catalogues)."""
    negative_sampling: NegativeSampler = NegativeSampler.uniform
    bad_rows: BadRows = BadRows.skip
    eval_batches: Optional[int] = None


@dataclass
class MovieLensSequencesConfig(SequenceDataConfig):
    _target_: str = "hybridrec.data.sequences.MovieLensSequences"
    path: str = "data/ml-100k"
    """Directory with u.data (`make data-movielens`)."""


@dataclass
class ParquetSequencesConfig(SequenceDataConfig):
    _target_: str = "hybridrec.data.sequences.ParquetSequences"
    path: str = MISSING
    """Parquet of one row per user: a file, a directory (its *.parquet) or a glob."""
    items_column: str = MISSING
    """A list of item ids, oldest first (or ordered by times_column)."""
    num_items: int = MISSING
    """Rows of the item table: ids 1..num_items-1 (id_mapping=none), or the rows ids hash into."""
    times_column: Optional[str] = None
    """A list of timestamps, one per id (HSTU's time bias); unset = positions."""
    id_mapping: ParquetIdMapping = ParquetIdMapping.none
    """none: ids are table rows; hash: seeded splitmix64 into rows 1..num_items-1."""
    hash_seed: int = 0
