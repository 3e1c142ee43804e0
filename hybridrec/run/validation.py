"""The rules a type cannot express, checked before any rank starts (``validate``) and
once the device is known (``check_device``). Each raises ValueError naming the keys and the
fix; the first problem found is the one reported."""

from __future__ import annotations

import inspect
import math
from dataclasses import fields, is_dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, cast

from hydra.utils import get_class
from omegaconf import DictConfig, ListConfig, OmegaConf

from hybridrec.config.retype import refuse_key
from hybridrec.config.schema import (
    SPARSE_OPTIMIZERS,
    DenseParallel,
    Device,
    DType,
    Logger,
    Schedule,
    ShardingType,
    TrainSchedule,
)
from hybridrec.parallel.parallel_dims import ParallelDims

if TYPE_CHECKING:
    from hybridrec.data.source import Source
    from hybridrec.models import Ranker
    from hybridrec.models.losses import Loss

# Fused optimizers fbgemm's CPU kernels implement (its TBE asserts the same list).
CPU_SPARSE_OPTIMIZERS = ("torchrec.optim.RowWiseAdagrad", "torch.optim.Adagrad", "torch.optim.SGD")


def check_device(cfg: DictConfig, device_type: str) -> None:
    """Rules that depend on the device the run uses; raises ValueError before launch."""
    planned_for = cfg.topology.compute_device
    if planned_for != Device.auto and planned_for.value != device_type:
        raise ValueError(
            f"topology.compute_device={planned_for.value} but this run would use {device_type} "
            f"(launcher.device={cfg.launcher.device.value})"
        )
    if device_type == "cpu" and cfg.data.get("device_graph"):
        raise ValueError(
            "data.device_graph=true captures the batches' draw in a CUDA graph: it needs a GPU "
            "(launcher.device=cuda); leave data.device_graph unset on CPU ranks"
        )
    if device_type == "cpu" and cfg.mesh.embedding_replicas > 1:
        raise ValueError(
            f"mesh.embedding_replicas={cfg.mesh.embedding_replicas} needs CUDA: TorchRec 1.8's "
            f"DMPCollection (2D parallelism) asserts a CUDA or MTIA device, and this run would use "
            f"cpu (launcher.device={cfg.launcher.device.value}). Plan it here with "
            f"`python -m hybridrec.plan`, train it on GPUs, or set mesh.embedding_replicas=1"
        )
    if device_type == "cpu" and cfg.optimizer.sparse._target_ not in CPU_SPARSE_OPTIMIZERS and not _unfused(cfg):
        raise ValueError(
            f"optimizer.sparse={cfg.optimizer.sparse._target_} has no fused CPU kernel in fbgemm "
            f"(GPU only); on CPU use optimizer/sparse=rowwise_adagrad, adagrad or sgd, or "
            f"sharding=data_parallel (small tables: replicated, trained by the plain torch optimizer)"
        )


def _unfused(cfg: DictConfig) -> bool:
    """Every table data-parallel: TorchRec's dense kernel, no fused optimizer; the sparse
    optimizer is then plain torch's (TrainOptimizer's ``sparse_dp``), any class works."""
    dp = [ShardingType.data_parallel.value]
    types = lambda v: [ShardingType(t).value for t in v]
    return types(cfg.sharding.types) == dp and all(
        c.get("sharding_types") is None or types(c.sharding_types) == dp for c in cfg.sharding.tables
    )


def _kwargs(node: DictConfig) -> dict[str, Any]:
    # keyword arguments: a config's keys are strings (OmegaConf types a key as any DictKeyType)
    return cast("dict[str, Any]", {k: v for k, v in node.items() if not str(k).startswith("_")})


