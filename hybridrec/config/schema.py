"""The schemas: one dataclass per config group, registered in Hydra's ConfigStore.

Every YAML file under ``conf/`` starts with ``defaults: [<schema>, _self_]``, so OmegaConf
type-checks it against these dataclasses: a misspelled key or a wrong type fails while Hydra
composes the config, before any rank starts. Rules across keys live in
``hybridrec.run.validation``; a config saved as YAML is typed again by
``hybridrec.config.retype``.

The groups' schemas live in modules of their own (``schema_model``: model and loss;
``schema_data``: the sources; ``schema_optim``: optimizers and schedules;
``schema_parallel``: sharding, mesh, topology, launcher); this module holds the run's own
keys (train, checkpoint, profile), the top-level and evaluate schemas and their
registration, and re-exports every schema.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from hydra.utils import get_class
from omegaconf import MISSING, OmegaConf

from hybridrec.config.objective import direction
from hybridrec.config.schema_data import (  # noqa: F401  (re-exported: the group schemas)
    CRITEO_KAGGLE_CAPPED,
    BadRows,
    CriteoBinaryDataConfig,
    CriteoDataConfig,
    DataConfig,
    DenseDistribution,
    DenseTransform,
    EvalItems,
    Eviction,
    IdMapping,
    ManagedIdsConfig,
    MovieLensDataConfig,
    MovieLensRankDataConfig,
    MovieLensSequencesConfig,
    NegativeSampler,
    NegativeSampling,
    NullIds,
    NumericEncoding,
    ParquetDataConfig,
    ParquetDenseConfig,
    ParquetIdMapping,
    ParquetLabelConfig,
    ParquetSequencesConfig,
    ParquetSparseConfig,
    PartitionsConfig,
    Pooling,
    SequenceDataConfig,
    SplitKind,
    SyntheticDataConfig,
    TaskConfig,
    TaskKind,
)
from hybridrec.config.schema_model import (  # noqa: F401  (re-exported: the group schemas)
    ApproxNDCGConfig,
    DCNConfig,
    DeepFMConfig,
    DLRMConfig,
    HSTUConfig,
    InBatchSoftmaxConfig,
    Interaction,
    LossConfig,
    MMoEConfig,
    ModelConfig,
    NextItemConfig,
    PLEConfig,
    SASRecConfig,
    SequenceConfig,
    SharedBottomConfig,
    TwoTowerConfig,
)
from hybridrec.config.schema_optim import (  # noqa: F401  (re-exported: the group schemas)
    SPARSE_OPTIMIZERS,
    AdagradConfig,
    AdamConfig,
    AdamWConfig,
    DenseAdagradConfig,
    DenseSGDConfig,
    OptimizerConfig,
    RowWiseAdagradConfig,
    Schedule,
    ScheduleConfig,
    SGDConfig,
    SparseAdamConfig,
)
from hybridrec.config.schema_parallel import (  # noqa: F401  (re-exported: the group schemas)
    CacheAlgorithm,
    CacheConfig,
    CommPrecision,
    DenseParallel,
    Device,
    DType,
    FSDPUnits,
    LauncherConfig,
    MeshConfig,
    ShardingConfig,
    ShardingType,
    StorageReservation,
    TableConstraints,
    TopologyConfig,
)


# ---------------------------------------------------------------------------- run
class Pipeline(str, Enum):
    sparse_dist = "sparse_dist"
    """TorchRec's TrainPipelineSparseDist: the next batch's input all-to-all overlaps this
    batch's forward/backward."""
    base = "base"
    """TorchRec's TrainPipelineBase: one batch at a time, nothing overlapped (a baseline)."""


class TrainSchedule(str, Enum):
    steps = "steps"
    """train.steps global batches over the train split, pass after pass."""
    continuous = "continuous"
    """One pass over each time partition (data.partitions) in order, each scored by the model
    before it trains on it (progressive validation; hybridrec.training.continuous); train.steps is the
    partitions' global batches, set when the run starts."""


@dataclass
class ReferenceConfig:
    """A known score of an experiment: what its summary and report.png put the run beside."""

    name: str = MISSING
    """What scored it: planted model, logistic regression, ..."""
    metric: str = MISSING
    """valid.<metric> or eval.<metric> (the test split): a key the run's metrics block has."""
    value: float = MISSING
    """Its score."""
    source: str = MISSING
    """Where it was measured: the script or results file that reproduces it."""
    data: str = MISSING
    """The data source it was measured on (data._target_): a run that reads another source
    (``+experiment=ctr data=criteo``) is not compared with it."""


