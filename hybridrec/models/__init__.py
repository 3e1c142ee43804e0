"""Models: one class per module, chosen by ``_target_`` in conf/model/*.yaml.

A model's constructor takes the data's ``features`` and ``num_dense_features``; it exposes
``sparse_module()`` (what TorchRec shards) and ``dense_units()`` (what FSDP2 wraps)."""

import torch
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