def _validate_loss(cfg: DictConfig) -> None:
    """The loss, the model and the data must fit together: each class declares what it needs
    or provides (hybridrec.models.losses.Loss, hybridrec.models.Ranker, hybridrec.data.source.Source)."""
    loss = cast("type[Loss]", get_class(cfg.loss._target_))
    model = cast("type[Ranker]", get_class(cfg.model._target_))
    source = cast("type[Source]", get_class(cfg.data._target_))
    name = lambda c: c.__name__
    labels = cfg.data.get("labels")
    if model.multi_task and not labels:
        raise ValueError(
            f"model={name(model)} trains several tasks: set data.labels, a task per label "
            f"(+experiment=multitask shows how)"
        )
    if labels and not model.multi_task and (len(labels) > 1 or labels[0].get("after") or labels[0].kind != "binary"):
        raise ValueError(
            f"data.labels gives {len(labels)} task(s) and model={name(model)} scores one binary label: use "
            f"model=shared_bottom, mmoe or ple, or give data.labels one binary task"
        )
    if labels and cfg.loss._target_ != "hybridrec.models.losses.BCE":
        raise ValueError(
            f"loss={name(loss)}: with data.labels each task's loss follows its kind (binary: cross-entropy, "
            f"regression: squared error); leave loss=pointwise"
        )
    if loss.needs_lists and not source.lists:
        raise ValueError(
            f"loss={name(loss)} ranks lists: it needs a list source "
            f"(data=movielens_rank, or +experiment=movielens_rank); data={name(source)} has none"
        )
    if loss.needs_relevance and "relevance" not in source.extra_fields:
        raise ValueError(
            f"loss={name(loss)} needs graded relevance (ratings): data=movielens or data=movielens_rank; "
            f"data={name(source)} has labels only"
        )
    if loss.in_batch_negatives and not model.in_batch_negatives:
        raise ValueError(
            f"loss={name(loss)} scores users against in-batch items: it needs a model with user and "
            f"item towers (model=two_tower), not model={name(model)}"
        )
    if (loss.needs_next_item or model.needs_next_item or source.next_item) and not (
        loss.needs_next_item and model.needs_next_item and source.next_item
    ):
        raise ValueError(
            f"next-item training takes a sequence model (model=sasrec or hstu), a next-item source "
            f"(data=movielens_seq or parquet_seq) and loss=next_item together (+experiment=sequences); "
            f"got model={name(model)}, data={name(source)}, loss={name(loss)}"
        )
    if source.next_item and cfg.data.max_length > cfg.model.max_length:
        raise ValueError(
            f"data.max_length={cfg.data.max_length} is more history than the model has positions "
            f"(model.max_length={cfg.model.max_length}): lower data.max_length or raise model.max_length"
        )
    if source.next_item and not cfg.data.train_negatives:  # 0: every item of the catalogue is a candidate
        sampling = getattr(cfg.data.negative_sampling, "value", cfg.data.negative_sampling)
        if sampling != "uniform":
            raise ValueError(
                f"data.negative_sampling={sampling} chooses how sampled negatives are "
                "drawn, and data.train_negatives=0 samples none (the softmax scores every item): set "
                "data.train_negatives, or leave data.negative_sampling=uniform"
            )
        if cfg.loss.get("in_batch"):
            raise ValueError(
                "loss.in_batch=true adds the batch's next items to sampled negatives, and "
                "data.train_negatives=0 scores every item already (each would count twice): set "
                "data.train_negatives, or loss.in_batch=false"
            )
    if model.needs_user_item_features and not source.user_item_features:
        raise ValueError(
            f"model={name(model)} needs user and item features: data={name(source)} has none; "
            f"use +experiment=movielens_retrieval (or data=movielens / movielens_rank)"
        )


# Keys whose children are free-form: an optimizer's keyword arguments, checked against its
# signature instead; Hydra's own config (present when a launcher callback validates).
_FREE_FORM = ("optimizer.sparse", "optimizer.dense", "hydra")


