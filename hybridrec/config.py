"""Typed configuration: one dataclass per config group, registered in Hydra's ConfigStore.

Every YAML file under ``conf/`` starts with ``defaults: [<schema>, _self_]``, so OmegaConf
type-checks it against these dataclasses: a misspelled key or a wrong type fails while Hydra
composes the config, before any rank starts. Cross-field rules that a type cannot express
live in :func:`validate`, which the entry point runs before launching.
"""

from __future__ import annotations

import difflib
import glob
import inspect
import math
import os
from dataclasses import dataclass, field, fields, is_dataclass
from enum import Enum
from typing import Any, Callable, ClassVar, NoReturn, Optional

import yaml
from hydra.core.config_store import ConfigStore
from hydra.utils import get_class
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ValidationError


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
    max_loss_ratio: float = 5.0
    """A save is committed only if the loss of the step after it is finite and at most this many
    times the median loss of the run so far: a model whose loss exploded resumes no better than
    one whose loss is NaN (0 = finite is enough)."""
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
    """Steps to skip before the window (tracing, pipeline fill, lazy init)."""
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
    trusted_targets: list[str] = field(default_factory=list)
    """Classes of your own that the checkpoint's config.yaml may name in a ``_target_``,
    besides the ones hybridrec ships (checkpoint.trusted_targets in training)."""
    data: Any = field(default_factory=dict)
    """Keys that change the checkpoint's data config (data.eval_path=..., data.eval_batches=null);
    data=<option> starts from that option's YAML instead of the checkpoint's data config."""


# Config groups whose node names the class it configures (`_target_`): a config saved as
# plain YAML is typed again by the schema registered for that class (``typed``).
TARGET_GROUPS = {"model": "model", "loss": "loss", "data": "data", "optimizer.sparse": "optimizer/sparse",
                 "optimizer.dense": "optimizer/dense"}


CONF_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "conf")
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
    from hybridrec.objective import resolve

    return resolve(objective, bool(getattr(get_class(loss_target), "calibrated", False)), ranking_k).direction


def shipped_targets() -> dict[str, frozenset[str]]:
    """For each ``_target_`` node of a config (``TARGET_GROUPS``), the classes hybridrec's
    config groups offer there: every registered schema's ``_target_`` and every option
    YAML's (a loss option has the generic schema and names its class in YAML). What a
    checkpoint's ``config.yaml`` may instantiate without the user trusting more."""
    register_configs()
    cs = ConfigStore.instance()
    shipped = {}
    for path, group in TARGET_GROUPS.items():
        names = set()
        for name in cs.list(f"schema/{group}"):
            node = cs.load(f"schema/{group}/{name}").node
            if not OmegaConf.is_missing(node, "_target_"):
                names.add(str(node._target_))
        for file in glob.glob(os.path.join(CONF_DIR, *group.split("/"), "*.yaml")):
            with open(file) as f:
                option = yaml.safe_load(f) or {}
            if isinstance(option.get("_target_"), str):
                names.add(option["_target_"])
        shipped[path] = frozenset(names)
    return shipped


def group_schema(group: str, target: Optional[str]) -> Optional[DictConfig]:
    """The schema registered under ``schema/<group>`` (ConfigStore) for the class ``target``:
    a loss without fields of its own gets the generic ``loss`` schema; None when no schema
    names that class (the node then stays untyped)."""
    cs = ConfigStore.instance()
    generic = None
    for name in cs.list(f"schema/{group}"):
        node = cs.load(f"schema/{group}/{name}").node
        if OmegaConf.is_missing(node, "_target_"):
            generic = node
        elif node._target_ == target:
            return node
    return generic


