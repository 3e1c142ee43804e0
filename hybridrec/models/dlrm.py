"""DLRM for click-through-rate prediction, on TorchRec's own implementation."""

from __future__ import annotations

from torch import nn
from torchrec.models.dlrm import DLRM, DLRMTrain

from hybridrec.data import SparseFeature
from hybridrec.models import embedding_collection


class DLRMRanker(DLRMTrain):
    """TorchRec's DLRM (dot interaction) + BCE loss (``DLRMTrain``).

    Forward returns ``(loss, (loss, logits, labels))``, what TorchRec's train pipelines expect.
    """

    def __init__(
        self,
        features: list[SparseFeature],
        num_dense_features: int,
        embedding_dim: int,
        dense_arch_layer_sizes: list[int],
        over_arch_layer_sizes: list[int],
    ) -> None:
        super().__init__(
            DLRM(
                embedding_bag_collection=embedding_collection(features, embedding_dim),
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