def _check_keys(node: Any, path: str = "") -> None:
    """Every key is a field of its schema. Hydra's ``+key=value`` adds a key even to a typed
    config, so a misspelled ``+train.stepz=30`` would otherwise be silently ignored."""
    if path in _FREE_FORM:
        return
    schema = OmegaConf.get_type(node) if isinstance(node, DictConfig) else None
    if is_dataclass(schema):
        names = [f.name for f in fields(schema)]
        for key in node:
            if key not in names and f"{path}.{key}".lstrip(".") not in _FREE_FORM:
                refuse_key(str(key), names, path)
    if isinstance(node, (DictConfig, ListConfig)):
        keys: Iterable[Any] = node.keys() if isinstance(node, DictConfig) else range(len(node))  # names or indices
        for key in keys:
            if not OmegaConf.is_missing(node, key) and not OmegaConf.is_interpolation(node, key):
                child = node[key]
                if isinstance(child, (DictConfig, ListConfig)):
                    _check_keys(child, f"{path}.{key}" if path else str(key))


def _check_finite(node: Any, path: str = "") -> None:
    """No NaN or infinity in any number of the config. Checked once for every key, because a
    NaN passes every range comparison (``lr > 0`` is False for NaN and so is ``lr <= 0``) and
    then changes what a run computes without an error (a NaN Zipf exponent, a NaN rate)."""
    if isinstance(node, (DictConfig, ListConfig)):
        keys: Iterable[Any] = node.keys() if isinstance(node, DictConfig) else range(len(node))  # names or indices
        for key in keys:
            if key == "hydra" or OmegaConf.is_missing(node, key) or OmegaConf.is_interpolation(node, key):
                continue
            _check_finite(node[key], f"{path}.{key}" if path else str(key))
    elif isinstance(node, float) and not math.isfinite(node):
        raise ValueError(f"{path}={node} is not a finite number: give a finite value")


def _paths(node: DictConfig, prefix: str = "") -> list[str]:
    """Every dotted key of a config, depth first, in order."""
    out = []
    for key in cast("Iterable[str]", node.keys()):  # a config's keys are strings
        path = f"{prefix}{key}"
        out.append(path)
        if (
            not OmegaConf.is_missing(node, key)
            and not OmegaConf.is_interpolation(node, key)
            and isinstance(node[key], DictConfig)
        ):
            out += _paths(node[key], path + ".")
    return out


def _check_positive(cfg: DictConfig) -> None:
    """Sizes and degrees that must be positive. Checked explicitly: 0 would otherwise read as
    "unset" (``x or default``) or fail deep inside a library."""
    if cfg.data.batch_size < 1:
        raise ValueError(f"data.batch_size must be >= 1, got {cfg.data.batch_size}")
    if cfg.model.embedding_dim < 1:
        raise ValueError(f"model.embedding_dim must be >= 1, got {cfg.model.embedding_dim}")
    if cfg.model.embedding_dim % 4:
        raise ValueError(
            f"model.embedding_dim={cfg.model.embedding_dim}: TorchRec's fused embedding kernels (fbgemm) "
            f"take widths that are multiples of 4; use {cfg.model.embedding_dim // 4 * 4 or 4} or "
            f"{cfg.model.embedding_dim // 4 * 4 + 4}"
        )
    for group, key in (
        ("mesh", "replicate"),
        ("mesh", "shard"),
        ("topology", "world_size"),
        ("topology", "local_world_size"),
    ):
        if cfg[group][key] is not None and cfg[group][key] < 1:
            raise ValueError(f"{group}.{key} must be >= 1 (or unset), got {cfg[group][key]}")
    topo = cfg.topology
    for key in ("device_memory_gb", "host_memory_gb", "intra_host_bandwidth_gbs", "inter_host_bandwidth_gbs"):
        if topo[key] is not None and topo[key] <= 0:
            raise ValueError(f"topology.{key} must be > 0 (or unset to detect it), got {topo[key]}")


def validate(cfg: DictConfig, world_size: int) -> None:
    """Every check that can run before any rank starts, one function per config group, in
    this order (the first problem found is the one reported). Raises ValueError naming the
    keys and the fix."""
    _validate_structure(cfg)
    _validate_run(cfg)
    _validate_launcher(cfg, world_size)
    _validate_mesh(cfg, world_size)
    _validate_schedules(cfg)
    _validate_data(cfg, world_size)
    _validate_model(cfg)
    _validate_loss(cfg)
    _validate_references(cfg)
    _validate_optimizers(cfg)