def typed(saved: DictConfig) -> DictConfig:
    """A config saved as plain YAML (a checkpoint's ``config.yaml``) under hybridrec's schemas
    again: enums, optional fields and types as the run that saved it had them.

    ``config.yaml`` holds values, not the group choices that typed them (``data=criteo``),
    so each node of ``TARGET_GROUPS`` takes the schema registered for the class its
    ``_target_`` names. A ValueError names a key that no schema knows (with the nearest
    known key) or a value that does not fit its type."""
    schema = OmegaConf.structured(HybridrecConfig)
    schema.optimizer = OptimizerConfig()  # (MISSING in the schema: the parent of two typed nodes)
    for path, group in TARGET_GROUPS.items():
        node = OmegaConf.select(saved, path)
        if isinstance(node, DictConfig) and "_target_" in node:
            OmegaConf.update(schema, path, typed_node(group_schema(group, node._target_), node, path), merge=False)
    rest = OmegaConf.masked_copy(saved, [k for k in saved if k not in ("model", "loss", "data", "optimizer")])
    if "optimizer" in saved:
        rest.optimizer = {k: v for k, v in saved.optimizer.items() if k not in ("sparse", "dense")}
    return _merge(schema, rest, "")


def evaluation_config(saved: DictConfig, ev: DictConfig, data_option: bool) -> DictConfig:
    """The config the ranks of ``python -m hybridrec.evaluate`` run: the checkpoint's
    ``saved`` config, typed again, with the evaluation's data and launcher.

    Data: the checkpoint's data config changed by the keys of ``ev.data``, or with
    ``data_option`` (``data=<option>`` given) that option's config as composed. The training
    job's topology (topology.world_size, local_world_size, compute_device) is unset: the
    evaluation plans the tables for its own ranks. Nothing is saved or resumed."""
    cfg = typed(saved)
    data = ev.data if data_option else OmegaConf.merge(saved.data, ev.data)
    if "_target_" not in data:
        raise ValueError("data._target_ is not set: data=<option> names a source, or leave data as the checkpoint's")
    cfg.data = typed_node(group_schema("data", data._target_), data, "data")
    cfg.launcher = ev.launcher
    cfg.topology.world_size = cfg.topology.local_world_size = None
    cfg.topology.compute_device = Device.auto
    cfg.checkpoint = CheckpointConfig(dir=None, resume="never")
    cfg.profile.enabled = False
    return cfg


def typed_node(schema: Optional[DictConfig], values: DictConfig, path: str) -> DictConfig:
    """``values`` merged onto ``schema`` (None: left untyped), each key checked first."""
    if schema is None:
        return values
    known = [f.name for f in fields(OmegaConf.get_type(schema))]
    for key in values:
        if key not in known:
            _refuse_key(str(key), known, path)
    return _merge(schema, values, path)


def _merge(schema: DictConfig, values: DictConfig, path: str) -> DictConfig:
    try:
        return OmegaConf.merge(schema, values)
    except ValidationError as e:  # a value of the wrong type: OmegaConf names the key
        where = ".".join(k for k in (path, str(e.full_key or e.key or "")) if k)
        raise ValueError(f"{where}: {str(e).splitlines()[0]}") from None


def _refuse_key(key: str, names: list[str], path: str) -> NoReturn:
    near = difflib.get_close_matches(key, names, n=1)
    where = f"{path}." if path else ""
    raise ValueError(
        f"unknown key {where}{key}{f' (did you mean {where}{near[0]}?)' if near else ''}: "
        f"the keys of {path or 'the top level'} are {', '.join(n for n in names if not n.startswith('_'))}"
    )


# Fused optimizers fbgemm's CPU kernels implement (its TBE asserts the same list).
CPU_SPARSE_OPTIMIZERS = ("torchrec.optim.RowWiseAdagrad", "torch.optim.Adagrad", "torch.optim.SGD")


def check_device(cfg: DictConfig, device_type: str) -> None:
    """Rules that depend on the device the run uses; raises ValueError before launch."""
    planned_for = cfg.topology.compute_device
    if planned_for != Device.auto and planned_for.value != device_type:
        raise ValueError(
            f"topology.compute_device={planned_for.value} but this run would use {device_type} "
            f"(launcher.device={cfg.launcher.device.value})"
        )
    if device_type == "cpu" and cfg.mesh.embedding_replicas > 1:
        raise ValueError(
            f"mesh.embedding_replicas={cfg.mesh.embedding_replicas} needs CUDA: TorchRec 1.8's "
            f"DMPCollection (2D parallelism) asserts a CUDA or MTIA device, and this run would use "
            f"cpu (launcher.device={cfg.launcher.device.value}). Plan it here with "
            f"`python -m hybridrec.plan`, train it on GPUs, or set mesh.embedding_replicas=1"
        )
    if device_type == "cpu" and cfg.optimizer.sparse._target_ not in CPU_SPARSE_OPTIMIZERS:
        raise ValueError(
            f"optimizer.sparse={cfg.optimizer.sparse._target_} has no fused CPU kernel in fbgemm "
            f"(GPU only); on CPU use optimizer/sparse=rowwise_adagrad, adagrad or sgd"
        )