@dataclass
class TrainConfig:
    steps: int = 100
    """Optimizer steps (global batches) to train."""
    schedule: TrainSchedule = TrainSchedule.steps
    """steps, or continuous: day by day over a partitioned log (see TrainSchedule)."""
    log_every: int = 10
    """Steps between loss reports: one all-reduce of the window's losses (not one per step), a
    metrics.jsonl record and, when stderr is not a terminal, one progress line."""
    eval_every: int = 0
    """Evaluate on the whole eval set every N steps (0 = only at the end, which always runs)."""
    pipeline: Pipeline = Pipeline.sparse_dist
    """TorchRec train pipeline that runs each step: sparse_dist (overlapped) or base."""
    objective: str = "auto"
    """The validation metric the run is judged by: what a sweep job returns (to any Hydra
    sweeper), what checkpoint.keep_best and early stopping follow, how the sweep table is
    sorted. valid.<metric> (valid.logloss, valid.ne, valid.auc, valid.ndcg@10, ...), or auto:
    valid.logloss for a calibrated loss, valid.ndcg@k for a ranking source, else valid.auc.
    Without a validation split, auto returns the train loss and anything else is refused."""
    early_stop_patience: int = 0
    """Stop after this many evaluations (every train.eval_every steps) without the objective
    improving; 0 = train every step."""
    references: list[ReferenceConfig] = field(default_factory=list)
    """Known scores of the experiment (the synthetic log's planted model, a baseline from
    benchmarks/results): summary.json, the end-of-run lines and report.png show the run
    beside them."""


@dataclass
class CheckpointConfig:
    dir: Optional[str] = None
    """Where checkpoints go (step_<N> directories); None = no checkpoints."""
    every_n_steps: int = 0
    """Save every N steps (0 = only at the end of training)."""
    keep_last: int = 2
    """Complete checkpoints kept; older ones are deleted after each commit."""
    resume: str = "auto"
    """auto = newest complete checkpoint in dir if any; never; or a checkpoint path."""
    async_save: bool = False
    """Write checkpoints in the background (DCP async_save) while training continues."""
    keep_best: Optional[bool] = None
    """Also keep the checkpoint with the best objective seen at train.eval_every (beside the
    keep_last newest), and score the test split with its weights at the end. null (auto): on
    when the run checkpoints (checkpoint.dir) and validates (train.eval_every and a validation
    split), off otherwise and under train.schedule=continuous; true or false decide."""
    max_loss_ratio: Optional[float] = 5.0
    """A save is committed only if the loss of the step after it is finite and at most this many
    times the run's typical loss (the lowest of the median of its losses so far, that of its
    first 10 steps and its first step's loss: a median that diverged with the run cannot
    excuse it), and a run whose last losses
    are over it ends with an error: a model whose loss exploded resumes no better than one
    whose loss is NaN. >= 1; null = finite is enough."""
    allow_unverified: bool = False
    """Resume a checkpoint whose trainer_state.json records no checksums: only checkpoints
    written by a hybridrec older than checksums lack them. Every other checkpoint without
    them is refused as damaged or edited (a removed manifest would otherwise hide any change)."""
    export_deltas: bool = False
    """train.schedule=continuous: after each partition's checkpoint commits, keep
    <checkpoint.dir>/serving current: a full export the first time, then a delta per partition
    (hybridrec.serving.delta: the changed table rows and dense tensors, and the managed ids)."""
    trusted_targets: list[str] = field(default_factory=list)
    """Classes of your own that a checkpoint's config.yaml may name in a ``_target_`` (model,
    loss, data, optimizers) besides the ones hybridrec ships and this run's own. Given here,
    never read from a checkpoint: a saved config can only name what the loading run trusts."""


class Logger(str, Enum):
    file = "file"
    """metrics.jsonl, summary.json, report.png in the run directory."""
    tensorboard = "tensorboard"
    """The files, plus TensorBoard event files under <run dir>/tensorboard (optional extra)."""


@dataclass
class ProfileConfig:
    enabled: bool = False
    """Profile a window of steps with torch.profiler: trace files and the comm/compute split."""
    start_step: int = 5
    """Steps to skip before the window (tracing, pipeline fill, lazy init); the step before
    the window is the profiler's warm-up. 0 = from the first step, with its one-time costs
    (lazy init, first collectives, first optimizer step) and no warm-up step."""
    steps: int = 5
    """Steps in the profiled window."""


@dataclass
class HybridrecConfig:
    model: ModelConfig = MISSING
    loss: LossConfig = MISSING
    data: DataConfig = MISSING
    sharding: ShardingConfig = MISSING
    optimizer: OptimizerConfig = MISSING
    mesh: MeshConfig = MISSING
    topology: TopologyConfig = MISSING
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logger: Logger = Logger.file
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    seed: int = 0
    """Seeds data, dense init and the sharding-invariant embedding init: same seed, same losses."""


# ---------------------------------------------------------------------------- evaluate
@dataclass
class EvaluateConfig:
    """``python -m hybridrec.evaluate``: a saved model scored on one split. The model, loss,
    sharding, mesh and seed are the checkpoint's own (its config.yaml); only the data and
    the launcher are given here."""

    checkpoint: str = MISSING
    """A committed checkpoint directory written by training: <checkpoint.dir>/step_<N>."""
    split: str = "eval"
    """The split to score: eval (the test set) or valid (when the source has one)."""
    predictions: bool = True
    """Write predictions.parquet (row, label, score of every scored row) beside metrics.json."""
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    allow_unverified: bool = False
    """Score a checkpoint written by a hybridrec older than checksums (checkpoint.allow_unverified
    in training); any other checkpoint without them is refused as damaged or edited."""
    export_deltas: bool = False
    """train.schedule=continuous: after each partition's checkpoint commits, keep
    <checkpoint.dir>/serving current: a full export the first time, then a delta per partition
    (hybridrec.serving.delta: the changed table rows and dense tensors, and the managed ids)."""
    trusted_targets: list[str] = field(default_factory=list)
    """Classes of your own that the checkpoint's config.yaml may name in a ``_target_``,
    besides the ones hybridrec ships (checkpoint.trusted_targets in training)."""
    data: Any = field(default_factory=dict)
    """Keys that change the checkpoint's data config (data.eval_path=..., data.eval_batches=null);
    data=<option> starts from that option's YAML instead of the checkpoint's data config."""