def _validate_structure(cfg: DictConfig) -> None:
    """Every required key set, no unknown key, sizes and degrees positive."""
    # hybridrec's keys only: Hydra's own (present under a launcher callback) resolve later
    ours = [k for k in cast("Iterable[str]", cfg.keys()) if k != "hydra"]
    unset = {m for k in ours if isinstance(cfg[k], DictConfig) for m in OmegaConf.missing_keys(cfg[k])}  # full keys
    missing = [p for k in ours if isinstance(cfg[k], DictConfig) for p in _paths(cfg[k], f"{k}.") if p in unset]
    if missing:
        raise ValueError(
            f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set: give "
            f"{' '.join(f'{k}=...' for k in missing)} on the command line or in an experiment"
        )
    _check_keys(cfg)
    _check_finite(cfg)
    _check_positive(cfg)


def _validate_references(cfg: DictConfig) -> None:
    """train.references: each names a split and a metric this run's loss and data report
    (its value is finite: ``_check_finite``); the ones of another data source are left out at the end, not refused
    (an experiment's reference stays in its file when data= swaps the source)."""
    from hybridrec.config.objective import choices
    from hybridrec.config.tasks import tasks_of

    loss, source = get_class(cfg.loss._target_), get_class(cfg.data._target_)
    offered = [
        c.split(".", 1)[1]
        for c in choices(
            bool(getattr(loss, "calibrated", False)),
            cfg.data.get("ranking_k"),
            bool(getattr(source, "next_item", False)),
            tasks_of(cfg.data.get("labels")),
        )
    ]
    for i, ref in enumerate(cfg.train.references):
        if unset := sorted(OmegaConf.missing_keys(ref)):  # the structure check walks mappings, not lists
            raise ValueError(
                f"{', '.join(unset)} not set: a reference (train.references[{i}]) gives name, metric, "
                f"value, source and data"
            )
        split, _, metric = ref.metric.partition(".")
        if split not in ("valid", "eval") or metric not in offered:
            raise ValueError(
                f"train.references[{i}].metric={ref.metric} ({ref.name}): must be valid.<metric> or "
                f"eval.<metric> (the test split) with a metric this loss and data report: "
                f"{', '.join(offered)}"
            )