def _kwargs(node: DictConfig) -> dict[str, Any]:
    return {k: v for k, v in node.items() if not str(k).startswith("_")}


def _validate_loss(cfg: DictConfig, world_size: int) -> None:
    """The loss, the model and the data must fit together: each class declares what it needs
    or provides (hybridrec.losses.Loss, hybridrec.models.Ranker, hybridrec.data.source.Source)."""
    loss, model, source = (get_class(cfg[g]._target_) for g in ("loss", "model", "data"))
    name = lambda c: c.__name__
    if loss.needs_lists and not source.lists:
        raise ValueError(f"loss={name(loss)} ranks lists: it needs a list source "
                         f"(data=movielens_rank, or +experiment=movielens_rank); data={name(source)} has none")
    if loss.needs_relevance and "relevance" not in source.extra_fields:
        raise ValueError(f"loss={name(loss)} needs graded relevance (ratings): data=movielens or data=movielens_rank; "
                         f"data={name(source)} has labels only")
    if loss.in_batch_negatives and not model.in_batch_negatives:
        raise ValueError(f"loss={name(loss)} scores users against in-batch items: it needs a model with user and "
                         f"item towers (model=two_tower), not model={name(model)}")
    if model.needs_user_item_features and not source.user_item_features:
        raise ValueError(f"model={name(model)} needs user and item features: data={name(source)} has none; "
                         f"use +experiment=movielens_retrieval (or data=movielens / movielens_rank)")
    if source.lists:
        d = cfg.data
        if d.list_size < 1 or d.negatives < 0 or d.eval_negatives < 0 or d.ranking_k < 1:
            raise ValueError("data.list_size and data.ranking_k must be >= 1, data.negatives and data.eval_negatives >= 0")
        rows = d.list_size + d.negatives
        if d.batch_size % (rows * world_size):
            raise ValueError(
                f"data.batch_size={d.batch_size} must be a whole number of lists of "
                f"data.list_size + data.negatives = {rows} rows on each of the {world_size} rank(s) "
                f"(a multiple of {rows * world_size})"
            )


# Keys whose children are free-form: an optimizer's keyword arguments, checked against its
# signature instead; Hydra's own config (present when a launcher callback validates).
_FREE_FORM = ("optimizer.sparse", "optimizer.dense", "hydra")


def _check_keys(node: Any, path: str = "") -> None:
    """Every key is a field of its schema. Hydra's ``+key=value`` adds a key even to a typed
    config, so a misspelled ``+train.stepz=30`` would otherwise be silently ignored."""
    if path in _FREE_FORM:
        return
    schema = OmegaConf.get_type(node) if isinstance(node, DictConfig) else None
    if is_dataclass(schema):
        names = [f.name for f in fields(schema)]
        for key in node:
            if key not in names and f"{path}.{key}".lstrip(".") not in _FREE_FORM:
                _refuse_key(str(key), names, path)
    if isinstance(node, (DictConfig, ListConfig)):
        keys = node.keys() if isinstance(node, DictConfig) else range(len(node))
        for key in keys:
            if not OmegaConf.is_missing(node, key) and not OmegaConf.is_interpolation(node, key):
                child = node[key]
                if isinstance(child, (DictConfig, ListConfig)):
                    _check_keys(child, f"{path}.{key}" if path else str(key))


