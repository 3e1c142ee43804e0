"""Models: one class per module, chosen by ``_target_`` in conf/model/*.yaml.

The contract is ``Ranker``: a constructor that takes the data's ``features``,
``num_dense_features`` and the ``loss`` (from the loss group) plus its own config fields;
``sparse_module()`` (what TorchRec shards), ``dense_units()`` (what FSDP2 wraps) and
``score(batch)`` (one logit per row). What a model needs from the data and the loss is
declared on the class (``in_batch_negatives``, ``needs_user_item_features``), as are the
rules its own config fields obey (``check_config``), and validation reads them before
launch.

May import: base, config, data.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import ClassVar, Optional, Sequence

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torchrec.models.dlrm import SparseArch as TorchRecSparseArch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from hybridrec.data import RecBatch, SparseFeature
from hybridrec.models.losses import Loss

_POOLING = {"sum": PoolingType.SUM, "mean": PoolingType.MEAN}


def tables_of(features: Sequence[SparseFeature], embedding_dim: int = 1) -> list[EmbeddingBagConfig]:
    """The embedding tables ``features`` look up: one EmbeddingBagConfig per table, in the
    order of the tables' first feature, each listing its features in their order, with
    ``embedding_dim`` columns (any width will do to check the features only).

    Refuses, with a ValueError naming the features, a table whose features disagree on its
    rows or pooling (TorchRec pools a whole table one way) and a feature named twice."""
    # A model's constructor gets the features as Hydra's instantiate passes them: config
    # nodes with SparseFeature's fields, without its properties.
    features = [f if isinstance(f, SparseFeature) else SparseFeature(**f) for f in features]
    seen: set[str] = set()
    groups: dict[str, list[SparseFeature]] = {}
    for f in features:
        if f.name in seen:
            raise ValueError(f"sparse feature {f.name} is given twice: feature names must be unique")
        seen.add(f.name)
        groups.setdefault(f.table_name, []).append(f)
    for table, members in groups.items():
        for key in ("num_embeddings", "pooling"):
            if len({getattr(f, key) for f in members}) > 1:
                given = ", ".join(f"{f.name} {key}={getattr(f, key)}" for f in members)
                raise ValueError(f"sparse features sharing table {table} must have the same {key}: {given}")
    return [
        EmbeddingBagConfig(
            name=table,
            embedding_dim=embedding_dim,
            num_embeddings=members[0].num_embeddings,
            feature_names=[f.name for f in members],
            pooling=_POOLING[members[0].pooling],
        )
        for table, members in groups.items()
    ]


def means_after_pooling(features: Sequence[SparseFeature]) -> frozenset[str]:
    """The mean-pooled features that ``embedding_collection`` pools by sum, for the model to
    divide by their number of ids (``mean_of``, ``SparseArch``): those of a weighted
    collection, where the mean is sum(weight * embedding) / ids.

    TorchRec's kernels cannot be left to take that mean: on table-wise, column-wise and
    data-parallel shards they divide the forward by the ids but not the gradient (measured,
    TorchRec 1.8 / FBGEMM on CPU), and an unsharded nn.EmbeddingBag refuses weights with
    mean pooling. Summed by the kernel and divided after, under autograd, the mean and its
    gradient are the same for every sharding and unsharded."""
    if not any(f.weighted for f in features):
        return frozenset()
    return frozenset(f.name for f in features if f.pooling == "mean")


def mean_of(pooled: torch.Tensor, features: KeyedJaggedTensor, name: str) -> torch.Tensor:
    """Feature ``name``'s pooled sums ``[B, D]`` divided by its ids per row (a row without
    ids stays zeros)."""
    # to_dict, not features[name]: the collection has built (and the KJT cached) the dict,
    # where indexing would compute offsets again with an FBGEMM operator, which would then
    # be in the exported program
    lengths = features.to_dict()[name].lengths()
    return pooled / lengths.clamp(min=1).unsqueeze(1).to(pooled.dtype)


def embedding_collection(features: list[SparseFeature], embedding_dim: int) -> EmbeddingBagCollection:
    """The tables of ``features`` (``tables_of``), on the ``meta`` device: the planner decides
    where each shard lives and DistributedModelParallel materializes only the local shards.
    Weighted when any feature is: TorchRec weighs a whole collection or none of it, so the
    source gives weights 1.0 to the other features' ids; a weighted collection's mean tables
    pool by sum, the model divides (``means_after_pooling``)."""
    tables = tables_of(features, embedding_dim)
    weighted = any(f.weighted for f in features)
    if weighted:
        tables = [dataclasses.replace(t, pooling=PoolingType.SUM) for t in tables]
    return EmbeddingBagCollection(tables, is_weighted=weighted, device=torch.device("meta"))


class SparseArch(TorchRecSparseArch):
    """TorchRec's SparseArch (``[B, F, D]``, the features in table order) over the tables of
    ``features``, with the means a weighted collection leaves to the model taken. Same
    submodules and state dict keys as TorchRec's."""

    def __init__(self, features: list[SparseFeature], embedding_dim: int) -> None:
        super().__init__(embedding_collection(features, embedding_dim))
        means = means_after_pooling(features)
        self._means = [name in means for name in self.sparse_feature_names]
        self.keep_output = False  # set by Ranker.set_embedding_l2: the penalty reads ``output``
        self.output: Optional[torch.Tensor] = None

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        pooled = super().forward(features)
        if any(self._means):
            pooled = torch.stack(
                [
                    mean_of(pooled[:, i], features, name) if mean else pooled[:, i]
                    for i, (name, mean) in enumerate(zip(self.sparse_feature_names, self._means))
                ],
                dim=1,
            )
        # TorchRec's DLRM calls its sparse arch inside its own forward, so the embedding
        # penalty cannot be handed the output there: the arch keeps it for the step's loss
        self.output = pooled if self.keep_output and self.training else None
        return pooled


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
    multi_task: ClassVar[bool] = False
    """Scores every task of ``data.labels`` (``[B, T]``, ``hybridrec.models.multitask``), built
    with them as ``tasks``; False = one logit per row, and data.labels must be unset."""
    pooled_tables: ClassVar[bool] = False
    """Looks its tables up through ``SparseArch``: ``model.embedding_l2`` applies."""
    needs_next_item: ClassVar[bool] = False
    """A sequence ranker: its rows are histories (``Source.next_item``); evaluation gets the
    rank of each row's held-out item among the catalogue instead of a score."""

    def __init__(self, loss: Loss) -> None:
        super().__init__()
        self.loss = loss
        self.embedding_l2 = 0.0

    def set_embedding_l2(self, l2: float) -> None:
        """``model.embedding_l2``: add ``l2`` times each row's squared norm of its looked-up
        embeddings (every feature's pooled vector, ``[B, F, D]``) to the training loss, a mean
        over the rows as the loss's (padding counts as zero). The L2 of the rows a batch
        uses, as CTR models regularize their embeddings (DeepCTR's l2_reg_embedding): the
        fused embedding optimizers apply no weight decay, and a decay of every row at each
        step would cost the whole table's bandwidth. Models over ``SparseArch`` only."""
        self.embedding_l2 = float(l2)
        self._arches = [m for m in self.modules() if isinstance(m, SparseArch)]
        for arch in self._arches:
            arch.keep_output = bool(l2)

    def embedding_penalty(self, batch: RecBatch) -> Optional[torch.Tensor]:
        """This step's embedding penalty (``set_embedding_l2``), None when there is none."""
        if not (self.embedding_l2 and self.training):
            return None
        total = None
        for arch in self._arches:
            out, arch.output = arch.output, None
            assert out is not None  # each arch ran in this forward (keep_output)
            per_row = out.float().pow(2).sum((1, 2))
            if batch.weights is not None:
                per_row = per_row * (batch.weights > 0)
            part = self.embedding_l2 * per_row.sum() / per_row.numel()
            total = part if total is None else total + part
        return total

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
        penalty = self.embedding_penalty(batch)
        if penalty is not None:
            loss = loss + penalty
        return loss, (loss.detach(), logits.detach(), batch.labels.detach())