def _validate_run(cfg: DictConfig) -> None:
    """train, checkpoint, profile and logger."""
    if cfg.train.steps < 1:
        raise ValueError(f"train.steps must be >= 1, got {cfg.train.steps}")
    if cfg.train.log_every < 1:
        raise ValueError(f"train.log_every must be >= 1, got {cfg.train.log_every}")
    if cfg.train.eval_every < 0:
        raise ValueError(f"train.eval_every must be >= 0, got {cfg.train.eval_every}")
    ck = cfg.checkpoint
    if ck.every_n_steps < 0:
        raise ValueError(f"checkpoint.every_n_steps={ck.every_n_steps}: must be >= 0 (0 = only at the end)")
    if ck.keep_last < 1:
        raise ValueError(f"checkpoint.keep_last={ck.keep_last}: must be >= 1 (the checkpoints kept)")
    if ck.every_n_steps and not ck.dir:
        raise ValueError("checkpoint.every_n_steps is set but checkpoint.dir is not")
    if ck.keep_best is True and not (ck.dir and cfg.train.eval_every):
        raise ValueError(
            "checkpoint.keep_best=true keeps the checkpoint of the best validation evaluation: it needs "
            "checkpoint.dir and train.eval_every > 0"
        )
    if cfg.train.early_stop_patience < 0 or cfg.train.early_stop_patience and not cfg.train.eval_every:
        raise ValueError(
            f"train.early_stop_patience={cfg.train.early_stop_patience} counts evaluations: it must be "
            f">= 0, and > 0 needs train.eval_every > 0"
        )
    if ck.max_loss_ratio is not None and not ck.max_loss_ratio >= 1:
        raise ValueError(
            f"checkpoint.max_loss_ratio={ck.max_loss_ratio} would call a loss exploded at or below the "
            f"run's typical loss: it must be >= 1 (5 by default), or null to check only that losses "
            f"are finite"
        )
    if cfg.train.schedule == TrainSchedule.continuous:
        _validate_continuous(cfg)
    managed = [i for i, f in enumerate(cfg.data.get("sparse") or []) if f.get("id_mapping") == "managed"]
    if managed and cfg.train.schedule != TrainSchedule.continuous:
        # The rows change hands at partition boundaries, and a reused row is reset there: what
        # the continuous schedule does between partitions. Another schedule would read a
        # partition again in a later epoch with the rows of its own time.
        raise ValueError(
            f"data.sparse.{managed[0]}.id_mapping=managed gives rows partition by partition, as "
            f"train.schedule=continuous reads them: set train.schedule=continuous, or use id_mapping=hash"
        )
    if ck.export_deltas and (cfg.train.schedule != TrainSchedule.continuous or not ck.dir):
        raise ValueError(
            "checkpoint.export_deltas=true exports each partition's checkpoint to serving: it needs "
            "train.schedule=continuous and checkpoint.dir"
        )
    prof = cfg.profile
    if prof.enabled and (prof.steps < 1 or prof.start_step < 0 or prof.start_step + prof.steps > cfg.train.steps):
        raise ValueError(
            f"profile.start_step={prof.start_step} + profile.steps={prof.steps} must fit in "
            f"train.steps={cfg.train.steps} (start_step >= 0, steps >= 1)"
        )
    if cfg.logger == Logger.tensorboard:
        try:
            import tensorboard  # noqa: F401  (imported only to see that it is installed)
        except ImportError:
            raise ValueError(
                "logger=tensorboard needs the optional tensorboard package: "
                "pip install -c constraints.txt -e '.[tensorboard]'"
            ) from None


def _validate_continuous(cfg: DictConfig) -> None:
    """train.schedule=continuous: a partitioned log, judged by progressive validation."""
    from hybridrec.training.continuous import progressive_metric

    if cfg.data.get("partitions") is None:
        raise ValueError(
            "train.schedule=continuous trains day by day over a partitioned log: set data.partitions "
            "(data=parquet, data.train_path a directory of partitions like day=2026-11-26/), or "
            "use train.schedule=steps"
        )
    progressive_metric(cfg.train.objective)
    if cfg.train.early_stop_patience or cfg.checkpoint.keep_best is True:  # auto (null) is off here
        raise ValueError(
            "train.early_stop_patience and checkpoint.keep_best choose a step by validation; a "
            "continuous run ships its latest model, judged by progressive validation: unset them "
            "with train.schedule=continuous"
        )


def _validate_launcher(cfg: DictConfig, world_size: int) -> None:
    if world_size < 1:
        raise ValueError(f"launcher.nproc_per_node must be >= 1, got {world_size}")
    la = cfg.launcher
    if la.threads_per_rank is not None and la.threads_per_rank < 1:
        raise ValueError(
            f"launcher.threads_per_rank must be >= 1 (or unset: split the cores), got {la.threads_per_rank}"
        )
    if la.max_restarts < 0:
        raise ValueError(f"launcher.max_restarts={la.max_restarts}: must be >= 0 (0 = a failed rank fails the job)")
    for key in ("health_check_timeout_s", "collective_timeout_s"):
        if la[key] <= 0:
            raise ValueError(f"launcher.{key}={la[key]}: a timeout in seconds, must be > 0")
    if la.max_restarts and not (cfg.checkpoint.dir and cfg.checkpoint.resume == "auto"):
        raise ValueError(
            "launcher.max_restarts restarts ranks from the newest checkpoint: set checkpoint.dir "
            "(and keep checkpoint.resume=auto), or restarted ranks would start over"
        )


