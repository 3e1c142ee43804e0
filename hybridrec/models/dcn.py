"""DLRM-DCNv2: DLRM with a low-rank deep & cross network as the interaction, as in the MLPerf
Training recommendation benchmark (TorchRec's ``DLRM_DCN``)."""

from __future__ import annotations

from omegaconf import DictConfig
from torch import nn
from torchrec.models.dlrm import DLRM_DCN

from hybridrec.data import SparseFeature
from hybridrec.models import SparseArch
from hybridrec.models.dlrm import TorchRecDLRM
from hybridrec.models.losses import Loss


class DCNRanker(TorchRecDLRM):
    """TorchRec's DLRM_DCN: bottom MLP, sharded embeddings, low-rank cross network, top MLP."""

    @classmethod
    def check_config(cls, cfg: DictConfig) -> None:
        super().check_config(cfg)
        for key in ("dcn_num_layers", "dcn_low_rank_dim"):
            if cfg.get(key, 1) < 1:
                raise ValueError(
                    f"model.{key}={cfg[key]}: the cross network's "
                    f"{'layers' if key == 'dcn_num_layers' else 'rank'} must be >= 1"
                )

    def __init__(
        self,
        features: list[SparseFeature],
        num_dense_features: int,
        embedding_dim: int,
        dense_arch_layer_sizes: list[int],
        over_arch_layer_sizes: list[int],
        dcn_num_layers: int,
        dcn_low_rank_dim: int,
        loss: Loss,
    ) -> None:
        super().__init__(loss)
        sparse_arch = SparseArch(features, embedding_dim)
        self.model = DLRM_DCN(
            embedding_bag_collection=sparse_arch.embedding_bag_collection,
            dense_in_features=num_dense_features,
            dense_arch_layer_sizes=list(dense_arch_layer_sizes),
            over_arch_layer_sizes=list(over_arch_layer_sizes),
            dcn_num_layers=dcn_num_layers,
            dcn_low_rank_dim=dcn_low_rank_dim,
        )
        self._take_means(sparse_arch)

    def dense_units(self) -> list[nn.Module]:
        """Bottom MLP, cross network, top MLP: each its own FSDP2 unit."""
        return [self.model.dense_arch, self.model.inter_arch, self.model.over_arch]
