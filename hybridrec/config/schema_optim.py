"""The schemas of the optimizer group (``conf/optimizer``): fused sparse optimizers, dense optimizers, schedules."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from omegaconf import MISSING


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