def _validate_mesh(cfg: DictConfig, world_size: int) -> None:
    """Dense parallelism, embedding replicas and the planner's hardware keys."""
    mesh, topo = cfg.mesh, cfg.topology
    if topo.world_size is not None and topo.world_size != world_size:
        raise ValueError(
            f"topology.world_size={topo.world_size} but this run has {world_size} rank(s) "
            f"(launcher.nproc_per_node or torchrun); topology.world_size is for planning with "
            f"`python -m hybridrec.plan`: leave it unset for training"
        )
    if topo.local_world_size is not None and topo.local_world_size > (topo.world_size or world_size):
        raise ValueError(
            f"topology.local_world_size={topo.local_world_size} exceeds the world size {topo.world_size or world_size}"
        )
    if not 0 <= topo.reservation_percentage < 1:
        raise ValueError(f"topology.reservation_percentage must be in [0, 1), got {topo.reservation_percentage}")
    launched = cfg.launcher.device
    if topo.compute_device != Device.auto and launched != Device.auto and topo.compute_device != launched:
        raise ValueError(
            f"topology.compute_device={topo.compute_device.value} but launcher.device={launched.value}: "
            f"a plan is for the device the run uses"
        )
    # Raises if the degrees do not fit: hsdp's replicate x shard, the embedding replicas.
    dims = ParallelDims.build(mesh, world_size, topo.local_world_size or world_size, "cpu")
    for key in ("replicate", "shard"):
        # Only hsdp reads them; set with another mode and different from what that mode does,
        # they would be silently ignored.
        if mesh[key] is not None and mesh.dense != DenseParallel.hsdp and mesh[key] != getattr(dims, key):
            raise ValueError(
                f"mesh.{key}={mesh[key]} is read only by mesh=hsdp (its dense "
                f"{'replicas' if key == 'replicate' else 'shard degree'}); mesh={mesh.dense.value} would ignore it: "
                f"unset it, or use mesh=hsdp"
            )
    if mesh.dense == DenseParallel.single and world_size != 1:
        raise ValueError(f"mesh=single has no dense parallelism and needs 1 rank, got world_size={world_size}")
    fsdp = mesh.dense in (DenseParallel.fsdp, DenseParallel.hsdp)
    if (mesh.param_dtype or mesh.reduce_dtype) and not (
        fsdp or mesh.dense == DenseParallel.single and not mesh.reduce_dtype
    ):
        raise ValueError(
            f"mesh.param_dtype / mesh.reduce_dtype are the dense part's mixed precision (FSDP2's policy; on one "
            f"rank, autocast), and mesh={mesh.dense.value} keeps its parameters and gradients fp32: use mesh=fsdp "
            f"or mesh=hsdp (mesh=single: mesh.param_dtype only), or unset them"
        )
    if mesh.param_dtype == DType.float16:
        # fp16 gradients underflow without loss scaling, which hybridrec does not apply.
        raise ValueError(
            "mesh.param_dtype=float16 needs loss scaling (gradients underflow in fp16), which hybridrec "
            "does not apply: use mesh.param_dtype=bfloat16 (same exponent range as fp32)"
        )
    raf = mesh.reshard_after_forward
    if not isinstance(raf, bool) and not (isinstance(raf, int) and raf >= 1):
        raise ValueError(f"mesh.reshard_after_forward must be true, false or an int >= 1, got {raf!r}")
    for key in ("forward_prefetch", "backward_prefetch"):
        if mesh[key] < 0:
            raise ValueError(f"mesh.{key}={mesh[key]}: must be >= 0 (0 = FSDP2's own prefetching)")
    if mesh.embedding_sync_every < 1:
        raise ValueError(f"mesh.embedding_sync_every must be >= 1, got {mesh.embedding_sync_every}")
    if mesh.embedding_replicas > 1 and cfg.checkpoint.dir:
        # TorchRec saves 2D tables as DTensors replicated over the replica groups; hybridrec's
        # checkpoints are tested with 1-D sharding only, and 2D has not yet run (it needs GPUs).
        raise ValueError(
            "mesh.embedding_replicas > 1 with checkpoint.dir: checkpoints of 2D-sharded tables "
            "are not supported yet (untested); unset checkpoint.dir or set mesh.embedding_replicas=1"
        )


