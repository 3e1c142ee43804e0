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
    """All optimizers as one ``CombinedOptimizer`` (what the pipeline steps):

    - ``sparse``: the fused optimizers TorchRec runs inside the embedding backward;
    - ``sparse_dp``: data-parallel tables. TorchRec leaves them unfused and, by its convention,
      to the dense optimizer; here they get the sparse optimizer too (same class and
      arguments, non-fused), so ``optimizer.sparse`` governs every table whatever its plan;
    - ``dense``: everything else (FSDP2 DTensors or DDP replicas), built after parallelization.
    """
    unfused = dict(in_backward_optimizer_filter(model.named_parameters()))
    tables = {id(p) for p in model.module.sparse_module().parameters()}
    dp_tables = {n: p for n, p in unfused.items() if id(p) in tables}
    dense_params = {n: p for n, p in unfused.items() if id(p) not in tables}
    optimizers = [("sparse", model.fused_optimizer)]
    if dp_tables:
        optimizers.append(("sparse_dp", _keyed(dp_tables, cfg.sparse)))
    optimizers.append(("dense", _keyed(dense_params, cfg.dense)))
    return CombinedOptimizer(optimizers)


def _keyed(params: dict, cfg: DictConfig) -> KeyedOptimizerWrapper:
    return KeyedOptimizerWrapper(params, lambda p: instantiate(cfg, list(p)))
