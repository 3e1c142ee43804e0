"""The schemas: one dataclass per config group, registered in Hydra's ConfigStore.

Every YAML file under ``conf/`` starts with ``defaults: [<schema>, _self_]``, so OmegaConf
type-checks it against these dataclasses: a misspelled key or a wrong type fails while Hydra
composes the config, before any rank starts. Rules across keys live in
``hybridrec.config.validation``; a config saved as YAML is typed again by
``hybridrec.config.retype``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar, Optional

from hydra.core.config_store import ConfigStore
from hydra.utils import get_class
from omegaconf import MISSING, OmegaConf

from hybridrec.objective import resolve

# ---------------------------------------------------------------------------- model
@dataclass
class ModelConfig:
    _target_: str = MISSING
    embedding_dim: int = 16
    """Width of every embedding table."""

    # Every other field shapes the model's weights, so a checkpoint resumes only under the
    # values it was saved with (checkpoint.check_compatible); these fields may change.
    free_on_resume: ClassVar[tuple[str, ...]] = ()


@dataclass
class DLRMConfig(ModelConfig):
    _target_: str = "hybridrec.models.dlrm.DLRMRanker"
    dense_arch_layer_sizes: list[int] = field(default_factory=lambda: [64, 16])
    """Bottom MLP over the dense features; its last size must equal embedding_dim."""
    over_arch_layer_sizes: list[int] = field(default_factory=lambda: [64, 32, 1])
    """Top MLP over the interaction output; its last size must be 1 (one logit)."""


@dataclass
class DCNConfig(DLRMConfig):
    _target_: str = "hybridrec.models.dcn.DCNRanker"
    dcn_num_layers: int = 3
    """Cross layers of the DCNv2 interaction."""
    dcn_low_rank_dim: int = 512
    """Rank of each cross layer's low-rank weight (MLPerf: 512)."""


@dataclass
class DeepFMConfig(ModelConfig):
    _target_: str = "hybridrec.models.deepfm.DeepFMRanker"
    dense_arch_layer_sizes: list[int] = field(default_factory=lambda: [64, 16])
    """MLP projecting the dense features to one FM field; its last size must equal embedding_dim."""
    deep_layer_sizes: list[int] = field(default_factory=lambda: [128, 64])
    """Hidden layers of the deep tower over all fields (a linear output layer follows)."""


@dataclass
class TwoTowerConfig(ModelConfig):
    _target_: str = "hybridrec.models.two_tower.TwoTower"
    user_features: list[str] = field(default_factory=lambda: ["user", "age", "gender", "occupation", "zip"])
    """Features of the user tower; every other feature belongs to the item tower."""
    tower_layer_sizes: list[int] = field(default_factory=lambda: [64, 32])
    """Each tower's MLP; the last size is the retrieval vector's width."""
    normalize: bool = True
    """L2-normalize both towers' outputs (cosine scores)."""
    temperature: float = 0.1
    """Scores are <user, item> / temperature."""

    free_on_resume: ClassVar[tuple[str, ...]] = ("normalize", "temperature")  # no weights of their own


# ---------------------------------------------------------------------------- loss
@dataclass
class LossConfig:
    _target_: str = MISSING


@dataclass
class ApproxNDCGConfig(LossConfig):
    _target_: str = "hybridrec.losses.ApproxNDCG"
    temperature: float = 0.1
    """Smoothness of the approximate rank: smaller is closer to the true rank, with steeper gradients."""


@dataclass
class InBatchSoftmaxConfig(LossConfig):
    _target_: str = "hybridrec.losses.InBatchSoftmax"
    logq_correction: bool = True
    """Subtract log(item frequency) from each in-batch logit: corrects the popularity bias
    of using other rows' items as negatives."""


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
CRITEO_KAGGLE_CAPPED = [1460, 583, 100000, 100000, 305, 24, 12517, 633, 3, 93145, 5683, 100000, 3194,
                        27, 14992, 100000, 10, 5652, 2173, 4, 100000, 18, 15, 100000, 105, 100000]


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