def _validate_schedules(cfg: DictConfig) -> None:
    for part in ("sparse_schedule", "dense_schedule"):
        sch = cfg.optimizer[part]
        for key in ("warmup_steps", "decay_start", "decay_steps"):
            if sch[key] < 0:
                raise ValueError(f"optimizer.{part}.{key}={sch[key]}: a number of steps, must be >= 0")
        if sch.name != Schedule.constant and sch.decay_steps < 1:
            raise ValueError(f"optimizer.{part}.name={sch.name.value} needs decay_steps >= 1")
        if sch.name != Schedule.constant and sch.decay_start < sch.warmup_steps:
            raise ValueError(
                f"optimizer.{part}.decay_start={sch.decay_start} is inside the warmup (warmup_steps={sch.warmup_steps})"
            )
    if cfg.optimizer.clip_grad_norm is not None and cfg.optimizer.clip_grad_norm <= 0:
        raise ValueError(f"optimizer.clip_grad_norm must be > 0, got {cfg.optimizer.clip_grad_norm}")


# Counts of the data sources (each key where its source has it): smallest valid value. A
# negative count would otherwise train every step and fail at the first evaluation.
_DATA_COUNTS = {"eval_batches": 1, "valid_batches": 0, "list_size": 1, "negatives": 0, "eval_negatives": 0}


def _validate_data(cfg: DictConfig, world_size: int) -> None:
    if cfg.data.batch_size % world_size != 0:
        raise ValueError(
            f"data.batch_size={cfg.data.batch_size} is the global batch and must divide "
            f"evenly over world_size={world_size} ranks"
        )
    if cfg.data.num_workers < 0:
        raise ValueError(f"data.num_workers={cfg.data.num_workers}: must be >= 0 (0 = read in the rank itself)")
    if cfg.data.get("device_input"):
        source = get_class(cfg.data._target_)
        if getattr(source, "device_rows", None) is None:  # None: MovieLensRank, whose lists are drawn per list
            raise ValueError(
                f"data.device_input=true: {source.__name__} reads its rows on the CPU (the synthetic log, Criteo's "
                f"binary layout, Parquet logs, MovieLens' ratings (data=movielens) and the next-item histories "
                f"(data=movielens_seq, parquet_seq) can make them on the device); leave data.device_input unset"
                + (", or convert the TSV once: python -m hybridrec.data.convert" if "TSV" in source.__name__ else "")
            )
        if cfg.data.get("labels"):
            raise ValueError(
                "data.device_input=true makes one label per row on the device; data.labels (several tasks) "
                "are read on the CPU: leave data.device_input unset"
            )
        if cfg.data.num_workers:
            raise ValueError(
                f"data.device_input=true draws the batches on the device, not in workers: set "
                f"data.num_workers=0 (it is {cfg.data.num_workers}) or leave data.device_input unset"
            )
    if cfg.data.get("device_graph"):
        source = get_class(cfg.data._target_)
        if "graph" not in inspect.signature(getattr(source, "device_rows", None) or (lambda: None)).parameters:
            raise ValueError(
                f"data.device_graph=true: {source.__name__} has no draw to capture in a CUDA graph (only "
                f"the synthetic log has); leave data.device_graph unset"
            )
        if cfg.data.get("labels"):
            raise ValueError(
                "data.device_graph=true draws one label per row; data.labels are read on the CPU: unset it"
            )
        if cfg.data.get("device_input") is False or cfg.data.num_workers or cfg.data.get("input_thread"):
            raise ValueError(
                "data.device_graph=true replays the batches' draw on the GPU: leave data.device_input "
                "unset (or true), data.num_workers=0 and data.input_thread unset"
            )
    if cfg.data.prefetch < 1:
        raise ValueError(f"data.prefetch={cfg.data.prefetch}: batches built ahead, must be >= 1")
    for key, least in _DATA_COUNTS.items():
        value = cfg.data.get(key)
        if value is not None and value < least:
            raise ValueError(f"data.{key} must be >= {least}, got {value}")
    # The source's own rules (shards, table sizes, whole lists per rank), declared beside its traits.
    cast("type[Source]", get_class(cfg.data._target_)).check_config(cfg.data, world_size)


