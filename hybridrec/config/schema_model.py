"""The schemas of the model and loss groups (``conf/model``, ``conf/loss``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import ClassVar

from omegaconf import MISSING


# ---------------------------------------------------------------------------- model
@dataclass
class ModelConfig:
    _target_: str = MISSING
    embedding_dim: int = 16
    """Width of every embedding table."""
    embedding_l2: float = 0.0
    """Adds embedding_l2 x each row's squared norm of its looked-up embeddings to the training
    loss (the rows a batch uses, as DeepCTR's l2_reg_embedding; the fused embedding
    optimizers apply no weight decay). Models over pooled tables: dlrm, dcn, deepfm,
    shared_bottom, mmoe, ple. The training loss logged includes it."""

    # Every other field shapes the model's weights, so a checkpoint resumes only under the
    # values it was saved with (checkpoint.check_compatible); these fields may change.
    free_on_resume: ClassVar[tuple[str, ...]] = ("embedding_l2",)


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


class Interaction(str, Enum):
    dot = "dot"
    """DLRM's pairwise dot products of the embeddings and the dense arch's output."""
    dcn = "dcn"
    """DCNv2's low-rank cross network over them (dcn_num_layers, dcn_low_rank_dim)."""


@dataclass
class SharedBottomConfig(ModelConfig):
    _target_: str = "hybridrec.models.multitask.SharedBottom"
    dense_arch_layer_sizes: list[int] = field(default_factory=lambda: [64, 16])
    """Bottom MLP over the dense features; its last size must equal embedding_dim."""
    interaction: Interaction = Interaction.dot
    dcn_num_layers: int = 2
    """With interaction=dcn: cross layers."""
    dcn_low_rank_dim: int = 64
    """With interaction=dcn: the rank of each cross layer."""
    expert_layer_sizes: list[int] = field(default_factory=lambda: [128, 64])
    """Each expert's MLP over the interaction (the shared bottom's, for model=shared_bottom)."""
    tower_layer_sizes: list[int] = field(default_factory=lambda: [32])
    """Each task's tower over its mixture; a one-logit layer follows."""


@dataclass
class MMoEConfig(SharedBottomConfig):
    _target_: str = "hybridrec.models.multitask.MMoE"
    num_experts: int = 4
    """Experts shared by every task, mixed by one gate per task."""


@dataclass
class PLEConfig(MMoEConfig):
    _target_: str = "hybridrec.models.multitask.PLE"
    num_experts: int = 2
    """Shared experts per level."""
    task_experts: int = 1
    """Each task's own experts per level."""
    levels: int = 2
    """Extraction levels (1 = Customized Gate Control)."""


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

    free_on_resume: ClassVar[tuple[str, ...]] = ("embedding_l2", "normalize", "temperature")  # no weights


@dataclass
class SequenceConfig(ModelConfig):
    """What SASRec and HSTU share (``hybridrec.models.sequential``)."""

    max_length: int = 200
    """Positions of the transformer: the most recent items of a history (data.max_length
    must be at most this)."""
    num_blocks: int = 2
    """Transformer blocks (each an FSDP2 unit with mesh.units=arch)."""
    num_heads: int = 1
    dropout: float = 0.2
    activation_checkpointing: bool = False
    """Recompute each block's activations in the backward instead of keeping them: less
    memory for a longer history or more blocks, one more forward of the blocks."""
    mask_history: bool = False
    """Evaluation: also rank with the items of the user's history left out (the held-out
    item is always ranked), reported beside the unmasked metrics as ``masked_hr@10``,
    ``masked_ndcg@10``, ... (the objective stays unmasked). generative-recommenders and most
    public recipes report masked numbers."""
    l2_normalize: bool = False
    """Score the cosine of the user's output and the item's vector (both scaled to length 1)
    instead of their dot product; the loss's temperature (loss.temperature, 0.05 in
    generative-recommenders) then sets how sharp the softmax is. The export's user vectors
    and item vectors are normalized alike."""

    free_on_resume: ClassVar[tuple[str, ...]] = (
        "embedding_l2",
        "dropout",
        "activation_checkpointing",
        "mask_history",
    )


@dataclass
class SASRecConfig(SequenceConfig):
    _target_: str = "hybridrec.models.sequential.SASRec"
    embedding_dim: int = 64


@dataclass
class HSTUConfig(SequenceConfig):
    _target_: str = "hybridrec.models.sequential.HSTU"
    embedding_dim: int = 64
    attention_dim: int = 32
    """Width of each head's query and key."""
    linear_dim: int = 32
    """Width of each head's value and gate (U)."""
    time_buckets: int = 128
    """Log buckets of the time difference in the relative attention bias."""


# ---------------------------------------------------------------------------- loss
class LossAverage(str, Enum):
    user = "user"
    position = "position"


@dataclass
class LossConfig:
    _target_: str = MISSING


@dataclass
class ApproxNDCGConfig(LossConfig):
    _target_: str = "hybridrec.models.losses.ApproxNDCG"
    temperature: float = 0.1
    """Smoothness of the approximate rank: smaller is closer to the true rank, with steeper gradients."""


@dataclass
class InBatchSoftmaxConfig(LossConfig):
    _target_: str = "hybridrec.models.losses.InBatchSoftmax"
    logq_correction: bool = True
    """Subtract log(item frequency) from each in-batch logit: corrects the popularity bias
    of using other rows' items as negatives."""


@dataclass
class NextItemConfig(LossConfig):
    _target_: str = "hybridrec.models.losses.NextItemSoftmax"
    in_batch: bool = False
    """The next items of the whole global batch are negatives too."""
    logq_correction: bool = True
    """Lower each candidate's logit by log(its sampling probability) when the negatives are
    drawn by popularity (data.negative_sampling=popularity) or in-batch."""
    temperature: float = 1.0
    average: LossAverage = field(default_factory=lambda: LossAverage.user)
    """How the positions' losses make the batch's: ``user`` = each user's mean over its positions,
    averaged over users (every user counts alike); ``position`` = the mean over every position
    of the global batch (every prediction counts alike, as training on each prefix of every
    history does: long histories count more)."""