def _check_finite(node: Any, path: str = "") -> None:
    """No NaN or infinity in any number of the config. Checked once for every key, because a
    NaN passes every range comparison (``lr > 0`` is False for NaN and so is ``lr <= 0``) and
    then changes what a run computes without an error (a NaN Zipf exponent, a NaN rate)."""
    if isinstance(node, (DictConfig, ListConfig)):
        keys = node.keys() if isinstance(node, DictConfig) else range(len(node))
        for key in keys:
            if key == "hydra" or OmegaConf.is_missing(node, key) or OmegaConf.is_interpolation(node, key):
                continue
            _check_finite(node[key], f"{path}.{key}" if path else str(key))
    elif isinstance(node, float) and not math.isfinite(node):
        raise ValueError(f"{path}={node} is not a finite number: give a finite value")


def _paths(node: DictConfig, prefix: str = "") -> list[str]:
    """Every dotted key of a config, depth first, in order."""
    out = []
    for key in node.keys():
        path = f"{prefix}{key}"
        out.append(path)
        if not OmegaConf.is_missing(node, key) and not OmegaConf.is_interpolation(node, key) \
                and isinstance(node[key], DictConfig):
            out += _paths(node[key], path + ".")
    return out


def _check_positive(cfg: DictConfig) -> None:
    """Sizes and degrees that must be positive. Checked explicitly: 0 would otherwise read as
    "unset" (``x or default``) or fail deep inside a library."""
    if cfg.data.batch_size < 1:
        raise ValueError(f"data.batch_size must be >= 1, got {cfg.data.batch_size}")
    if cfg.model.embedding_dim < 1:
        raise ValueError(f"model.embedding_dim must be >= 1, got {cfg.model.embedding_dim}")
    for group, key in (("mesh", "replicate"), ("mesh", "shard"), ("topology", "world_size"),
                       ("topology", "local_world_size")):
        if cfg[group][key] is not None and cfg[group][key] < 1:
            raise ValueError(f"{group}.{key} must be >= 1 (or unset), got {cfg[group][key]}")
    topo = cfg.topology
    for key in ("device_memory_gb", "host_memory_gb", "intra_host_bandwidth_gbs", "inter_host_bandwidth_gbs"):
        if topo[key] is not None and topo[key] <= 0:
            raise ValueError(f"topology.{key} must be > 0 (or unset to detect it), got {topo[key]}")


def validate(cfg: DictConfig, world_size: int) -> None:
    """Every check that can run before any rank starts, one function per config group, in
    this order (the first problem found is the one reported). Raises ValueError naming the
    keys and the fix."""
    _validate_structure(cfg)
    _validate_run(cfg)
    _validate_launcher(cfg, world_size)
    _validate_mesh(cfg, world_size)
    _validate_schedules(cfg)
    _validate_data(cfg, world_size)
    _validate_model(cfg)
    _validate_loss(cfg, world_size)
    _validate_optimizers(cfg)


def _validate_structure(cfg: DictConfig) -> None:
    """Every required key set, no unknown key, sizes and degrees positive."""
    # hybridrec's keys only: Hydra's own (present under a launcher callback) resolve later
    ours = [k for k in cfg.keys() if k != "hydra"]
    unset = {m for k in ours if isinstance(cfg[k], DictConfig) for m in OmegaConf.missing_keys(cfg[k])}  # full keys
    missing = [p for k in ours if isinstance(cfg[k], DictConfig) for p in _paths(cfg[k], f"{k}.") if p in unset]
    if missing:
        raise ValueError(
            f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set: give "
            f"{' '.join(f'{k}=...' for k in missing)} on the command line or in an experiment"
        )
    _check_keys(cfg)
    _check_finite(cfg)
    _check_positive(cfg)


