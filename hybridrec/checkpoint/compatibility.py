"""Whether a checkpoint fits a run: the features its tables were trained for, the model,
loss and optimizers that decide its state dict, and whose checkpoints a directory holds."""

from __future__ import annotations

import json
import os
from typing import Any, Optional, cast

from omegaconf import DictConfig, OmegaConf

from hybridrec.checkpoint.errors import CheckpointError
from hybridrec.checkpoint.safety import CONFIG_YAML, run_targets, saved_config
from hybridrec.checkpoint.state import STATE_JSON, TrainState, committed


def _feature_layout(f: dict[str, Any]) -> tuple[str, int, str, str, bool]:
    """What of a sparse feature (``SparseFeature`` fields) the trained tables depend on: its
    name, rows, table, pooling and weighting. A checkpoint saved before features named
    their table, pooling and weighting has SparseFeature's defaults, which meant the same."""
    table = f.get("table")
    return (
        f["name"],
        f["num_embeddings"],
        table if table is not None else f"t_{f['name']}",
        f.get("pooling", "sum"),
        bool(f.get("weighted", False)),
    )


def _feature_text(layout: tuple[str, int, str, str, bool]) -> str:
    """``name (rows[, table, pooling, weighted])``: the defaults unsaid."""
    name, rows, table, pooling, weighted = layout
    parts = [f"{rows:,} rows"]
    if table != f"t_{name}":
        parts.append(f"table {table}")
    if pooling != "sum":
        parts.append(f"{pooling} pooling")
    if weighted:
        parts.append("weighted")
    return f"{name} ({', '.join(parts)})"


def check_fits(state: TrainState, features: list[Any], num_dense_features: int, path: str) -> None:
    """The data's features are those the checkpoint's tables were trained for: same names,
    order, sizes, tables, pooling and weighting, same number of dense features. Checked
    before launch: the tables would not load otherwise (or, worse, ids would mean other
    rows, or be pooled otherwise than they were trained)."""
    saved = [_feature_layout(f) for f in state.features]
    given = [_feature_layout(vars(f)) for f in features]
    if saved != given:
        diff = next((i for i, (a, b) in enumerate(zip(saved, given)) if a != b), min(len(saved), len(given)))
        what = lambda fs: _feature_text(fs[diff]) if diff < len(fs) else "nothing"
        raise CheckpointError(
            f"the data's sparse feature {diff} is {what(given)} but {path} was trained with {what(saved)} "
            f"({len(given)} features against {len(saved)}): give data keys that keep the features of "
            f"{os.path.join(path, 'config.yaml')}"
        )
    if num_dense_features != state.num_dense_features:
        raise CheckpointError(
            f"the data has {num_dense_features} dense features but {path} was trained with {state.num_dense_features}"
        )


def _short(target: Any) -> str:
    return str(target).rsplit(".", 1)[-1]


def _names(names: list[str], shown: int = 3) -> str:
    return ", ".join(names[:shown]) + (f" +{len(names) - shown} more" if len(names) > shown else "")


def layout_differences(
    saved: DictConfig,
    saved_features: list[dict[str, Any]],
    saved_dense: int,
    cfg: DictConfig,
    features: list[dict[str, Any]],
    dense: int,
) -> list[str]:
    """What differs, between a checkpoint and a run, in what decides the checkpoint's state
    dict (its keys, shapes and meaning): the model (class and every field that shapes its
    weights), the tables (names, rows; the width is model.embedding_dim), how each sparse
    feature uses them (table, pooling, weighting), the dense features, the loss and the
    optimizers (their state is saved). One ``key: checkpoint X, run Y`` per difference. The
    mesh, the sharding and the world size are not in it: DCP reshards a checkpoint to any
    of them."""
    diffs = []
    model, run_model = saved.model, cfg.model
    if model.get("_target_") != run_model._target_:
        # Fields of another model class mean nothing side by side: the class is the difference.
        diffs.append(f"model._target_: checkpoint {_short(model.get('_target_'))}, run {_short(run_model._target_)}")
    else:
        free = getattr(OmegaConf.get_type(run_model), "free_on_resume", ())
        for key in run_model:
            if key == "_target_" or key in free:
                continue
            a, b = model.get(key), run_model[key]
            a, b = (OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v for v in (a, b))
            if a != b:
                diffs.append(f"model.{key}: checkpoint {a}, run {b}")
    saved_layout = [_feature_layout(f) for f in saved_features]
    run_layout = [_feature_layout(f) for f in features]
    rows = {table: n for _, n, table, _, _ in saved_layout}
    run_rows = {table: n for _, n, table, _, _ in run_layout}
    if rows.keys() != run_rows.keys():
        only_saved = [t for t in rows if t not in run_rows]
        only_run = [t for t in run_rows if t not in rows]
        diffs.append(f"tables: only in the checkpoint [{_names(only_saved)}], only in the run [{_names(only_run)}]")
    resized = [t for t in run_rows if t in rows and rows[t] != run_rows[t]]
    diffs += [f"{t} rows: checkpoint {rows[t]:,}, run {run_rows[t]:,}" for t in resized[:3]]
    if len(resized) > 3:
        diffs.append(f"{len(resized) - 3} more tables resized")
    # Same tables, fed otherwise: the weights load, and mean other things.
    saved_use = {name: (table, pooling, weighted) for name, _, table, pooling, weighted in saved_layout}
    changed = [
        (name, saved_use[name], use)
        for name, _, *use in run_layout
        if name in saved_use and saved_use[name] != tuple(use)
    ]
    use_text = lambda u: f"table {u[0]}, {u[1]} pooling" + (", weighted" if u[2] else "")
    diffs += [f"feature {name}: checkpoint {use_text(a)}, run {use_text(b)}" for name, a, b in changed[:3]]
    if len(changed) > 3:
        diffs.append(f"{len(changed) - 3} more features fed otherwise")
    if saved_dense != dense:
        diffs.append(f"dense features: checkpoint {saved_dense}, run {dense}")
    if (tasks := _tasks(saved)) != (run_tasks := _tasks(cfg)):  # the towers, and what each learned
        diffs.append(f"data.labels: checkpoint {tasks or 'one label'}, run {run_tasks or 'one label'}")
    for key in ("loss._target_", "optimizer.sparse._target_", "optimizer.dense._target_"):
        a, b = OmegaConf.select(saved, key), OmegaConf.select(cfg, key)
        if a != b:
            diffs.append(f"{key}: checkpoint {_short(a)}, run {_short(b)}")
    return diffs


