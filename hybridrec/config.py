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
from typing import Any

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


@dataclass
class ShardingConfig:
    types: list[ShardingType] = field(default_factory=list)
    """Sharding types the planner may choose from for every table; empty = all of them."""
    compute_kernels: list[str] = field(default_factory=list)
    """TorchRec compute kernels the planner may use (e.g. [fused]); empty = all it offers.
    `fused` tables apply the sparse optimizer inside the backward pass."""


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


@dataclass
class MeshConfig:
    dense: DenseParallel = DenseParallel.fsdp
    """How the dense modules (interaction and MLPs) are parallelized."""
    reshard_after_forward: bool = True
    """FSDP2: free the gathered parameters after forward (less memory, one more all-gather)."""


# ---------------------------------------------------------------------------- top level
class Device(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


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