def _validate_run(cfg: DictConfig) -> None:
    """train, checkpoint, profile and logger."""
    if cfg.train.steps < 1:
        raise ValueError(f"train.steps must be >= 1, got {cfg.train.steps}")
    if cfg.train.log_every < 1:
        raise ValueError(f"train.log_every must be >= 1, got {cfg.train.log_every}")
    if cfg.train.eval_every < 0:
        raise ValueError(f"train.eval_every must be >= 0, got {cfg.train.eval_every}")
    ck = cfg.checkpoint
    if ck.every_n_steps < 0 or ck.keep_last < 1:
        raise ValueError(f"checkpoint.every_n_steps must be >= 0 and checkpoint.keep_last >= 1, "
                         f"got {ck.every_n_steps} and {ck.keep_last}")
    if ck.every_n_steps and not ck.dir:
        raise ValueError("checkpoint.every_n_steps is set but checkpoint.dir is not")
    if ck.keep_best and not (ck.dir and cfg.train.eval_every):
        raise ValueError("checkpoint.keep_best=true keeps the checkpoint of the best validation evaluation: it needs "
                         "checkpoint.dir and train.eval_every > 0")
    if cfg.train.early_stop_patience < 0 or cfg.train.early_stop_patience and not cfg.train.eval_every:
        raise ValueError(f"train.early_stop_patience={cfg.train.early_stop_patience} counts evaluations: it must be "
                         f">= 0, and > 0 needs train.eval_every > 0")
    if not (math.isfinite(ck.max_loss_ratio) and (ck.max_loss_ratio == 0 or ck.max_loss_ratio >= 1)):
        raise ValueError(f"checkpoint.max_loss_ratio must be 0 (finite is enough) or a finite number >= 1, got "
                         f"{ck.max_loss_ratio}")
    prof = cfg.profile
    if prof.enabled and (prof.steps < 1 or prof.start_step < 1 or prof.start_step + prof.steps > cfg.train.steps):
        raise ValueError(
            f"profile.start_step={prof.start_step} + profile.steps={prof.steps} must fit in "
            f"train.steps={cfg.train.steps} (and both be >= 1)"
        )
    if cfg.logger == Logger.tensorboard:
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise ValueError(
                "logger=tensorboard needs the optional tensorboard package: "
                "pip install -c constraints.txt -e '.[tensorboard]'"
            ) from None


def _validate_launcher(cfg: DictConfig, world_size: int) -> None:
    if world_size < 1:
        raise ValueError(f"launcher.nproc_per_node must be >= 1, got {world_size}")
    la = cfg.launcher
    if la.threads_per_rank is not None and la.threads_per_rank < 1:
        raise ValueError(f"launcher.threads_per_rank must be >= 1 (or unset: split the cores), got {la.threads_per_rank}")
    if la.max_restarts < 0 or la.health_check_timeout_s <= 0 or la.collective_timeout_s <= 0:
        raise ValueError("launcher.max_restarts must be >= 0 and the launcher timeouts > 0")
    if la.max_restarts and not (cfg.checkpoint.dir and cfg.checkpoint.resume == "auto"):
        raise ValueError(
            "launcher.max_restarts restarts ranks from the newest checkpoint: set checkpoint.dir "
            "(and keep checkpoint.resume=auto), or restarted ranks would start over"
        )