@dataclass
class ParquetSparseConfig:
    name: str = MISSING
    """The feature's name (its key in the batch; unique)."""
    column: str = MISSING
    """Its ids: a scalar column (one id per row) or a list column (any number of ids per row);
    integers or strings. A null is a row without ids (the feature pools to zeros)."""
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
    """Where the label comes from."""
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


# ---------------------------------------------------------------------------- sharding
class ShardingType(str, Enum):
    """TorchRec's embedding sharding types (``torchrec.distributed.types.ShardingType``)."""

    data_parallel = "data_parallel"
    table_wise = "table_wise"
    row_wise = "row_wise"
    column_wise = "column_wise"
    table_row_wise = "table_row_wise"
    table_column_wise = "table_column_wise"
    grid_shard = "grid_shard"


class CacheAlgorithm(str, Enum):
    lru = "lru"
    lfu = "lfu"


@dataclass
class CacheConfig:
    """Device-side cache of a table kept in host memory (kernel `fused_uvm_caching`, GPU):
    TorchRec's ``CacheParams``."""

    load_factor: Optional[float] = None
    """Share of the table's rows held in the device cache (e.g. 0.2)."""
    algorithm: Optional[CacheAlgorithm] = None
    """Eviction policy of the cache."""
    reserved_memory: Optional[float] = None
    """Device memory (GB) kept free by the cache."""
    prefetch_pipeline: Optional[bool] = None
    """Prefetch the next batch's rows into the cache (needs a prefetching train pipeline)."""


@dataclass
class TableConstraints:
    """Constraints for the tables whose name matches ``match`` (a name or a glob). Field for
    field TorchRec's ``ParameterConstraints``; unset fields are left to the planner (or to the
    group-wide ``sharding.types`` / ``sharding.compute_kernels``)."""

    match: str = MISSING
    """Table name or glob, e.g. t_cat_0 or 't_cat_1*'."""
    sharding_types: Optional[list[ShardingType]] = None
    """Sharding types this table may take."""
    compute_kernels: Optional[list[str]] = None
    """Compute kernels: fused (device memory), fused_uvm_caching (host memory behind a device
    cache, GPU), fused_uvm (host memory, GPU), dense (data_parallel), ..."""
    min_partition: Optional[int] = None
    """Smallest column-wise shard width (column_wise, table_column_wise, grid_shard)."""
    pooling_factors: Optional[list[float]] = None
    """Expected ids per sample (default: what the data source declares)."""
    num_poolings: Optional[list[float]] = None
    """Number of poolings per sample (for features used several times)."""
    enforce_hbm: Optional[bool] = None
    """Keep a cached table's optimizer state in device memory."""
    stochastic_rounding: Optional[bool] = None
    """Stochastic rounding for reduced-precision embedding weights."""
    cache_params: Optional[CacheConfig] = None
    """Device cache settings for tables offloaded to host memory (GPU)."""


@dataclass
class ShardingConfig:
    types: list[ShardingType] = field(default_factory=list)
    """Sharding types the planner may choose from for every table; empty = all of them."""
    compute_kernels: list[str] = field(default_factory=list)
    """TorchRec compute kernels the planner may use (e.g. [fused]); empty = all it offers.
    `fused` tables apply the sparse optimizer inside the backward pass."""
    tables: list[TableConstraints] = field(default_factory=list)
    """Per-table constraints, each for the tables its `match` (name or glob) selects; applied
    in order, a later entry overrides the fields it sets. A list, not a mapping, because
    Hydra's command-line grammar does not allow globs in keys."""


# ---------------------------------------------------------------------------- optimizer
# Each optimizer is `_target_` + its own keyword arguments, so Hydra's instantiate builds
# the dense one and the same fields become the fused sparse optimizer's arguments.
@dataclass
class AdagradConfig:
    _target_: str = "torch.optim.Adagrad"
    lr: float = 0.01
    eps: float = 1e-8
    weight_decay: float = 0.0


