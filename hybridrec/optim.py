"""Optimizers: the sparse one fused into TorchRec's embedding backward, the dense one plain torch."""

from __future__ import annotations

from typing import Any

from hydra.utils import get_class, instantiate
from omegaconf import DictConfig
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter


def sparse_optimizer(cfg: DictConfig) -> tuple[type, dict[str, Any]]:
    """The class and keyword arguments for ``apply_optimizer_in_backward``: TorchRec maps them
    onto its fused kernels (rowwise Adagrad, Adagrad, Adam, SGD)."""
    kwargs = {k: v for k, v in cfg.items() if not str(k).startswith("_")}
    return get_class(cfg._target_), kwargs


def build_optimizer(model: DistributedModelParallel, cfg: DictConfig) -> CombinedOptimizer:
    """Dense optimizer over the parameters left after sharding (FSDP2 DTensors or DDP
    replicas), combined with the fused sparse one so the pipeline sees a single optimizer.
    Built after parallelization, as FSDP2 requires."""
    dense_params = dict(in_backward_optimizer_filter(model.named_parameters()))
    dense = KeyedOptimizerWrapper(dense_params, lambda params: instantiate(cfg.dense, params))
    return CombinedOptimizer([("sparse", model.fused_optimizer), ("dense", dense)])
