"""The schemas of placement and parallelism: sharding (TorchRec's planner), mesh (dense parallelism, 2D), topology (the hardware the planner plans for) and the launcher."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from omegaconf import MISSING


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
    """Intra-op CPU threads per rank. Unset = OMP_NUM_THREADS when set, else the cores split
    between this machine's ranks (N ranks each using every core oversubscribe it), but no
    more than the cores idle at start (a core another process keeps busy stalls them all)."""
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