@dataclass
class DenseAdagradConfig(AdagradConfig):
    initial_accumulator_value: float = 0.1
    """Starting value of the squared-gradient sums (torch.optim.Adagrad; TensorFlow's default).
    torch's 0 makes the first step move every weight by about lr whatever its gradient: on ctr
    (lr 0.05, 512-wide MLPs) the loss went 0.70 -> 2,031 at step 2 and the run ended at AUC
    0.792; at 0.1 the curve is smooth and the run ends at 0.860 (planted model: 0.885)."""


@dataclass
class RowWiseAdagradConfig(AdagradConfig):
    """One accumulator per embedding row, as in the DLRM reference runs."""

    _target_: str = "torchrec.optim.RowWiseAdagrad"


@dataclass
class AdamConfig:
    _target_: str = "torch.optim.Adam"
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.0


@dataclass
class SparseAdamConfig:
    """Fused Adam for embeddings. No `betas`: torch's in-backward API builds torch.optim.Adam
    with these arguments while fbgemm's kernel expects beta1/beta2, so none can be passed
    through both; the kernel's betas equal torch's defaults (0.9, 0.999)."""

    _target_: str = "torch.optim.Adam"
    lr: float = 1e-3
    eps: float = 1e-8
    weight_decay: float = 0.0


@dataclass
class AdamWConfig(AdamConfig):
    _target_: str = "torch.optim.AdamW"
    weight_decay: float = 0.01


@dataclass
class SGDConfig:
    _target_: str = "torch.optim.SGD"
    lr: float = 0.1
    weight_decay: float = 0.0


@dataclass
class DenseSGDConfig(SGDConfig):
    momentum: float = 0.0


class Schedule(str, Enum):
    constant = "constant"
    linear = "linear"
    cosine = "cosine"
    polynomial = "polynomial"


@dataclass
class ScheduleConfig:
    """Learning-rate multiplier over steps: linear warmup from 0, constant until decay_start,
    then decay over decay_steps to end_factor (MLPerf DLRM: warmup + polynomial decay)."""

    name: Schedule = Schedule.constant
    """Decay shape: constant (no decay), linear, cosine or polynomial."""
    warmup_steps: int = 0
    """Steps of linear warmup (step s uses (s + 1) / warmup_steps of the base lr)."""
    decay_start: int = 0
    """Step at which decay begins (>= warmup_steps)."""
    decay_steps: int = 0
    """Steps over which the multiplier goes from 1 to end_factor."""
    end_factor: float = 0.0
    """Multiplier after the decay."""
    power: float = 2.0
    """Exponent of the polynomial decay (MLPerf: 2)."""


@dataclass
class OptimizerConfig:
    sparse: Any = MISSING
    """Fused into the embedding backward by TorchRec (conf/optimizer/sparse/)."""
    dense: Any = MISSING
    """Torch optimizer over the FSDP2/DDP parameters, built after parallelization
    (conf/optimizer/dense/)."""
    sparse_schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    dense_schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    clip_grad_norm: Optional[float] = None
    """Clip the dense gradients to this global L2 norm (over all ranks); None = no clipping.
    Embedding gradients are applied inside the backward and are not clipped."""


# Optimizer classes TorchRec can fuse into its embedding kernels (EmbOptimType mapping).
SPARSE_OPTIMIZERS = (
    "torchrec.optim.RowWiseAdagrad",
    "torch.optim.Adagrad",
    "torch.optim.Adam",
    "torch.optim.SGD",
)


# ---------------------------------------------------------------------------- mesh
class DenseParallel(str, Enum):
    fsdp = "fsdp"
    """FSDP2 fully_shard over all ranks: dense parameters, grads and optimizer state sharded."""
    hsdp = "hsdp"
    """FSDP2 on a 2-D mesh: replicate across mesh.replicate groups, shard within mesh.shard."""
    ddp = "ddp"
    """DistributedDataParallel (TorchRec's default wrapper): dense parameters replicated."""
    single = "single"
    """No dense parallelism (one rank only)."""


