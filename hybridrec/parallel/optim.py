"""Optimizers: the sparse one fused into TorchRec's embedding backward, the dense one plain
torch; learning-rate schedules for both; clipping of the dense gradients."""

from __future__ import annotations

import math
from typing import Any, Callable, cast

import torch
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from hybridrec.config import Schedule


def sparse_optimizer(cfg: DictConfig) -> tuple[type, dict[str, Any]]:
    """The class and keyword arguments for ``apply_optimizer_in_backward``: TorchRec maps them
    onto its fused kernels (rowwise Adagrad, Adagrad, Adam, SGD)."""
    kwargs = {k: v for k, v in cfg.items() if not str(k).startswith("_")}
    return get_class(cfg._target_), cast(dict[str, Any], kwargs)  # a config node's keys: names


def lr_multiplier(cfg: DictConfig) -> Callable[[int], float]:
    """The schedule as a function of the step (0-based): the factor on the base lr."""
    end, shape = (
        cfg.end_factor,
        {
            Schedule.linear: lambda p: 1 - p,
            Schedule.cosine: lambda p: 0.5 * (1 + math.cos(math.pi * p)),
            Schedule.polynomial: lambda p: (1 - p) ** cfg.power,
        }.get(cfg.name),
    )

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if shape is None or step < cfg.decay_start:
            return 1.0
        progress = min(1.0, (step - cfg.decay_start) / cfg.decay_steps)
        return end + (1 - end) * shape(progress)

    return factor


class TrainOptimizer:
    """What the train pipeline steps: every optimizer as one TorchRec ``CombinedOptimizer``,
    plus what happens around ``step()``: clipping the dense gradients to a global norm before,
    advancing the learning-rate schedules after.

    - ``sparse``: the fused optimizers TorchRec runs inside the embedding backward (they read
      their learning rate from ``param_groups`` at every ``zero_grad``, so schedules apply);
    - ``sparse_dp``: data-parallel tables. TorchRec leaves them unfused and, by its convention,
      to the dense optimizer; here they get the sparse optimizer too (same class and
      arguments, non-fused), so ``optimizer.sparse`` governs every table whatever its plan;
    - ``dense``: everything else (FSDP2 DTensors or DDP replicas), built after parallelization.
    """

    def __init__(self, model: DistributedModelParallel, cfg: DictConfig) -> None:
        unfused = dict(in_backward_optimizer_filter(model.named_parameters()))
        tables = {id(p) for p in model.module.sparse_module().parameters()}
        dp_tables = {n: p for n, p in unfused.items() if id(p) in tables}
        self.dense_params = [p for n, p in unfused.items() if id(p) not in tables]
        self.dense = _keyed({n: p for n, p in unfused.items() if id(p) not in tables}, cfg.dense)
        parts: list[tuple[str, KeyedOptimizer]] = [("sparse", model.fused_optimizer)]
        if dp_tables:
            parts.append(("sparse_dp", _keyed(dp_tables, cfg.sparse)))
        parts.append(("dense", self.dense))
        self.optimizer = CombinedOptimizer(parts)
        sparse_lr, dense_lr = lr_multiplier(cfg.sparse_schedule), lr_multiplier(cfg.dense_schedule)
        self.schedulers = [LambdaLR(opt, dense_lr if name == "dense" else sparse_lr) for name, opt in parts]
        self.clip = cfg.clip_grad_norm
        self.grad_norms: list[torch.Tensor] = []  # per step, when clipping (no host sync here)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Any = None) -> None:
        if self.clip is not None:
            # FSDP2 gradients are DTensors: the norm is reduced over their mesh, so it is the
            # norm of the full gradient, equal to the single-process one.
            norm = torch.nn.utils.clip_grad_norm_(self.dense_params, self.clip)
            self.grad_norms.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).detach())
        self.optimizer.step()
        for scheduler in self.schedulers:
            scheduler.step()

    def lrs(self) -> dict[str, float]:
        """Current learning rate of each part (first parameter group)."""
        return {name: opt.param_groups[0]["lr"] for name, opt in self.optimizer.optimizers if opt.param_groups}


def _keyed(params: dict, cfg: DictConfig) -> KeyedOptimizerWrapper:
    return KeyedOptimizerWrapper(params, lambda p: instantiate(cfg, list(p)))
