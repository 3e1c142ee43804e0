"""Typed configuration: one dataclass per config group, registered in Hydra's ConfigStore.

Every YAML file under ``conf/`` starts with ``defaults: [<schema>, _self_]``, so OmegaConf
type-checks it against these dataclasses: a misspelled key or a wrong type fails while Hydra
composes the config, before any rank starts. Cross-field rules that a type cannot express
live in :func:`validate`, which the entry point runs before launching.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from hydra.utils import get_class
from omegaconf import MISSING, DictConfig


# ---------------------------------------------------------------------------- model
@dataclass
class ModelConfig:
    _target_: str = MISSING
    embedding_dim: int = 16
    """Width of every embedding table."""


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


# ---------------------------------------------------------------------------- data
@dataclass
class DataConfig:
    _target_: str = MISSING
    batch_size: int = 1024
    """Global batch size: each of the world_size ranks takes batch_size / world_size rows."""


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
    eval_batches: int = 8
    """Held-out global batches used for the evaluation at the end of training."""


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
class RowWiseAdagradConfig(AdagradConfig):
    """One accumulator per embedding row, as in the DLRM reference runs."""

    _target_: str = "torchrec.optim.RowWiseAdagrad"


@dataclass
class SGDConfig:
    _target_: str = "torch.optim.SGD"
    lr: float = 0.1
    weight_decay: float = 0.0


@dataclass
class OptimizerConfig:
    sparse: Any = MISSING
    """Fused into the embedding backward by TorchRec (one of SPARSE_OPTIMIZERS)."""
    dense: Any = MISSING
    """Plain torch optimizer over the FSDP2/DDP parameters, built after parallelization."""


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
    ddp = "ddp"
    """DistributedDataParallel (TorchRec's default wrapper): dense parameters replicated."""


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
    reshard_after_forward: bool = True
    """FSDP2: free the gathered parameters after forward (less memory, one more all-gather)."""
    # --- the topology the embedding planner plans for (unset = detected from this machine)
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


@dataclass
class TrainConfig:
    steps: int = 100
    """Optimizer steps (global batches) to train."""
    log_every: int = 10
    """Steps between loss reductions across ranks (one collective per window, not per step)."""


@dataclass
class HybridrecConfig:
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    sharding: ShardingConfig = MISSING
    optimizer: OptimizerConfig = MISSING
    mesh: MeshConfig = MISSING
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    seed: int = 0
    """Seeds data, dense init and the sharding-invariant embedding init: same seed, same losses."""


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="hybridrec_schema", node=HybridrecConfig)
    # Schemas live under schema/<group>/ so that a group's listed choices (in Hydra's
    # "Available options" error) are only the real options; each YAML pulls its schema in
    # with `- /schema/<group>/<name>@_here_`.
    cs.store(group="schema/model", name="dlrm", node=DLRMConfig)
    cs.store(group="schema/model", name="dcn", node=DCNConfig)
    cs.store(group="schema/data", name="synthetic", node=SyntheticDataConfig)
    cs.store(group="schema/sharding", name="sharding", node=ShardingConfig)
    cs.store(group="schema/mesh", name="mesh", node=MeshConfig)
    cs.store(
        group="schema/optimizer",
        name="adagrad",
        node=OptimizerConfig(sparse=RowWiseAdagradConfig(), dense=AdagradConfig()),
    )
    cs.store(
        group="schema/optimizer",
        name="sgd",
        node=OptimizerConfig(sparse=SGDConfig(), dense=SGDConfig()),
    )


def _kwargs(node: DictConfig) -> dict[str, Any]:
    return {k: v for k, v in node.items() if not str(k).startswith("_")}


def validate(cfg: DictConfig, world_size: int) -> None:
    """Cross-field checks, run before any rank starts. Raises ValueError naming the keys."""
    if cfg.train.steps < 1:
        raise ValueError(f"train.steps must be >= 1, got {cfg.train.steps}")
    if cfg.train.log_every < 1:
        raise ValueError(f"train.log_every must be >= 1, got {cfg.train.log_every}")
    if world_size < 1:
        raise ValueError(f"launcher.nproc_per_node must be >= 1, got {world_size}")
    mesh = cfg.mesh
    if mesh.world_size is not None and mesh.world_size != world_size:
        raise ValueError(
            f"mesh.world_size={mesh.world_size} but this run has {world_size} rank(s) "
            f"(launcher.nproc_per_node or torchrun); mesh.world_size is for planning with "
            f"`python -m hybridrec.plan`: leave it unset for training"
        )
    if mesh.local_world_size is not None and mesh.local_world_size > (mesh.world_size or world_size):
        raise ValueError(
            f"mesh.local_world_size={mesh.local_world_size} exceeds the world size "
            f"{mesh.world_size or world_size}"
        )
    if not 0 <= mesh.reservation_percentage < 1:
        raise ValueError(f"mesh.reservation_percentage must be in [0, 1), got {mesh.reservation_percentage}")
    launched = cfg.launcher.device
    if mesh.compute_device != Device.auto and launched != Device.auto and mesh.compute_device != launched:
        raise ValueError(
            f"mesh.compute_device={mesh.compute_device.value} but launcher.device={launched.value}: "
            f"a plan is for the device the run uses"
        )
    if cfg.data.batch_size % world_size != 0:
        raise ValueError(
            f"data.batch_size={cfg.data.batch_size} is the global batch and must divide "
            f"evenly over world_size={world_size} ranks"
        )
    if "num_embeddings_per_feature" in cfg.data:
        sizes = list(cfg.data.num_embeddings_per_feature)
        if not sizes or min(sizes) < 1:
            raise ValueError(f"data.num_embeddings_per_feature must be non-empty and >= 1: {sizes}")
    if "dense_arch_layer_sizes" in cfg.model:
        dense, over = list(cfg.model.dense_arch_layer_sizes), list(cfg.model.over_arch_layer_sizes)
        if not dense or dense[-1] != cfg.model.embedding_dim:
            raise ValueError(
                f"model.dense_arch_layer_sizes must end with model.embedding_dim="
                f"{cfg.model.embedding_dim} (DLRM's dot interaction), got {dense}"
            )
        if not over or over[-1] != 1:
            raise ValueError(f"model.over_arch_layer_sizes must end with 1 (one logit), got {over}")
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
