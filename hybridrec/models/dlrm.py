"""DLRM for click-through-rate prediction, on TorchRec's own implementation."""

from __future__ import annotations

import torch
from torch import nn
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from hybridrec.data import SparseFeature


class DLRMRanker(DLRMTrain):
    """TorchRec's DLRM + BCE loss (``DLRMTrain``), with one embedding table per feature.

    Forward returns ``(loss, (loss, logits, labels))``, what TorchRec's train pipelines expect.
    The embedding tables are created on the ``meta`` device: the planner decides where each
    shard lives and DistributedModelParallel materializes only the local shards.
    """

    def __init__(
        self,
        features: list[SparseFeature],
        num_dense_features: int,
        embedding_dim: int,
        dense_arch_layer_sizes: list[int],
        over_arch_layer_sizes: list[int],
    ) -> None:
        tables = [
            EmbeddingBagConfig(
                name=f"t_{f.name}",
                embedding_dim=embedding_dim,
                num_embeddings=f.num_embeddings,
                feature_names=[f.name],
            )
            for f in features
        ]
        super().__init__(
            DLRM(
                embedding_bag_collection=EmbeddingBagCollection(tables, device=torch.device("meta")),
                dense_in_features=num_dense_features,
                dense_arch_layer_sizes=list(dense_arch_layer_sizes),
                over_arch_layer_sizes=list(over_arch_layer_sizes),
            )
        )

    def sparse_module(self) -> nn.Module:
        """The embedding collection that TorchRec's planner shards."""
        return self.model.sparse_arch.embedding_bag_collection

    def dense_units(self) -> list[nn.Module]:
        """The dense modules that become FSDP2 units (the dot interaction has no parameters)."""
        return [self.model.dense_arch, self.model.over_arch]
