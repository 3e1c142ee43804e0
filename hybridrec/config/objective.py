"""The objective: the one validation metric a run is judged by, declared once
(``train.objective``) and read by everything that chooses: a sweep job's return value (what
any Hydra sweeper optimizes), ``checkpoint.keep_best`` and ``train.early_stop_patience``,
and the sweep table's order.

Only the validation split is ever used to choose: the test split (``eval``) is scored once,
at the end, and reported, never optimized. ``auto`` picks what the loss and the data
declare: log loss for a calibrated pointwise loss (it rewards calibrated probabilities, as
NE does), NDCG@k for a ranking source, AUC otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from hybridrec.config.tasks import Task, tasks_of

SPLIT = "valid"
# The metrics a lower value of is better; every other one (auc, accuracy, map, ndcg@k,
# recall@k) is maximized.
_MINIMIZE = ("logloss", "ne", "rmse", "mae")


@dataclass(frozen=True)
class Objective:
    metric: str
    """A key of the validation metrics block (``summary.json``'s ``eval``)."""
    maximize: bool

    @property
    def name(self) -> str:
        return f"{SPLIT}.{self.metric}"

    @property
    def direction(self) -> str:
        """What Optuna (and most sweepers) call it."""
        return "maximize" if self.maximize else "minimize"

    @property
    def worst(self) -> float:
        """What a failed job returns: every sweeper ranks it last, none stops on it."""
        return -math.inf if self.maximize else math.inf

    def better(self, value: float, than: Optional[float]) -> bool:
        """``value`` improves on ``than`` (None: nothing yet). NaN never improves."""
        if math.isnan(value):
            return False
        return than is None or (value > than if self.maximize else value < than)

    def value(self, metrics: dict[str, float]) -> float:
        return float(metrics[self.metric])


NEXT_ITEM_METRICS = ("ndcg@10", "hr@10", "mrr", "ndcg@50", "hr@50", "ndcg@200", "hr@200")
"""What a next-item evaluation reports (every item of the catalogue ranked per user)."""


def choices(
    calibrated: bool, ranking_k: Optional[int], next_item: bool = False, tasks: Sequence[Task] = ()
) -> list[str]:
    """The objectives a run with this loss and data can declare, ``auto``'s first. With
    ``tasks`` (data.labels): the binary tasks' weighted log loss and AUC, then each task's own
    metrics (``valid.<task>.auc``)."""
    if next_item:
        return [f"{SPLIT}.{n}" for n in NEXT_ITEM_METRICS]
    if tasks:
        weighted = ["logloss", "auc"] if any(t.kind == "binary" for t in tasks) else []
        return [f"{SPLIT}.{n}" for n in weighted + [m for t in tasks for m in t.metrics]]
    names = (
        (["logloss", "ne"] if calibrated else [])
        + ([f"ndcg@{ranking_k}", "map", f"recall@{ranking_k}"] if ranking_k else [])
        + ["auc"]
    )
    if ranking_k and calibrated:  # a ranking source is judged by its ranking, first
        names = names[2:5] + names[:2] + names[5:]
    return [f"{SPLIT}.{n}" for n in names] + ([f"{SPLIT}.accuracy"] if calibrated else [])


def resolve(
    spec: str, calibrated: bool, ranking_k: Optional[int], next_item: bool = False, tasks: Sequence[Task] = ()
) -> Objective:
    """``train.objective`` for a run whose loss is ``calibrated`` and whose source ranks
    lists of ``ranking_k`` (None: rows), or is a ``next_item`` source. Raises ValueError
    naming the valid choices."""
    valid = choices(calibrated, ranking_k, next_item, tasks)
    name = valid[0] if spec == "auto" else spec
    if name not in valid:
        why = (
            "the test split (eval) is scored once and never chosen on: use the validation split"
            if spec.startswith("eval.")
            else f"it must be auto or one of {', '.join(valid)}"
        )
        raise ValueError(f"train.objective={spec}: {why} (this loss and data offer {', '.join(valid)})")
    metric = name.split(".", 1)[1]
    return Objective(metric, maximize=metric.rsplit(".", 1)[-1] not in _MINIMIZE)


def direction(spec: str, calibrated: bool, ranking_k: Optional[int], next_item: bool = False) -> str:
    """``resolve(...).direction``: for the shipped sweeper configs' interpolation. A task's metric
    (``valid.<task>.<metric>``, which only data.labels offers) goes by its metric's name: the
    objective itself is checked before launch (``check``)."""
    if spec.count(".") >= 2 and spec.startswith(f"{SPLIT}."):
        return "minimize" if spec.rsplit(".", 1)[1] in _MINIMIZE else "maximize"
    return resolve(spec, calibrated, ranking_k, next_item).direction


@dataclass
class Selection:
    """The best validation evaluation so far, and the evaluations since: part of every
    checkpoint (``TrainState.selection``), so keep_best and early stopping go on across a
    resume as if uninterrupted."""

    best_step: Optional[int] = None
    best_value: Optional[float] = None
    best_checkpoint: Optional[str] = None
    """With checkpoint.keep_best: the checkpoint saved at ``best_step`` (None until committed
    ones exist, or when its save was dropped)."""
    evals_since_best: int = 0

    def update(self, objective: Objective, value: float, step: int) -> bool:
        """Record an evaluation at ``step``; True when it is the best so far."""
        if objective.better(value, self.best_value):
            self.best_step, self.best_value, self.best_checkpoint = step, value, None
            self.evals_since_best = 0
            return True
        self.evals_since_best += 1
        return False

    def to_dict(self) -> dict:
        return dict(vars(self))

    @classmethod
    def from_dict(cls, fields: dict) -> Selection:
        return cls(
            **{k: fields[k] for k in ("best_step", "best_value", "best_checkpoint", "evals_since_best") if k in fields}
        )


def keeps_best(keep_best: Optional[bool], checkpoints: bool, validates: bool) -> bool:
    """``checkpoint.keep_best``: true or false as given; auto (None) keeps the best checkpoint
    whenever there is one to keep: the run saves ``checkpoints`` and ``validates`` (every
    train.eval_every steps, on a validation split, not a continuous run's progressive scores)."""
    return keep_best if keep_best is not None else checkpoints and validates


def declared(cfg: Any) -> Objective:
    """The objective a run's config declares, from the config alone (the loss class's
    ``calibrated`` and the data's ``ranking_k``): what the sweeper configs' direction and a
    failed job's worst value are computed from. Raises ValueError for a bad train.objective."""
    from hydra.utils import get_class

    calibrated = bool(getattr(get_class(cfg.loss._target_), "calibrated", False))
    next_item = bool(getattr(get_class(cfg.data._target_), "next_item", False))
    tasks = tasks_of(cfg.data.get("labels"))
    return resolve(cfg.train.objective, calibrated, cfg.data.get("ranking_k"), next_item, tasks)


def check(cfg: Any, splits: Sequence[str], asked: bool) -> None:
    """Refuse, before launch, an objective that cannot be computed: a bad train.objective, or
    one that is ``asked`` for (a search sweeper's job, keep_best, early stopping, an explicit
    train.objective) by a run whose data has no validation split (naming the keys that
    give it one)."""
    objective = declared(cfg)
    if asked and SPLIT not in splits:
        keys = [f"data.{k}" for k in ("valid_fraction", "valid_path", "valid_batches") if k in cfg.data]
        raise ValueError(
            f"train.objective={cfg.train.objective} ({objective.name}) needs a validation split, and this data "
            f"has none: give it one with {' or '.join(keys) or 'a source that has one'} (a search sweeper, "
            f"checkpoint.keep_best and train.early_stop_patience choose on validation, never on the test split)"
        )