def _validate_mesh(cfg: DictConfig, world_size: int) -> None:
    """Dense parallelism, embedding replicas and the planner's hardware keys."""
    mesh, topo = cfg.mesh, cfg.topology
    if topo.world_size is not None and topo.world_size != world_size:
        raise ValueError(
            f"topology.world_size={topo.world_size} but this run has {world_size} rank(s) "
            f"(launcher.nproc_per_node or torchrun); topology.world_size is for planning with "
            f"`python -m hybridrec.plan`: leave it unset for training"
        )
    if topo.local_world_size is not None and topo.local_world_size > (topo.world_size or world_size):
        raise ValueError(
            f"topology.local_world_size={topo.local_world_size} exceeds the world size "
            f"{topo.world_size or world_size}"
        )
    if not 0 <= topo.reservation_percentage < 1:
        raise ValueError(f"topology.reservation_percentage must be in [0, 1), got {topo.reservation_percentage}")
    launched = cfg.launcher.device
    if topo.compute_device != Device.auto and launched != Device.auto and topo.compute_device != launched:
        raise ValueError(
            f"topology.compute_device={topo.compute_device.value} but launcher.device={launched.value}: "
            f"a plan is for the device the run uses"
        )
    from hybridrec.parallel_dims import ParallelDims  # (it imports this module's enums)

    # Raises if the degrees do not fit: hsdp's replicate x shard, the embedding replicas.
    ParallelDims.build(mesh, world_size, topo.local_world_size or world_size, "cpu")
    if mesh.dense == DenseParallel.single and world_size != 1:
        raise ValueError(f"mesh=single has no dense parallelism and needs 1 rank, got world_size={world_size}")
    if (mesh.param_dtype or mesh.reduce_dtype) and mesh.dense not in (DenseParallel.fsdp, DenseParallel.hsdp):
        raise ValueError(
            f"mesh.param_dtype / mesh.reduce_dtype are FSDP2's mixed-precision policy, and mesh={mesh.dense.value} "
            f"does not use FSDP2 (its dense parameters and gradients stay fp32): use mesh=fsdp or mesh=hsdp "
            f"for bf16 dense compute, or unset them"
        )
    if mesh.param_dtype == DType.float16:
        # fp16 gradients underflow without loss scaling, which hybridrec does not apply.
        raise ValueError(
            "mesh.param_dtype=float16 needs loss scaling (gradients underflow in fp16), which hybridrec "
            "does not apply: use mesh.param_dtype=bfloat16 (same exponent range as fp32)"
        )
    raf = mesh.reshard_after_forward
    if not isinstance(raf, bool) and not (isinstance(raf, int) and raf >= 1):
        raise ValueError(f"mesh.reshard_after_forward must be true, false or an int >= 1, got {raf!r}")
    if mesh.forward_prefetch < 0 or mesh.backward_prefetch < 0:
        raise ValueError("mesh.forward_prefetch and mesh.backward_prefetch must be >= 0")
    if mesh.embedding_sync_every < 1:
        raise ValueError(f"mesh.embedding_sync_every must be >= 1, got {mesh.embedding_sync_every}")
    if mesh.embedding_replicas > 1 and cfg.checkpoint.dir:
        # TorchRec saves 2D tables as DTensors replicated over the replica groups; hybridrec's
        # checkpoints are tested with 1-D sharding only, and 2D has not yet run (it needs GPUs).
        raise ValueError(
            "mesh.embedding_replicas > 1 with checkpoint.dir: checkpoints of 2D-sharded tables "
            "are not supported yet (untested); unset checkpoint.dir or set mesh.embedding_replicas=1"
        )


def _validate_schedules(cfg: DictConfig) -> None:
    for part in ("sparse_schedule", "dense_schedule"):
        sch = cfg.optimizer[part]
        if min(sch.warmup_steps, sch.decay_start, sch.decay_steps) < 0:
            raise ValueError(f"optimizer.{part}: steps must be >= 0")
        if sch.name != Schedule.constant and sch.decay_steps < 1:
            raise ValueError(f"optimizer.{part}.name={sch.name.value} needs decay_steps >= 1")
        if sch.name != Schedule.constant and sch.decay_start < sch.warmup_steps:
            raise ValueError(
                f"optimizer.{part}.decay_start={sch.decay_start} is inside the warmup "
                f"(warmup_steps={sch.warmup_steps})"
            )
    if cfg.optimizer.clip_grad_norm is not None and cfg.optimizer.clip_grad_norm <= 0:
        raise ValueError(f"optimizer.clip_grad_norm must be > 0, got {cfg.optimizer.clip_grad_norm}")


# Counts of the data sources (each key where its source has it): smallest valid value. A
# negative count would otherwise train every step and fail at the first evaluation.
_DATA_COUNTS = {"eval_batches": 1, "valid_batches": 0, "list_size": 1, "negatives": 0, "eval_negatives": 0}


def _validate_data(cfg: DictConfig, world_size: int) -> None:
    if cfg.data.batch_size % world_size != 0:
        raise ValueError(
            f"data.batch_size={cfg.data.batch_size} is the global batch and must divide "
            f"evenly over world_size={world_size} ranks"
        )
    if cfg.data.num_workers < 0 or cfg.data.prefetch < 1:
        raise ValueError(f"data.num_workers must be >= 0 and data.prefetch >= 1, got "
                         f"{cfg.data.num_workers} and {cfg.data.prefetch}")
    for key, least in _DATA_COUNTS.items():
        value = cfg.data.get(key)
        if value is not None and value < least:
            raise ValueError(f"data.{key} must be >= {least}, got {value}")
    if "shards" in cfg.data:
        shards = cfg.data.shards
        if shards < 1 or shards % world_size or cfg.data.batch_size % shards:
            raise ValueError(
                f"data.shards={shards} must be a multiple of the world size ({world_size}) and divide "
                f"data.batch_size={cfg.data.batch_size}: each rank reads whole shards. Set data.shards to "
                f"a multiple of {world_size} (it changes the order of rows), or convert the logs with "
                f"`python -m hybridrec.data.convert` and use data=criteo_binary"
            )
    if "num_embeddings_per_feature" in cfg.data:
        sizes = list(cfg.data.num_embeddings_per_feature)
        if not sizes or min(sizes) < 1:
            raise ValueError(f"data.num_embeddings_per_feature must be non-empty and >= 1: {sizes}")