def build_model(
    cfg: DictConfig, features: list[SparseFeature], num_dense_features: int, list_size: Optional[int] = None
) -> Ranker:
    """The model of ``cfg.model`` with the loss of ``cfg.loss``. A model that refuses its
    features or fields (a ValueError: features that cannot share a table) raises that error
    itself, not Hydra's InstantiationException around it, so that it reaches the user as
    one line."""
    from hydra.errors import InstantiationException
    from hydra.utils import get_class

    from hybridrec.config.tasks import tasks_of

    loss = instantiate(cfg.loss, list_size=list_size)
    extra = {}
    if getattr(get_class(cfg.model._target_), "multi_task", False):
        extra["tasks"] = [dataclasses.asdict(t) for t in tasks_of(cfg.data.get("labels"))]
    # every model's config has embedding_l2 (ModelConfig): the base class's, not a
    # constructor's argument (resolved first: the model's fields interpolate others)
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    assert isinstance(model_cfg, dict)
    model_cfg.pop("embedding_l2", None)
    try:
        model = instantiate(model_cfg, features=features, num_dense_features=num_dense_features, loss=loss, **extra)
    except InstantiationException as e:
        if isinstance(e.__cause__, ValueError):
            raise e.__cause__ from None
        raise
    model.set_embedding_l2(cfg.model.get("embedding_l2", 0.0))
    return model


def check_dense_arch(cfg: DictConfig) -> None:
    """A bottom MLP over the dense features whose output meets the embeddings."""
    check_layer_sizes(cfg, "dense_arch_layer_sizes")
    dense = list(cfg.dense_arch_layer_sizes)
    if dense[-1] != cfg.embedding_dim:
        raise ValueError(
            f"model.dense_arch_layer_sizes must end with model.embedding_dim="
            f"{cfg.embedding_dim} (the dense features meet the embeddings), got {dense}"
        )


def check_layer_sizes(cfg: DictConfig, key: str) -> None:
    """``model.<key>`` (``cfg``: the model config): the sizes of an MLP's layers."""
    sizes = list(cfg[key])
    if not sizes or min(sizes) < 1:
        raise ValueError(
            f"model.{key}={sizes}: an MLP's layer sizes, each >= 1 (a layer of 0 units has no output), at least one"
        )
