"""What a rank scores with, built from the config in one place: the data source, the model
and its loss, and the model sharded over the process group. Training (``trainer``) and
scoring a saved model (``scoring``) build the same way; the check before launch
(``preflight``) builds the source and plans with the same inputs, without a process group.

This is the one module that reads the whole config to build; what it builds takes only the
parts it needs (``PlanInputs`` for the planner, the ``mesh`` node for the dense side).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, cast

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from hybridrec.data import build_source, loader
from hybridrec.data.source import Source
from hybridrec.models import Ranker, build_model
from hybridrec.models.losses import Loss
from hybridrec.parallel.parallel_dims import ParallelDims, rank_dims
from hybridrec.parallel.parallelize import Parallelized, parallelize
from hybridrec.parallel.sharding import PlanInputs, format_report
from hybridrec.reports.runlog import write_json

if TYPE_CHECKING:
    from hybridrec.data.sequences import NextItemSource
    from hybridrec.models.sequential import SequenceRanker

log = logging.getLogger("hybridrec.build")  # its name before the packages: hydra.verbose keeps it


def keep_fitted(cfg: DictConfig, data: Source) -> None:
    """Merge into ``cfg.data`` what ``data`` computed from its files when it was built
    (``Source.fitted``): the ranks a launcher starts then get the values rather than fitting
    again, and a checkpoint's config.yaml carries them to evaluation and export."""
    if fitted := data.fitted():
        OmegaConf.update(cfg, "data", fitted, merge=True)
        if not dist.is_initialized() or dist.get_rank() == 0:
            log.info(f"data: fitted on the train split: {_brief(fitted)}")


def _brief(value: Any) -> Any:
    """``value`` with each long list of numbers (an encoded column's knots) as its ends and its
    length, for one readable log line; the config keeps every number."""
    if isinstance(value, dict):
        return {k: _brief(v) for k, v in value.items()}
    if isinstance(value, list):
        if len(value) > 6 and all(isinstance(v, (int, float)) for v in value):
            return f"[{value[0]:g}, {value[1]:g}, ..., {value[-1]:g}] ({len(value)} values)"
        return [_brief(v) for v in value]
    return value


def model_for(cfg: DictConfig, data: Source) -> Ranker:
    """The model of ``cfg.model`` with the loss of ``cfg.loss``, sized by what ``data`` declares
    (its tables, dense features and list size)."""
    model = build_model(cfg, data.features, data.num_dense_features, data.list_size)
    if data.next_item:  # the sampler's log-probabilities, for the loss's log-q correction
        # a next-item source, and so (validation: needs_next_item) a sequence ranker
        source, ranker = cast("NextItemSource", data), cast("SequenceRanker", model)
        ranker.use_sampler(
            source.sampler_log_q(cfg.loss.get("in_batch", False)), source.negative_sampling == "popularity"
        )
    return model


def plan_inputs(cfg: DictConfig, dims: ParallelDims, data: Source) -> PlanInputs:
    """The planner's inputs for this run's layout ``dims`` and ``data``'s measured pooling."""
    return PlanInputs(
        sharding=cfg.sharding,
        topology=cfg.topology,
        dims=dims,
        local_batch=cfg.data.batch_size // dims.world_size,
        pooling={f.name: f.pooling_factor for f in data.features},
        sparse_optimizer=cfg.optimizer.sparse._target_,
    )


def build(cfg: DictConfig, run_dir: str, device: torch.device) -> tuple[Source, Loss, Parallelized]:
    """The data source, the model's loss (its declarations) and the model sharded over the
    process group (the plan report logged and saved by rank 0)."""
    # Dense layers are initialized from the global RNG before sharding: same values on
    # every rank and for every world size. Embeddings get their own plan-independent init.
    torch.manual_seed(cfg.seed)
    data = build_source(cfg.data, cfg.seed)
    keep_fitted(cfg, data)  # under torchrun no process fitted it before launch
    loader.check_splits(data)  # an empty split fails here, before any sharding
    model = model_for(cfg, data)
    dims = rank_dims(cfg, dist.get_world_size(), device)
    world = dist.group.WORLD
    assert world is not None  # the default group, initialized: dist.get_world_size() above needs it
    parallel = parallelize(model, plan_inputs(cfg, dims, data), cfg.mesh, cfg.optimizer.sparse, cfg.seed, device, world)
    if dist.get_rank() == 0:
        assert parallel.plan is not None  # rank 0 plans (collective_plan): the report is its own
        log.info("\n" + format_report(parallel.plan))
        if parallel.dense != cfg.mesh.dense:
            log.info(
                f"dense: mesh.dense={cfg.mesh.dense.value} on one rank runs unwrapped (no peer to shard or "
                f"reduce with); it applies from 2 ranks"
            )
        write_json(os.path.join(run_dir, "plan.json"), parallel.plan)
    return data, model.loss, parallel


_SAID: set[str] = set()


def rank_batches(
    data_cfg: DictConfig,
    data: Source,
    split: str,
    device: torch.device,
    num_batches: Optional[int] = None,
    start: int = 0,
    on_check: Optional[Callable[[Callable[[], None]], None]] = None,
) -> Iterator:
    """This rank's batches of ``split`` from the shared input loop, with the worker processes
    and input thread of ``data_cfg`` (the ``data`` config; pinned memory on CUDA), or, for the
    training split of a source that draws its rows on the device, drawn there (data.device_input).
    ``on_check`` receives the device reader's ``check`` (its data checks' flags: the trainer
    calls it where it reads the losses), for a reader that has one."""
    d = data_cfg
    on_device = d.get("device_input")
    if on_device is None:  # unset: where it saves the GPU a host-built batch, and the config allows it
        on_device = device.type == "cuda" and not d.num_workers and not d.input_thread
    where = dist.get_rank(), dist.get_world_size(), num_batches, start
    # None: a subclass of a source with a device path that has none of its own (MovieLensRank)
    make = getattr(data, "device_rows", None)
    # the device draw makes one label per row: a source with several tasks is read on the CPU,
    # and so are a source's configurations that it converts on the CPU only (device_refusal)
    if on_device and split == "train" and make is not None and not data.tasks:
        if why := getattr(data, "device_refusal", lambda: None)():
            if why not in _SAID:  # once a run (a partitioned log makes a reader per day)
                _SAID.add(why)
                log.info(f"data: the training batches are read on the CPU: {why}")
        else:
            reader = make(device, graph=True) if d.get("device_graph") else make(device)
            if on_check is not None and hasattr(reader, "check"):
                on_check(reader.check)
            return loader.batches(data, split, *where, device_rows=reader)
    return loader.batches(
        data,
        split,
        *where,
        num_workers=d.num_workers,
        prefetch=d.prefetch,
        pin_memory=device.type == "cuda",
        thread=d.input_thread if d.input_thread is not None else device.type == "cuda",
    )
