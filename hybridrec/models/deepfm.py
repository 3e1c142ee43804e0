"""DeepFM (Guo et al. 2017): a factorization machine and a deep tower over shared embeddings.

logit = w0 + <w, dense> + sum_f w_f            (first order)
      + sum_{f < g} <v_f, v_g>                 (second order, the FM)
      + MLP([dense_vector, v_1 .. v_F])        (deep)

The fields are the F sparse features plus the dense features projected to one vector (as
TorchRec's DeepFM treats dense input). Each table is embedding_dim + 4 wide: the sum of the
4 extra columns is the row's first-order weight w_f (FBGEMM's kernels need table widths
divisible by 4, so a single extra column is refused), and one sharded collection serves all
three terms. Features that share a table share its rows' first-order weights too.
TorchRec's ``FactorizationMachine`` flattens its inputs to one scalar per coordinate (it is not
the per-field inner product of the paper), so the FM term is written out here.
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig
from torch import nn
from torchrec.models.dlrm import DenseArch
from torchrec.modules.mlp import MLP

from hybridrec.data import RecBatch, SparseFeature
from hybridrec.models import Ranker, SparseArch, check_dense_arch, check_layer_sizes
from hybridrec.models.losses import Loss

_FIRST_ORDER_COLS = 4


class DeepFMRanker(Ranker):
    pooled_tables = True

    @classmethod
    def check_config(cls, cfg: DictConfig) -> None:
        check_dense_arch(cfg)
        check_layer_sizes(cfg, "deep_layer_sizes")

    def __init__(
        self,
        features: list[SparseFeature],
        num_dense_features: int,
        embedding_dim: int,
        dense_arch_layer_sizes: list[int],
        deep_layer_sizes: list[int],
        loss: Loss,
    ) -> None:
        super().__init__(loss)
        self.sparse_arch = SparseArch(features, embedding_dim + _FIRST_ORDER_COLS)
        self.dense_arch = DenseArch(num_dense_features, list(dense_arch_layer_sizes))
        deep_in = (len(features) + 1) * embedding_dim
        self.deep_arch = nn.Sequential(MLP(deep_in, list(deep_layer_sizes)), nn.Linear(deep_layer_sizes[-1], 1))
        self.linear = nn.Linear(num_dense_features, 1)  # w0 and the dense first-order weights

    def score(self, batch: RecBatch) -> torch.Tensor:
        emb = self.sparse_arch(batch.sparse_features)  # (B, F, D + 4)
        vectors, first_order = emb[:, :, :-_FIRST_ORDER_COLS], emb[:, :, -_FIRST_ORDER_COLS:].sum(2)
        fields = torch.cat([self.dense_arch(batch.dense_features).unsqueeze(1), vectors], dim=1)
        # sum_{f<g} <v_f, v_g> = ((sum_f v_f)^2 - sum_f v_f^2) / 2, summed over the dimensions
        fm = 0.5 * (fields.sum(1).pow(2) - fields.pow(2).sum(1)).sum(1)
        deep = self.deep_arch(fields.flatten(1)).squeeze(-1)
        return self.linear(batch.dense_features).squeeze(-1) + first_order.sum(1) + fm + deep

    def sparse_module(self) -> nn.Module:
        return self.sparse_arch.embedding_bag_collection

    def dense_units(self) -> list[nn.Module]:
        """Dense projection and deep tower; the first-order linear layer stays in the root unit."""
        return [self.dense_arch, self.deep_arch]