def _validate_model(cfg: DictConfig) -> None:
    if "dense_arch_layer_sizes" in cfg.model:
        dense = list(cfg.model.dense_arch_layer_sizes)
        if not dense or dense[-1] != cfg.model.embedding_dim:
            raise ValueError(
                f"model.dense_arch_layer_sizes must end with model.embedding_dim="
                f"{cfg.model.embedding_dim} (the dense features meet the embeddings), got {dense}"
            )
    if "over_arch_layer_sizes" in cfg.model:
        over = list(cfg.model.over_arch_layer_sizes)
        if not over or over[-1] != 1:
            raise ValueError(f"model.over_arch_layer_sizes must end with 1 (one logit), got {over}")
    for key in ("deep_layer_sizes", "tower_layer_sizes"):
        if key in cfg.model and (not cfg.model[key] or min(cfg.model[key]) < 1):
            raise ValueError(f"model.{key} must be non-empty sizes >= 1, got {list(cfg.model[key])}")


def _validate_optimizers(cfg: DictConfig) -> None:
    """Only what TorchRec can fuse, and keyword arguments the optimizers accept."""
    if cfg.optimizer.sparse.get("weight_decay", 0.0):
        # Measured: 0 and 0.1 train identically, even with fbgemm's weight_decay_mode set.
        raise ValueError(
            "optimizer.sparse.weight_decay is not applied by TorchRec 1.8's fused embedding "
            "optimizers (fbgemm keeps weight_decay_mode=NONE; training is identical with 0 and "
            "0.1), so hybridrec refuses it rather than ignore it: leave it 0"
        )
    sparse = cfg.optimizer.sparse._target_
    if sparse not in SPARSE_OPTIMIZERS:
        raise ValueError(
            f"optimizer.sparse._target_={sparse} cannot be fused by TorchRec; "
            f"valid choices: {', '.join(SPARSE_OPTIMIZERS)}"
        )
    # Bind the keyword arguments now, so a wrong one fails here and not inside every rank.
    for part in ("sparse", "dense"):
        node = cfg.optimizer[part]
        try:
            inspect.signature(get_class(node._target_)).bind([], **_kwargs(node))
        except (TypeError, ImportError, ValueError) as e:
            raise ValueError(f"optimizer.{part} ({node._target_}): {e}") from e
        for key, value in _kwargs(node).items():
            if key in _OPTIMIZER_RANGES:
                ok, valid = _OPTIMIZER_RANGES[key]
                if not all(ok(v) for v in (value if isinstance(value, (list, tuple, ListConfig)) else [value])):
                    raise ValueError(f"optimizer.{part}.{key}={value} is out of range: it must be {valid} "
                                     f"({node._target_.rsplit('.', 1)[-1]})")


# The ranges of the optimizers' hyperparameters, checked before launch: torch checks some only
# when a rank builds the optimizer, and fbgemm's fused kernels none (a negative rate trains).
_OPTIMIZER_RANGES: dict[str, tuple[Callable[[float], bool], str]] = {
    "lr": (lambda v: v > 0, "> 0"),
    "eps": (lambda v: v > 0, "> 0"),
    "weight_decay": (lambda v: v >= 0, ">= 0"),
    "momentum": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "dampening": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "betas": (lambda v: 0 <= v < 1, "two values in [0, 1)"),
    "lr_decay": (lambda v: v >= 0, ">= 0"),
    "initial_accumulator_value": (lambda v: v >= 0, ">= 0"),
}
