"""DLRM for click-through-rate prediction, on TorchRec's own implementation."""

from __future__ import annotations

import torch
from omegaconf import DictConfig
from torch import nn
from torchrec.models.dlrm import DLRM

from hybridrec.data import RecBatch, SparseFeature
from hybridrec.models import Ranker, SparseArch, check_dense_arch, check_layer_sizes
from hybridrec.models.losses import Loss


class TorchRecDLRM(Ranker):
    """Scoring and units of TorchRec's DLRM family (``self.model``: DLRM or DLRM_DCN, which
    share the sparse, dense and over archs); subclasses build the model."""

    pooled_tables = True

    model: DLRM

    def _take_means(self, sparse_arch: SparseArch) -> None:
        """Put ``sparse_arch`` (over the collection the model was built with) in place of
        TorchRec's own, which would leave a weighted collection's means untaken."""
        assert self.model.sparse_arch.embedding_bag_collection is sparse_arch.embedding_bag_collection
        self.model.sparse_arch = sparse_arch

    @classmethod
    def check_config(cls, cfg: DictConfig) -> None:
        check_dense_arch(cfg)
        check_layer_sizes(cfg, "over_arch_layer_sizes")
        over = list(cfg.over_arch_layer_sizes)
        if not over or over[-1] != 1:
            raise ValueError(f"model.over_arch_layer_sizes must end with 1 (one logit), got {over}")

    def score(self, batch: RecBatch) -> torch.Tensor:
        return self.model(batch.dense_features, batch.sparse_features).squeeze(-1)

    def sparse_module(self) -> nn.Module:
        """The embedding collection that TorchRec's planner shards."""
        return self.model.sparse_arch.embedding_bag_collection

    def dense_units(self) -> list[nn.Module]:
        """The dense modules that become FSDP2 units (the dot interaction has no parameters)."""
        return [self.model.dense_arch, self.model.over_arch]


class DLRMRanker(TorchRecDLRM):
    """TorchRec's DLRM (dot interaction): bottom MLP, sharded embeddings, top MLP."""

    def __init__(
        self,
        features: list[SparseFeature],
        num_dense_features: int,
        embedding_dim: int,
        dense_arch_layer_sizes: list[int],
        over_arch_layer_sizes: list[int],
        loss: Loss,
    ) -> None:
        super().__init__(loss)
        sparse_arch = SparseArch(features, embedding_dim)
        # TorchRec's DLRM sizes the interaction by the collection's features (not tables)
        self.model = DLRM(
            embedding_bag_collection=sparse_arch.embedding_bag_collection,
            dense_in_features=num_dense_features,
            dense_arch_layer_sizes=list(dense_arch_layer_sizes),
            over_arch_layer_sizes=list(over_arch_layer_sizes),
        )
        self._take_means(sparse_arch)
