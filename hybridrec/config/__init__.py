"""Typed configuration:

- ``schema``: one dataclass per config group, registered in Hydra's ConfigStore
  (``register_configs``), so that composing a config type-checks it;
- ``retype``: a config saved as plain YAML (a checkpoint's) typed again by the schemas;
- ``overrides``: what a command line's overrides may name;
- ``objective``: the metric a run is judged by (``train.objective``) and its direction.

The rules across keys, run before any rank starts, are ``hybridrec.run.validation``'s (they
need the mesh's ``ParallelDims``); a model's or a source's own rules are class methods of
that class (``Ranker.check_config``, ``Source.check_config``).

May import: base.
"""

from hybridrec.config.retype import (  # noqa: F401  (the package's interface)
    TARGET_GROUPS,
    evaluation_config,
    renamed_targets,
    shipped_targets,
    typed,
)
from hybridrec.config.schema import (  # noqa: F401  (the schemas and their enums)
    CONF_DIR,
    CRITEO_KAGGLE_CAPPED,
    SPARSE_OPTIMIZERS,
    AdagradConfig,
    AdamConfig,
    AdamWConfig,
    ApproxNDCGConfig,
    BadRows,
    CacheAlgorithm,
    CacheConfig,
    CheckpointConfig,
    CommPrecision,
    CriteoBinaryDataConfig,
    CriteoDataConfig,
    DataConfig,
    DCNConfig,
    DeepFMConfig,
    DenseAdagradConfig,
    DenseDistribution,
    DenseParallel,
    DenseSGDConfig,
    Device,
    DLRMConfig,
    DType,
    EvalItems,
    EvaluateConfig,
    FSDPUnits,
    HybridrecConfig,
    IdMapping,
    InBatchSoftmaxConfig,
    LauncherConfig,
    Logger,
    LossConfig,
    MeshConfig,
    ModelConfig,
    MovieLensDataConfig,
    MovieLensRankDataConfig,
    NegativeSampling,
    OptimizerConfig,
    Pipeline,
    ProfileConfig,
    RowWiseAdagradConfig,
    Schedule,
    ScheduleConfig,
    SGDConfig,
    ShardingConfig,
    ShardingType,
    SparseAdamConfig,
    SplitKind,
    StorageReservation,
    SyntheticDataConfig,
    TableConstraints,
    TopologyConfig,
    TrainConfig,
    TwoTowerConfig,
    register_configs,
)
