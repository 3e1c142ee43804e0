"""Typed configuration, in three modules:

- ``schema``: one dataclass per config group, registered in Hydra's ConfigStore
  (``register_configs``), so that composing a config type-checks it;
- ``validation``: the rules across keys, run before any rank starts (``validate``) and once
  the device is known (``check_device``); a model's or a source's own rules are class
  methods of that class (``Ranker.check_config``, ``Source.check_config``);
- ``retype``: a config saved as plain YAML (a checkpoint's) typed again by the schemas.

The names below are the schemas' interface. Validation is imported from its module
(``from hybridrec.config.validation import validate``): it needs ``ParallelDims``, whose
module needs the schemas' enums, so importing the package must not import it.
"""

from hybridrec.config.retype import TARGET_GROUPS, evaluation_config, shipped_targets, typed
from hybridrec.config.schema import (  # noqa: F401  (the schemas and their enums)
    ModelConfig, DLRMConfig, DCNConfig, DeepFMConfig, TwoTowerConfig, LossConfig, ApproxNDCGConfig,
    InBatchSoftmaxConfig, DataConfig, DenseDistribution, SyntheticDataConfig, IdMapping, BadRows,
    CRITEO_KAGGLE_CAPPED, CriteoDataConfig, CriteoBinaryDataConfig, SplitKind, MovieLensDataConfig,
    NegativeSampling, EvalItems, MovieLensRankDataConfig, ShardingType, CacheAlgorithm, CacheConfig,
    TableConstraints, ShardingConfig, AdagradConfig, DenseAdagradConfig, RowWiseAdagradConfig,
    AdamConfig, SparseAdamConfig, AdamWConfig, SGDConfig, DenseSGDConfig, Schedule, ScheduleConfig,
    OptimizerConfig, SPARSE_OPTIMIZERS, DenseParallel, DType, FSDPUnits, CommPrecision, Device,
    StorageReservation, MeshConfig, TopologyConfig, LauncherConfig, Pipeline, TrainConfig,
    CheckpointConfig, Logger, ProfileConfig, HybridrecConfig, EvaluateConfig,
    CONF_DIR, register_configs,
)