def _tasks(cfg: DictConfig) -> list[str]:
    """The tasks of ``data.labels`` as what a model's towers learned (their weights may change):
    ``name (kind of column[, after parent])`` each."""
    labels = OmegaConf.select(cfg, "data.labels")
    out = []
    listed = cast("list[dict[str, Any]]", OmegaConf.to_container(labels, resolve=True) if labels else [])
    for t in listed:
        kind = getattr(t.get("kind"), "value", t.get("kind")) or "binary"
        after = f", after {t['after']}" if t.get("after") else ""
        out.append(f"{t['name']} ({kind} of {t.get('column') or t['name']}{after})")
    return out


def check_compatible(
    cfg: DictConfig,
    path: str,
    state: TrainState,
    features: list[Any],
    num_dense_features: int,
    data_version: Optional[int] = None,
) -> None:
    """Refuse to resume ``path`` into a run whose model, tables, loss or optimizers differ:
    DCP would fail on the first missing key or shape, inside every rank (checked before
    launch by ``train.py`` and again by ``load``). Raises one ``CheckpointError`` naming
    every difference and the fix. ``data_version``: the run's ``Source.version``; the same
    source of another version draws other rows from the same seed, and is refused too."""
    saved = saved_config(path, run_targets(cfg))
    check_data_version(saved, state, cfg, data_version, path)
    diffs = layout_differences(
        saved, state.features, state.num_dense_features, cfg, [vars(f) for f in features], num_dense_features
    )
    if not diffs:
        return
    if cfg.checkpoint.resume == "auto":
        fix = (
            f"train this config in another checkpoint.dir, or resume with the config it was saved with "
            f"({os.path.join(path, CONFIG_YAML)})"
        )
    else:
        fix = (
            f"resume a checkpoint of this model, or train from scratch with checkpoint.resume=never "
            f"(its config: {os.path.join(path, CONFIG_YAML)})"
        )
    raise CheckpointError(f"checkpoint {path} does not fit this run ({'; '.join(diffs)}): {fix}")


def check_data_version(
    saved: DictConfig, state: TrainState, cfg: DictConfig, version: Optional[int], path: str
) -> None:
    """The rows a resumed run reads next are those the checkpoint's run would have read: a
    generator of another version draws other rows from the same seed and position. A
    checkpoint that records no version and was trained on the same source drew version 1's."""
    target = cfg.data.get("_target_")
    if version is None or OmegaConf.select(saved, "data._target_") != target:
        return
    was = state.data_version if state.data_version is not None else 1
    if was != version:
        raise CheckpointError(
            f"checkpoint {path} was trained on rows of version {was} of {_short(target)}, and this hybridrec "
            f"draws version {version}: the same seed gives other rows, so the run cannot go on where it "
            f"stopped; train anew (another checkpoint.dir, or checkpoint.resume=never)"
        )


def writer_of(path: str) -> Optional[str]:
    """The id of the run that wrote the checkpoint at ``path`` (None: unknown or unreadable)."""
    try:
        with open(os.path.join(path, STATE_JSON)) as f:
            runs = json.load(f).get("runs") or [None]
        return runs[-1]
    except (OSError, ValueError, AttributeError):
        return None


def check_dir(cfg: DictConfig, resume: Optional[str], state: Optional[TrainState]) -> None:
    """Refuse, before launch, a ``checkpoint.dir`` holding checkpoints that this run does not
    continue: its saves would mix with them (and replace any of the same step). With
    ``resume=auto`` the newest one is continued, so the directory is this run's."""
    ck = cfg.checkpoint
    if not ck.dir or ck.resume == "auto":
        return
    ours = set(state.runs) if state else set()
    foreign = [
        (step, path)
        for step, path in committed(ck.dir)
        if os.path.realpath(path) != os.path.realpath(resume or "") and (not ours or writer_of(path) not in ours)
    ]
    if not foreign:
        return
    step, path = foreign[-1]
    why = "checkpoint.resume=never" if resume is None else f"checkpoint.resume={resume} continues another run"
    raise CheckpointError(
        f"checkpoint.dir={ck.dir} holds checkpoints of another run (newest: {os.path.basename(path)}, step {step}) "
        f"and {why}: use another checkpoint.dir, checkpoint.resume=auto to continue the run in it, or delete "
        f"its step_* directories yourself"
    )
