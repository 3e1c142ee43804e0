"""Tasks: the labels of a row when one model predicts several things at once (a click, a
conversion after the click, a watch time), declared by ``data.labels``.

A source with several tasks gives ``Rows.labels`` as float32 ``[n, T]``, column t task t's
label, in the order of ``data.labels``; with one task or none (``data.labels`` unset) one label
per row, ``[n]``, as every single-task model reads it (so a single-task model can train one
task of a multi-task log: the baseline a multi-task model is measured against). A multi-task model
(``hybridrec.models.multitask``) scores ``[B, T]`` and its loss (``TaskLoss``) weighs each
task's loss by its ``weight``.

A task ``after`` another (ESMM's dependency: a conversion is observed only after a click)
is scored as the joint probability P(parent and task) = P(parent) * P(task | parent),
trained on every row with the task's own label (1 only where the parent is 1): the model's
task output is the logit of that product, so its sigmoid is a probability like any
binary task's, and the conditional P(task | parent) is also reported on the parent's
positive rows (``<task>.auc_given_<parent>``).

May import: base.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

KINDS = ("binary", "regression", "ordinal")
"""binary: 0/1 labels, a logit, trained with cross-entropy and reported with AUC, NE, log loss,
calibration and accuracy; regression: real labels, trained with squared error and reported
with RMSE and MAE; ordinal: grades 0 .. levels - 1 (a rating), a score and learned cut-points
(the proportional-odds model: P(grade >= k) = sigmoid(score - cut_k)), trained with the
grade's negative log-likelihood and reported, as the expected grade, with RMSE, MAE and the
accuracy of the nearest grade."""

BINARY_METRICS = ("auc", "logloss", "ne", "accuracy")
"""What a binary task is judged by (``train.objective=valid.<task>.<metric>``); its calibration
and label rate are reported too."""
REGRESSION_METRICS = ("rmse", "mae")
ORDINAL_METRICS = ("rmse", "mae", "accuracy")


@dataclass(frozen=True)
class Task:
    name: str
    column: str
    kind: str = "binary"
    weight: float = 1.0
    after: Optional[str] = None
    threshold: Optional[float] = None
    """A file source's binary label from a numeric column: value > threshold (unset: the value,
    0 or 1)."""
    levels: Optional[int] = None
    """An ordinal task's grades: 0 .. levels - 1."""

    @property
    def metrics(self) -> tuple[str, ...]:
        """The per-task metric keys (``<name>.<metric>``) an evaluation reports."""
        names = {"binary": BINARY_METRICS, "regression": REGRESSION_METRICS, "ordinal": ORDINAL_METRICS}[self.kind]
        given = (f"auc_given_{self.after}",) if self.after else ()
        return tuple(f"{self.name}.{m}" for m in names + given)


def _field(spec: Any, key: str) -> Any:
    """Field ``key`` of a ``data.labels`` entry (a mapping or a config node), None when unset,
    enums as their values; ``kind`` defaults to binary and ``weight`` to 1.0."""
    value = spec.get(key) if hasattr(spec, "get") else getattr(spec, key, None)
    value = getattr(value, "value", value)
    if value is None:
        return {"kind": "binary", "weight": 1.0}.get(key)
    return value


def tasks_of(labels: Any) -> list[Task]:
    """The tasks of ``data.labels`` (a list of mappings, or None/empty: no tasks, one label per
    row), checked (``check_tasks``)."""
    if not labels:
        return []
    check_tasks(labels)
    return [
        Task(
            name=str(_field(spec, "name")),
            column=str(_field(spec, "column") or _field(spec, "name")),
            kind=str(_field(spec, "kind")),
            weight=float(_field(spec, "weight")),
            after=_field(spec, "after"),
            threshold=_field(spec, "threshold"),
            levels=_field(spec, "levels"),
        )
        for spec in labels
    ]


def check_tasks(labels: Sequence[Any], columns: Optional[Sequence[str]] = None) -> None:
    """Refuse, with a ValueError naming the key and the fix, ``data.labels`` that cannot be
    trained: a task without a name or named twice, an unknown kind, a weight that is
    negative or not finite, weights all zero, a dependency on an unknown task (or itself,
    or a later one: dependencies follow the list's order, so there is no cycle), a
    dependency of or on a task that is not binary, and (``columns``: the label columns the
    source has) a column it does not have."""
    seen: list[str] = []
    kinds: dict[str, str] = {}
    for i, spec in enumerate(labels):
        key = f"data.labels[{i}]"
        name = _field(spec, "name")
        if not name or not isinstance(name, str) or "." in name:
            raise ValueError(f"{key}.name={name!r}: each task needs a name (no dots: metrics are <task>.<metric>)")
        if name in seen:
            raise ValueError(f"{key}.name={name}: task {name} is given twice; task names must be unique")
        kind = str(_field(spec, "kind"))
        if kind not in KINDS:
            raise ValueError(f"{key}.kind={kind}: one of {', '.join(KINDS)}")
        weight = _field(spec, "weight")
        if not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
            raise ValueError(f"{key}.weight={weight}: a task's weight in the loss, finite and >= 0")
        after = _field(spec, "after")
        if after is not None:
            if after == name:
                raise ValueError(f"{key}.after={after}: a task cannot depend on itself")
            if after not in seen:
                listed = ", ".join(seen) or "none"
                raise ValueError(
                    f"{key}.after={after}: no task {after} is listed before {name} (listed before it: "
                    f"{listed}); a task depends on one listed earlier in data.labels"
                )
            if kind != "binary" or kinds[after] != "binary":
                raise ValueError(
                    f"{key}.after={after}: a dependency (P({name} and {after}) = P({after}) * "
                    f"P({name} | {after})) joins two binary tasks; {after} is {kinds[after]}, {name} is {kind}"
                )
        column = _field(spec, "column") or name
        if columns is not None and column not in columns:
            raise ValueError(
                f"{key}.column={column}: this data has no such label column (it has: {', '.join(columns)})"
            )
        levels = _field(spec, "levels")
        if kind == "ordinal" and (not isinstance(levels, int) or isinstance(levels, bool) or levels < 2):
            raise ValueError(f"{key}.levels={levels}: an ordinal task's number of grades (0 .. levels - 1), >= 2")
        if kind != "ordinal" and levels is not None:
            raise ValueError(f"{key}.levels: grades are an ordinal task's; task {name} is {kind}")
        if _field(spec, "threshold") is not None and kind != "binary":
            raise ValueError(f"{key}.threshold: a threshold makes a binary label; task {name} is {kind}")
        seen.append(name)
        kinds[name] = kind
    weights = [float(_field(spec, "weight")) for spec in labels]
    if labels and not any(w > 0 for w in weights):
        raise ValueError("data.labels: every task's weight is 0, so nothing would be trained; give one a weight > 0")
