"""Models: one class per module, chosen by ``_target_`` in conf/model/*.yaml.

A model's constructor takes the data's ``features``, ``num_dense_features`` and the ``loss``
(from the loss group); it exposes ``sparse_module()`` (what TorchRec shards) and
``dense_units()`` (what FSDP2 wraps), and ``score(batch)``: one logit per row."""

from __future__ import annotations

from typing import Any, Optional

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from hybridrec.data import SparseFeature


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


class Ranker(nn.Module):
    """A model scores rows; the loss module (config group ``loss``) turns the scores into the
    objective. Forward returns ``(loss, (loss, logits, labels))``, what TorchRec's train
    pipelines expect (as TorchRec's ``DLRMTrain``)."""

    def __init__(self, loss: nn.Module) -> None:
        super().__init__()
        self.loss = loss

    def score(self, batch: Batch) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, batch: Batch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        logits = self.score(batch)
        loss = self.loss(logits, batch)
        return loss, (loss.detach(), logits.detach(), batch.labels.detach())


def build_model(cfg: DictConfig, features: list[SparseFeature], num_dense_features: int,
                list_size: Optional[int] = None) -> nn.Module:
    """The model of ``cfg.model`` with the loss of ``cfg.loss`` (checkpoints written before
    the loss group existed trained with BCE)."""
    loss_cfg: Any = cfg.get("loss") or {"_target_": "hybridrec.losses.BCE"}
    return instantiate(cfg.model, features=features, num_dense_features=num_dense_features,
                       loss=instantiate(loss_cfg, list_size=list_size))