def _validate_model(cfg: DictConfig) -> None:
    """The model's own rules (its layer sizes), declared beside its traits."""
    model = cast("type[Ranker]", get_class(cfg.model._target_))
    l2 = cfg.model.get("embedding_l2", 0.0)
    if l2 < 0 or (l2 and not model.pooled_tables):
        raise ValueError(
            f"model.embedding_l2={l2}: a penalty >= 0 on the pooled embeddings of dlrm, dcn, deepfm, "
            f"shared_bottom, mmoe and ple; {model.__name__} has none: leave it 0"
        )
    model.check_config(cfg.model)


def _validate_optimizers(cfg: DictConfig) -> None:
    """Only what TorchRec can fuse, and keyword arguments the optimizers accept."""
    if cfg.optimizer.sparse.get("weight_decay", 0.0):
        # Measured: 0 and 0.1 train identically, even with fbgemm's weight_decay_mode set.
        raise ValueError(
            "optimizer.sparse.weight_decay is not applied by TorchRec 1.8's fused embedding "
            "optimizers (fbgemm keeps weight_decay_mode=NONE; training is identical with 0 and "
            "0.1), so hybridrec refuses it rather than ignore it: leave it 0 (model.embedding_l2 "
            "penalizes the embeddings a batch looks up)"
        )
    sparse = cfg.optimizer.sparse._target_
    if sparse not in SPARSE_OPTIMIZERS:
        raise ValueError(
            f"optimizer.sparse._target_={sparse} cannot be fused by TorchRec; "
            f"valid choices: {', '.join(SPARSE_OPTIMIZERS)}"
        )
    # Bind the keyword arguments now, so a wrong one fails here and not inside every rank.
    for part in ("sparse", "dense"):
        node = cfg.optimizer[part]
        try:
            inspect.signature(get_class(node._target_)).bind([], **_kwargs(node))
        except (TypeError, ImportError, ValueError) as e:
            raise ValueError(f"optimizer.{part} ({node._target_}): {e}") from e
        for key, value in _kwargs(node).items():
            if key == "betas" and len(value) != 2:
                raise ValueError(
                    f"optimizer.{part}.betas={list(value)}: Adam's two decay rates (beta1, beta2), e.g. [0.9, 0.999]"
                )
            if key in _OPTIMIZER_RANGES:
                ok, valid = _OPTIMIZER_RANGES[key]
                if not all(ok(v) for v in (value if isinstance(value, (list, tuple, ListConfig)) else [value])):
                    raise ValueError(
                        f"optimizer.{part}.{key}={value} is out of range: it must be {valid} "
                        f"({node._target_.rsplit('.', 1)[-1]})"
                    )


# The ranges of the optimizers' hyperparameters, checked before launch: torch checks some only
# when a rank builds the optimizer, and fbgemm's fused kernels none (a negative rate trains).
_OPTIMIZER_RANGES: dict[str, tuple[Callable[[float], bool], str]] = {
    "lr": (lambda v: v > 0, "> 0"),
    "eps": (lambda v: v > 0, "> 0"),
    "weight_decay": (lambda v: v >= 0, ">= 0"),
    "momentum": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "dampening": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "betas": (lambda v: 0 <= v < 1, "two values in [0, 1)"),
    "lr_decay": (lambda v: v >= 0, ">= 0"),
    "initial_accumulator_value": (lambda v: v >= 0, ">= 0"),
}
