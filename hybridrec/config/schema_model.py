"""The schemas of the model and loss groups (``conf/model``, ``conf/loss``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from omegaconf import MISSING


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


