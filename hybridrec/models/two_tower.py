"""Two-tower retrieval: a user tower and an item tower, each an MLP over its own features'
pooled embeddings (one sharded collection holds both towers' tables, as in TorchRec's
retrieval example; a table may serve features of both towers), scored by the inner product
of the (normalized) tower outputs.

Trained with in-batch sampled softmax (``loss=sampled_softmax``, log-q corrected) or any
row/list loss on the scores (``loss=pointwise`` is BCE). ``item_vectors`` gives the item
tower's output for a catalogue and ``user_vectors`` the user tower's for the data's users,
what ``python -m hybridrec.export`` saves for nearest-neighbour search.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn
from torchrec.modules.mlp import MLP

from hybridrec.data import RecBatch, SparseFeature
from hybridrec.models import Ranker, check_layer_sizes, embedding_collection, mean_of, means_after_pooling
from hybridrec.models.losses import Loss


class TwoTower(Ranker):
    in_batch_negatives = True
    needs_user_item_features = True

    @classmethod
    def check_config(cls, cfg: DictConfig) -> None:
        check_layer_sizes(cfg, "tower_layer_sizes")

    def __init__(
        self,
        features: list[SparseFeature],
        num_dense_features: int,
        embedding_dim: int,
        user_features: list[str],
        tower_layer_sizes: list[int],
        normalize: bool,
        temperature: float,
        loss: Loss,
    ) -> None:
        super().__init__(loss)
        names = [f.name for f in features]
        unknown = [n for n in user_features if n not in names]
        if unknown or not user_features:
            raise ValueError(
                f"model.user_features={list(user_features)}: {unknown or 'empty'} not among the data's features {names}"
            )
        self.user_features = [n for n in names if n in user_features]
        self.item_features = [n for n in names if n not in user_features]  # the rest: the item tower's
        if not self.item_features:
            raise ValueError(f"model.user_features takes every feature {names}: the item tower has none")
        self.embedding_bag_collection = embedding_collection(features, embedding_dim)
        self._means = means_after_pooling(features)
        self.user_tower = self._tower(len(self.user_features) * embedding_dim, tower_layer_sizes)
        self.item_tower = self._tower(len(self.item_features) * embedding_dim, tower_layer_sizes)
        self.normalize, self.temperature = normalize, temperature
        # num_dense_features is part of the model contract; the towers take ids only.
        self.in_batch = loss.in_batch_negatives

    @staticmethod
    def _tower(in_size: int, sizes: list[int]) -> nn.Module:
        # ReLU MLP, then a linear output layer: the vector space is not clipped at 0.
        sizes = list(sizes)
        hidden = [MLP(in_size, sizes[:-1])] if len(sizes) > 1 else []
        return nn.Sequential(*hidden, nn.Linear(sizes[-2] if len(sizes) > 1 else in_size, sizes[-1]))

    def towers(self, batch: RecBatch) -> tuple[torch.Tensor, torch.Tensor]:
        sparse = batch.sparse_features
        pooled = self.embedding_bag_collection(sparse)
        vector = lambda n: mean_of(pooled[n], sparse, n) if n in self._means else pooled[n]
        user = self.user_tower(torch.cat([vector(n) for n in self.user_features], dim=1))
        item = self.item_tower(torch.cat([vector(n) for n in self.item_features], dim=1))
        if self.normalize:
            user, item = F.normalize(user, dim=1), F.normalize(item, dim=1)
        return user, item

    def score(self, batch: RecBatch) -> torch.Tensor:
        return self._logits(*self.towers(batch))

    def _logits(self, user: torch.Tensor, item: torch.Tensor) -> torch.Tensor:
        return (user * item).sum(1) / self.temperature

    def forward(self, batch: RecBatch):
        user, item = self.towers(batch)  # once: the in-batch loss needs the vectors themselves
        logits = self._logits(user, item)
        loss = self.loss(user / self.temperature, item, batch) if self.in_batch else self.loss(logits, batch)
        return loss, (loss.detach(), logits.detach(), batch.labels.detach())

    @torch.no_grad()
    def item_vectors(self, batch: RecBatch) -> torch.Tensor:
        return self.towers(batch)[1]

    @torch.no_grad()
    def user_vectors(self, batch: RecBatch) -> torch.Tensor:
        return self.towers(batch)[0]

    def sparse_module(self) -> nn.Module:
        return self.embedding_bag_collection

    def dense_units(self) -> list[nn.Module]:
        return [self.user_tower, self.item_tower]