class DType(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class FSDPUnits(str, Enum):
    root = "root"
    """All dense modules in one unit: one all-gather and one reduce-scatter per step. Fewest
    collectives, no overlap between units: for small dense parts (ctr's MLPs)."""
    arch = "arch"
    """Each dense block the model names (bottom MLP, cross net, top MLP) is one unit."""
    layer = "layer"
    """Each layer inside those blocks is its own unit, then the block around them."""


class CommPrecision(str, Enum):
    fp32 = "fp32"
    fp16 = "fp16"
    bf16 = "bf16"


class Device(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class StorageReservation(str, Enum):
    fixed = "fixed"
    """A fixed share of every rank's memory is kept for all but the tables (TorchRec's advice
    when the dense part is not DDP, e.g. FSDP2)."""
    heuristic = "heuristic"
    """TorchRec's default estimate of dense parameters + DDP gradients + input features."""


@dataclass
class MeshConfig:
    dense: DenseParallel = DenseParallel.fsdp
    """How the dense modules (interaction and MLPs) are parallelized."""
    replicate: Optional[int] = None
    """hsdp: replica groups. Unset = world_size / shard."""
    shard: Optional[int] = None
    """hsdp: ranks each replica is sharded over. Unset = ranks per node."""
    reshard_after_forward: Any = True
    """FSDP2, for the units below the root (blocks or layers): true frees gathered parameters
    after forward (less memory, one more all-gather in backward); false keeps them; an int N
    reshards to groups of N ranks."""
    root_reshard_after_forward: Optional[bool] = None
    """FSDP2: the same for the root unit (the model, which owns every dense parameter with
    units=root). Unset = FSDP2's own rule: the root stays unsharded after forward."""
    param_dtype: Optional[DType] = None
    """FSDP2 mixed precision: dtype of the gathered parameters and of compute (e.g. bfloat16)."""
    reduce_dtype: Optional[DType] = None
    """FSDP2 mixed precision: dtype of gradient reduction (e.g. float32 with bf16 compute)."""
    units: FSDPUnits = FSDPUnits.arch
    """FSDP2 unit granularity: root (one for the whole dense part), arch (one per dense block)
    or layer (one per layer, then block)."""
    compile: bool = False
    """torch.compile each dense block's forward (the model's dense_units) before the dense
    wrapper (DDP, FSDP2) is applied, as torchtitan does; the wrapper's hooks stay outside
    the compiled code. Off by default: on CPU it did not win in every repetition (README,
    Performance, Levers)."""
    forward_prefetch: int = 0
    """FSDP2: all-gather the next N units during a unit's forward (explicit prefetch)."""
    backward_prefetch: int = 0
    """FSDP2: all-gather the previous N units during a unit's backward (explicit prefetch)."""
    cpu_offload: bool = False
    """FSDP2 CPUOffloadPolicy: keep sharded dense parameters/grads/optimizer state on host (GPU)."""
    embedding_comms_forward: CommPrecision = CommPrecision.fp32
    """TorchRec qcomms: precision of the embedding all-to-all in forward."""
    embedding_comms_backward: CommPrecision = CommPrecision.fp32
    """TorchRec qcomms: precision of the embedding gradient all-to-all / reduce-scatter."""
    embedding_replicas: int = 1
    """2D parallelism (GPU only): shard the tables within groups of world_size / R ranks and
    replicate each group R times (TorchRec's DMPCollection); 1 = shard over all ranks."""
    embedding_sync_every: int = 1
    """With embedding_replicas > 1: average the R replicas of the tables and of their sparse
    optimizer state every N steps (DMPCollection.sync); also after the last step."""


@dataclass
class TopologyConfig:
    """The hardware the embedding planner plans for (TorchRec's Topology and storage
    reservation). Unset = detected from this machine, or TorchRec's defaults; set, it plans
    for a cluster you do not have (``python -m hybridrec.plan``)."""

    world_size: Optional[int] = None
    """Ranks in the job. Unset = the launched world; `hybridrec.plan` uses it to plan for a
    cluster you do not have. A training run checks it against the real world size."""
    local_world_size: Optional[int] = None
    """Ranks per node (sets the intra/inter-node boundary). Unset = ranks on this machine."""
    compute_device: Device = Device.auto
    """Device the plan is for. auto = the run's device (cuda when available)."""
    device_memory_gb: Optional[float] = None
    """GPU memory per rank, GiB. Unset = detected, or TorchRec's default (32) without a GPU."""
    host_memory_gb: Optional[float] = None
    """Host memory per rank, GiB. Unset = this machine's memory / local ranks."""
    intra_host_bandwidth_gbs: Optional[float] = None
    """GB/s between ranks of one node. Unset = TorchRec's default (600, NVLink class)."""
    inter_host_bandwidth_gbs: Optional[float] = None
    """GB/s between nodes. Unset = TorchRec's default (12.5, 100 Gb/s class)."""
    storage_reservation: StorageReservation = StorageReservation.fixed
    """How memory for everything but the tables is reserved before placing tables."""
    reservation_percentage: float = 0.15
    """Share of each rank's device memory reserved (TorchRec reserves device memory only)."""


# ---------------------------------------------------------------------------- top level
@dataclass
class LauncherConfig:
    nproc_per_node: int = 1
    """Ranks to start on this machine through torch's elastic launcher (ignored under torchrun)."""
    device: Device = Device.auto
    """auto = CUDA when available (NCCL), otherwise CPU (gloo)."""
    threads_per_rank: Optional[int] = None
    """Intra-op CPU threads per rank. Unset = OMP_NUM_THREADS when set, else on CPU the cores
    split between this machine's ranks (N ranks each using every core oversubscribe it)."""
    max_restarts: int = 0
    """Elastic restarts: when a rank dies, restart all ranks (up to N times); they resume from
    the newest complete checkpoint (set checkpoint.dir). Under torchrun: --max-restarts."""
    health_check_timeout_s: float = 60.0
    """At start, every rank must reach a monitored barrier within this time, or the run stops
    naming the ranks that did not."""
    collective_timeout_s: float = 300.0
    """Timeout of every collective (process group timeout): how long a hung or stopped rank
    holds the others before the job fails. It must also cover the longest wait of a healthy
    run: a rank planning the tables while the others wait, and writing its shards of a
    checkpoint (raise it for very large tables on slow storage)."""


class Pipeline(str, Enum):
    sparse_dist = "sparse_dist"
    """TorchRec's TrainPipelineSparseDist: the next batch's input all-to-all overlaps this
    batch's forward/backward."""
    base = "base"
    """TorchRec's TrainPipelineBase: one batch at a time, nothing overlapped (a baseline)."""


@dataclass
class TrainConfig:
    steps: int = 100
    """Optimizer steps (global batches) to train."""
    log_every: int = 10
    """Steps between loss reports: one all-reduce of the window's losses (not one per step), a
    metrics.jsonl record and, when stderr is not a terminal, one progress line."""
    eval_every: int = 0
    """Evaluate on the whole eval set every N steps (0 = only at the end, which always runs)."""
    pipeline: Pipeline = Pipeline.sparse_dist
    """TorchRec train pipeline that runs each step: sparse_dist (overlapped) or base."""
    objective: str = "auto"
    """The validation metric the run is judged by: what a sweep job returns (to any Hydra
    sweeper), what checkpoint.keep_best and early stopping follow, how the sweep table is
    sorted. valid.<metric> (valid.logloss, valid.ne, valid.auc, valid.ndcg@10, ...), or auto:
    valid.logloss for a calibrated loss, valid.ndcg@k for a ranking source, else valid.auc.
    Without a validation split, auto returns the train loss and anything else is refused."""
    early_stop_patience: int = 0
    """Stop after this many evaluations (every train.eval_every steps) without the objective
    improving; 0 = train every step."""


@dataclass
class CheckpointConfig:
    dir: Optional[str] = None
    """Where checkpoints go (step_<N> directories); None = no checkpoints."""
    every_n_steps: int = 0
    """Save every N steps (0 = only at the end of training)."""
    keep_last: int = 2
    """Complete checkpoints kept; older ones are deleted after each commit."""
    resume: str = "auto"
    """auto = newest complete checkpoint in dir if any; never; or a checkpoint path."""
    async_save: bool = False
    """Write checkpoints in the background (DCP async_save) while training continues."""
    keep_best: bool = False
    """Also keep the checkpoint with the best objective seen at train.eval_every (beside the
    keep_last newest), and score the test split with its weights at the end."""
    max_loss_ratio: Optional[float] = 5.0
    """A save is committed only if the loss of the step after it is finite and at most this many
    times the run's typical loss (the lowest of the median of its losses so far, that of its
    first 10 steps and its first step's loss: a median that diverged with the run cannot
    excuse it), and a run whose last losses
    are over it ends with an error: a model whose loss exploded resumes no better than one
    whose loss is NaN. >= 1; null = finite is enough."""
    allow_unverified: bool = False
    """Resume a checkpoint whose trainer_state.json records no checksums: only checkpoints
    written by a hybridrec older than checksums lack them. Every other checkpoint without
    them is refused as damaged or edited (a removed manifest would otherwise hide any change)."""
    trusted_targets: list[str] = field(default_factory=list)
    """Classes of your own that a checkpoint's config.yaml may name in a ``_target_`` (model,
    loss, data, optimizers) besides the ones hybridrec ships and this run's own. Given here,
    never read from a checkpoint: a saved config can only name what the loading run trusts."""


class Logger(str, Enum):
    file = "file"
    """metrics.jsonl, summary.json, report.png in the run directory."""
    tensorboard = "tensorboard"
    """The files, plus TensorBoard event files under <run dir>/tensorboard (optional extra)."""


@dataclass
class ProfileConfig:
    enabled: bool = False
    """Profile a window of steps with torch.profiler: trace files and the comm/compute split."""
    start_step: int = 5
    """Steps to skip before the window (tracing, pipeline fill, lazy init); the step before
    the window is the profiler's warm-up. 0 = from the first step, with its one-time costs
    (lazy init, first collectives, first optimizer step) and no warm-up step."""
    steps: int = 5
    """Steps in the profiled window."""


@dataclass
class HybridrecConfig:
    model: ModelConfig = MISSING
    loss: LossConfig = MISSING
    data: DataConfig = MISSING
    sharding: ShardingConfig = MISSING
    optimizer: OptimizerConfig = MISSING
    mesh: MeshConfig = MISSING
    topology: TopologyConfig = MISSING
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logger: Logger = Logger.file
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    seed: int = 0
    """Seeds data, dense init and the sharding-invariant embedding init: same seed, same losses."""


# ---------------------------------------------------------------------------- evaluate
@dataclass
class EvaluateConfig:
    """``python -m hybridrec.evaluate``: a saved model scored on one split. The model, loss,
    sharding, mesh and seed are the checkpoint's own (its config.yaml); only the data and
    the launcher are given here."""

    checkpoint: str = MISSING
    """A committed checkpoint directory written by training: <checkpoint.dir>/step_<N>."""
    split: str = "eval"
    """The split to score: eval (the test set) or valid (when the source has one)."""
    predictions: bool = True
    """Write predictions.parquet (row, label, score of every scored row) beside metrics.json."""
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    allow_unverified: bool = False
    """Score a checkpoint written by a hybridrec older than checksums (checkpoint.allow_unverified
    in training); any other checkpoint without them is refused as damaged or edited."""
    trusted_targets: list[str] = field(default_factory=list)
    """Classes of your own that the checkpoint's config.yaml may name in a ``_target_``,
    besides the ones hybridrec ships (checkpoint.trusted_targets in training)."""
    data: Any = field(default_factory=dict)
    """Keys that change the checkpoint's data config (data.eval_path=..., data.eval_batches=null);
    data=<option> starts from that option's YAML instead of the checkpoint's data config."""


# The option YAMLs of every config group (hybridrec/conf).
CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")
_registered = False


def register_configs() -> None:
    """Register the schemas in Hydra's ConfigStore (once per process: a rank reading a
    checkpoint's config calls it again)."""
    global _registered
    if _registered:
        return
    _registered = True
    # conf/hydra/launcher/slurm.yaml sizes a job's CPUs per rank: ${hybridrec.mul:a,b} = a*b.
    if not OmegaConf.has_resolver("hybridrec.mul"):
        OmegaConf.register_new_resolver("hybridrec.mul", lambda *xs: math.prod(int(x) for x in xs))
    # conf/hydra/sweeper/objective.yaml: the study's direction is train.objective's.
    if not OmegaConf.has_resolver("hybridrec.direction"):
        OmegaConf.register_new_resolver("hybridrec.direction", _direction)
    cs = ConfigStore.instance()
    cs.store(name="hybridrec_schema", node=HybridrecConfig)
    # Schemas live under schema/<group>/ so that a group's listed choices (in Hydra's
    # "Available options" error) are only the real options; each YAML pulls its schema in
    # with `- /schema/<group>/<name>@_here_`.
    cs.store(group="schema/model", name="dlrm", node=DLRMConfig)
    cs.store(group="schema/model", name="dcn", node=DCNConfig)
    cs.store(group="schema/model", name="deepfm", node=DeepFMConfig)
    cs.store(group="schema/model", name="two_tower", node=TwoTowerConfig)
    cs.store(group="schema/loss", name="loss", node=LossConfig)
    cs.store(group="schema/loss", name="approx_ndcg", node=ApproxNDCGConfig)
    cs.store(group="schema/loss", name="sampled_softmax", node=InBatchSoftmaxConfig)
    cs.store(group="schema/data", name="synthetic", node=SyntheticDataConfig)
    cs.store(group="schema/data", name="criteo", node=CriteoDataConfig)
    cs.store(group="schema/data", name="criteo_binary", node=CriteoBinaryDataConfig)
    cs.store(group="schema/data", name="movielens", node=MovieLensDataConfig)
    cs.store(group="schema/data", name="movielens_rank", node=MovieLensRankDataConfig)
    cs.store(group="schema/data", name="parquet", node=ParquetDataConfig)
    cs.store(group="schema/sharding", name="sharding", node=ShardingConfig)
    cs.store(group="schema/mesh", name="mesh", node=MeshConfig)
    cs.store(group="schema/topology", name="topology", node=TopologyConfig)
    cs.store(group="schema/optimizer", name="optimizer", node=OptimizerConfig)
    for name, node in [("rowwise_adagrad", RowWiseAdagradConfig), ("adagrad", AdagradConfig),
                       ("adam", SparseAdamConfig), ("sgd", SGDConfig)]:
        cs.store(group="schema/optimizer/sparse", name=name, node=node)
    for name, node in [("adagrad", DenseAdagradConfig), ("adam", AdamConfig),
                       ("adamw", AdamWConfig), ("sgd", DenseSGDConfig)]:
        cs.store(group="schema/optimizer/dense", name=name, node=node)
    # The evaluate entry point's data node takes any key of any source (the checkpoint's
    # data config decides which schema types them, after composition): not in struct mode.
    evaluate = OmegaConf.structured(EvaluateConfig)
    OmegaConf.set_struct(evaluate.data, False)
    cs.store(name="hybridrec_evaluate_schema", node=evaluate)


def _direction(objective: str, loss_target: str, ranking_k: Optional[int]) -> str:
    return resolve(objective, bool(getattr(get_class(loss_target), "calibrated", False)), ranking_k).direction


