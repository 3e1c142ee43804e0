"""Models: one class per module, chosen by ``_target_`` in conf/model/*.yaml.

The contract is ``Ranker``: a constructor that takes the data's ``features``,
``num_dense_features`` and the ``loss`` (from the loss group) plus its own config fields;
``sparse_module()`` (what TorchRec shards), ``dense_units()`` (what FSDP2 wraps) and
``score(batch)`` (one logit per row). What a model needs from the data and the loss is
declared on the class (``in_batch_negatives``, ``needs_user_item_features``), as are the
rules its own config fields obey (``check_config``), and validation reads them before
launch."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Optional

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from hybridrec.data import RecBatch, SparseFeature
from hybridrec.losses import Loss


def embedding_collection(features: list[SparseFeature], embedding_dim: int) -> EmbeddingBagCollection:
    """One table per feature, on the ``meta`` device: the planner decides where each shard
    lives and DistributedModelParallel materializes only the local shards."""
    tables = [
        EmbeddingBagConfig(
            name=f"t_{f.name}",
            embedding_dim=embedding_dim,
            num_embeddings=f.num_embeddings,
            feature_names=[f.name],
        )
        for f in features
    ]
    return EmbeddingBagCollection(tables, device=torch.device("meta"))


class Ranker(nn.Module, ABC):
    """A model scores rows; the loss module (config group ``loss``) turns the scores into the
    objective. Forward returns ``(loss, (loss, logits, labels))``, what TorchRec's train
    pipelines expect (as TorchRec's ``DLRMTrain``)."""

    in_batch_negatives: ClassVar[bool] = False
    """The model can train with a loss that scores every row against the batch's other items
    (``Loss.in_batch_negatives``): it exposes separate user and item vectors."""
    needs_user_item_features: ClassVar[bool] = False
    """The model splits the features into a user side and an item side: the source must
    declare ``Source.user_item_features``."""

    def __init__(self, loss: Loss) -> None:
        super().__init__()
        self.loss = loss

    @classmethod
    def check_config(cls, cfg: DictConfig) -> None:
        """Refuse, with a ValueError naming the key, a ``model`` config (``cfg``) this class
        cannot be built from, before any rank starts. Nothing by default."""

    @abstractmethod
    def score(self, batch: RecBatch) -> torch.Tensor:
        """One logit per row of ``batch``."""

    @abstractmethod
    def sparse_module(self) -> nn.Module:
        """The EmbeddingBagCollection TorchRec's planner shards."""

    @abstractmethod
    def dense_units(self) -> list[nn.Module]:
        """The dense blocks, in forward order: FSDP2 units (mesh.units=arch), compiled
        blocks (mesh.compile) and mixed-precision boundaries (mesh.units=root)."""

    def dense_parameter_count(self) -> int:
        """Parameters outside ``sparse_module()`` (the embedding tables): what DDP or FSDP2
        holds. Counted before sharding, so it is the whole model's, on any world size."""
        sparse = {id(p) for p in self.sparse_module().parameters()}
        return sum(p.numel() for p in self.parameters() if id(p) not in sparse)

    def forward(self, batch: RecBatch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        logits = self.score(batch)
        loss = self.loss(logits, batch)
        return loss, (loss.detach(), logits.detach(), batch.labels.detach())


def build_model(cfg: DictConfig, features: list[SparseFeature], num_dense_features: int,
                list_size: Optional[int] = None) -> Ranker:
    """The model of ``cfg.model`` with the loss of ``cfg.loss``."""
    return instantiate(cfg.model, features=features, num_dense_features=num_dense_features,
                       loss=instantiate(cfg.loss, list_size=list_size))


def check_dense_arch(cfg: DictConfig) -> None:
    """A bottom MLP over the dense features whose output meets the embeddings."""
    dense = list(cfg.dense_arch_layer_sizes)
    if not dense or dense[-1] != cfg.embedding_dim:
        raise ValueError(
            f"model.dense_arch_layer_sizes must end with model.embedding_dim="
            f"{cfg.embedding_dim} (the dense features meet the embeddings), got {dense}"
        )


def check_layer_sizes(cfg: DictConfig, key: str) -> None:
    """``model.<key>`` (``cfg``: the model config): the sizes of an MLP's layers."""
    if not cfg[key] or min(cfg[key]) < 1:
        raise ValueError(f"model.{key} must be non-empty sizes >= 1, got {list(cfg[key])}")