# The option YAMLs of every config group (hybridrec/conf).
CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")
_registered = False


def register_configs() -> None:
    """Register the schemas in Hydra's ConfigStore (once per process: a rank reading a
    checkpoint's config calls it again)."""
    global _registered
    if _registered:
        return
    _registered = True
    # conf/hydra/launcher/slurm.yaml sizes a job's CPUs per rank: ${hybridrec.mul:a,b} = a*b.
    if not OmegaConf.has_resolver("hybridrec.mul"):
        OmegaConf.register_new_resolver("hybridrec.mul", lambda *xs: math.prod(int(x) for x in xs))
    # conf/hydra/sweeper/objective.yaml: the study's direction is train.objective's.
    if not OmegaConf.has_resolver("hybridrec.direction"):
        OmegaConf.register_new_resolver("hybridrec.direction", _direction)
    cs = ConfigStore.instance()
    cs.store(name="hybridrec_schema", node=HybridrecConfig)
    # Schemas live under schema/<group>/ so that a group's listed choices (in Hydra's
    # "Available options" error) are only the real options; each YAML pulls its schema in
    # with `- /schema/<group>/<name>@_here_`.
    cs.store(group="schema/model", name="dlrm", node=DLRMConfig)
    cs.store(group="schema/model", name="dcn", node=DCNConfig)
    cs.store(group="schema/model", name="deepfm", node=DeepFMConfig)
    cs.store(group="schema/model", name="shared_bottom", node=SharedBottomConfig)
    cs.store(group="schema/model", name="mmoe", node=MMoEConfig)
    cs.store(group="schema/model", name="ple", node=PLEConfig)
    cs.store(group="schema/model", name="two_tower", node=TwoTowerConfig)
    cs.store(group="schema/model", name="sasrec", node=SASRecConfig)
    cs.store(group="schema/model", name="hstu", node=HSTUConfig)
    cs.store(group="schema/loss", name="loss", node=LossConfig)
    cs.store(group="schema/loss", name="approx_ndcg", node=ApproxNDCGConfig)
    cs.store(group="schema/loss", name="sampled_softmax", node=InBatchSoftmaxConfig)
    cs.store(group="schema/loss", name="next_item", node=NextItemConfig)
    cs.store(group="schema/data", name="synthetic", node=SyntheticDataConfig)
    cs.store(group="schema/data", name="criteo", node=CriteoDataConfig)
    cs.store(group="schema/data", name="criteo_binary", node=CriteoBinaryDataConfig)
    cs.store(group="schema/data", name="movielens", node=MovieLensDataConfig)
    cs.store(group="schema/data", name="movielens_rank", node=MovieLensRankDataConfig)
    cs.store(group="schema/data", name="parquet", node=ParquetDataConfig)
    cs.store(group="schema/data", name="movielens_seq", node=MovieLensSequencesConfig)
    cs.store(group="schema/data", name="parquet_seq", node=ParquetSequencesConfig)
    cs.store(group="schema/sharding", name="sharding", node=ShardingConfig)
    cs.store(group="schema/mesh", name="mesh", node=MeshConfig)
    cs.store(group="schema/topology", name="topology", node=TopologyConfig)
    cs.store(group="schema/optimizer", name="optimizer", node=OptimizerConfig)
    for name, node in [
        ("rowwise_adagrad", RowWiseAdagradConfig),
        ("adagrad", AdagradConfig),
        ("adam", SparseAdamConfig),
        ("sgd", SGDConfig),
    ]:
        cs.store(group="schema/optimizer/sparse", name=name, node=node)
    for name, node in [
        ("adagrad", DenseAdagradConfig),
        ("adam", AdamConfig),
        ("adamw", AdamWConfig),
        ("sgd", DenseSGDConfig),
    ]:
        cs.store(group="schema/optimizer/dense", name=name, node=node)
    # The evaluate entry point's data node takes any key of any source (the checkpoint's
    # data config decides which schema types them, after composition): not in struct mode.
    evaluate = OmegaConf.structured(EvaluateConfig)
    OmegaConf.set_struct(evaluate.data, False)
    cs.store(name="hybridrec_evaluate_schema", node=evaluate)


def _direction(objective: str, loss_target: str, ranking_k: Optional[int], data_target: Optional[str] = None) -> str:
    next_item = bool(data_target and getattr(get_class(data_target), "next_item", False))
    return direction(objective, bool(getattr(get_class(loss_target), "calibrated", False)), ranking_k, next_item)
