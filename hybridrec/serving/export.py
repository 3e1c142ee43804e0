"""Export a checkpoint for inference outside hybridrec:

    python -m hybridrec.export checkpoint=<checkpoint> [out=<dir>]
    python -m hybridrec.export checkpoint=<later checkpoint> delta=<export dir>

``checkpoint`` is a ``step_<N>`` directory, or a run's ``checkpoint.dir``, which stands for
its newest loadable checkpoint. Writes into ``out`` (default ``<checkpoint>/export``):

- ``model.pt2``: the model as a ``torch.export`` program over plain tensors,
  ``program(dense, values, lengths) -> scores``, and ``program(dense, values, lengths,
  weights)`` when a feature is weighted (``Scorer``), loaded with
  ``torch.export.load(path).module()``: neither hybridrec nor TorchRec is needed to run it
  (the graph holds aten operators only).
- ``model.json``: what the program takes and returns: the input layout, the sparse
  features in input order with their tables, sizes, pooling and weighting, the number of
  dense features, and whether the output is a probability.
- ``preprocessing.json`` (named by ``model.json``'s ``preprocessing``): how a raw row, as the
  training data holds it, becomes the program's inputs: per dense feature its column and
  steps (log1p, clamp, the fitted standardize mean and std), per sparse feature its column,
  list layout, weights column and id mapping (hash function and seed, vocabulary, managed
  ids), and the inputs' order. Data only; the files it names travel in the export with their
  sha256 (vocabularies, MovieLens' user and item side tables). ``hybridrec.serving``
  applies it from the export directory alone: ``program(*Preprocessor.load(out)(rows))``,
  rows being a pyarrow Table, a Parquet file or ``{column: values}``.
- two-tower models: ``item_vectors.pt`` (every catalogue item's id and item-tower vector)
  and ``user_vectors.pt`` (every user of the data's ratings), tensors only
  (``torch.load(path, weights_only=True)``), for a nearest-neighbour index. They need the
  run's data, to build the features.

``python -m hybridrec.export checkpoint=<later checkpoint> delta=<export dir>`` writes only
what changed since that export (``hybridrec.serving.delta``): the changed rows of each table and the
dense tensors, which the export plus its deltas turns into exactly the later weights.

Why ``torch.export``: it traces TorchRec's EmbeddingBagCollection, KeyedJaggedTensor
included, into aten ``embedding_bag`` calls (tested for every model), so the file runs
with torch alone, at any batch size, and stores the weights as raw tensor bytes beside a
JSON graph: no pickled code (checked after writing, ``_check_archive``). A TorchScript
file or a state dict + module would need hybridrec's (or TorchRec's) code to load.

The model is rebuilt from the checkpoint's own config and feature list, and
torch.distributed.checkpoint loads every sharded tensor into its full form (no process
group needed). A checkpoint whose hybridrec state holds pickled objects is refused, never
loaded (``checkpoint.TrainState``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Any, Iterable, Optional, Sequence

import pyarrow.parquet as pq
import torch

from hybridrec.base.compat import size_oblivious_export
from hybridrec.checkpoint import CheckpointError, TrainState, saved_config
from hybridrec.config.tasks import Task
from hybridrec.data import DataError, SparseFeature, build_source
from hybridrec.data.raw_inputs import FORMAT
from hybridrec.data.source import Source, UserItemSource
from hybridrec.models import Ranker
from hybridrec.models.sequential import SequenceRanker
from hybridrec.models.two_tower import TwoTower
from hybridrec.serving.export_sequences import write_user_encoder
from hybridrec.serving.exported import (  # noqa: F401  (load_model, Scorer, _check_archive: this module's names too)
    PROGRAM,
    SPEC,
    Scorer,
    _check_archive,
    _write,
    _write_text,
    load_model,
    load_weights_of,
    write_managed_ids,
)
from hybridrec.serving.preprocess import PREPROCESSING, sha256


def export_program(
    model: Ranker, features: list[SparseFeature], num_dense_features: int
) -> torch.export.ExportedProgram:
    """``Scorer(model)`` traced by ``torch.export`` for any batch size and number of ids."""
    weighted = any(f.weighted for f in features)
    scorer = Scorer(model, [f.name for f in features], model.loss.calibrated, weighted).eval()
    rows = 2  # any example works: the batch dimension is exported as dynamic
    example: tuple[torch.Tensor, ...] = (
        torch.zeros(rows, num_dense_features),
        torch.zeros(rows * len(features), dtype=torch.int64),
        torch.ones(rows * len(features), dtype=torch.int32),
    )
    batch, ids = torch.export.Dim("batch"), torch.export.Dim("ids")
    shapes: tuple = ({0: batch}, {0: ids}, {0: batch * len(features)})
    if weighted:  # the weights are an input only of a weighted model: an unweighted one keeps its three
        example, shapes = (*example, torch.ones(rows * len(features))), (*shapes, {0: ids})
    with torch.no_grad(), size_oblivious_export():
        # non-strict: TorchRec's KeyedJaggedTensor is traced as the Python it is
        return torch.export.export(scorer, example, dynamic_shapes=shapes, strict=False)


def export(checkpoint: str, out: str, trusted: Iterable[str] = (), allow_unverified: bool = False) -> dict[str, Any]:
    """Write ``out``'s files (see the module docstring); returns ``model.json``'s content."""
    model, features, _ = load_weights_of(checkpoint, trusted, allow_unverified)
    train_state = TrainState.from_files(checkpoint, allow_unverified)
    os.makedirs(out, exist_ok=True)
    cfg = saved_config(checkpoint, trusted)
    about = {
        "model": cfg.model._target_,
        "loss": cfg.loss._target_,
        "checkpoint": os.path.abspath(checkpoint),
        "step": train_state.step,
    }
    if isinstance(model, SequenceRanker):  # retrieval: a user encoder and the item vectors
        spec = write_user_encoder(model, out, about, _write)
        _check_archive(os.path.join(out, PROGRAM))
        _write(os.path.join(out, SPEC), lambda path: _write_text(path, json.dumps(spec, indent=1)))
        return spec
    spec = write_program(model, features, train_state.num_dense_features, out, about)
    if managed := write_managed_ids(cfg, train_state, out):
        spec["managed_ids"] = managed
    try:
        data = build_source(cfg.data, cfg.seed)
    except DataError as e:  # the preprocessing is read from the training data's config and files
        raise CheckpointError(
            f"the training data (config.yaml's data) cannot be read to describe its preprocessing: {e}"
        ) from None
    if write_preprocessing(data, any(f.weighted for f in features), out):
        spec["preprocessing"] = PREPROCESSING
    else:
        spec["preprocessing"] = None
        spec["preprocessing_missing"] = (
            f"data={type(data).__name__} does not describe its raw rows: its inputs "
            f"are the rows the source reads (model.json's inputs)"
        )
    _write(os.path.join(out, SPEC), lambda path: _write_text(path, json.dumps(spec, indent=1)))
    if isinstance(model, TwoTower):
        if not isinstance(data, UserItemSource):  # training refused it (TwoTower.needs_user_item_features)
            raise CheckpointError(
                f"{checkpoint}: data={type(data).__name__} has no users and items to export vectors of"
            )
        for side, (ids, batch), vectors_of in (
            ("item", data.catalogue_batch(), model.item_vectors),
            ("user", data.user_batch(), model.user_vectors),
        ):
            vectors = vectors_of(batch)
            path = os.path.join(out, f"{side}_vectors.pt")
            _write(path, lambda p: torch.save({f"{side}_ids": torch.from_numpy(ids), "vectors": vectors}, p))
            print(f"hybridrec.export: {len(ids):,} {side} vectors of width {vectors.shape[1]} -> {path}")
    return spec


def write_program(
    model: Ranker, features: list[SparseFeature], num_dense_features: int, out: str, about: dict[str, Any]
) -> dict[str, Any]:
    """``model.pt2`` and ``model.json`` (with ``about``: where the model comes from) in the
    directory ``out``; returns ``model.json``'s content."""
    _write(
        os.path.join(out, PROGRAM),
        lambda path: torch.export.save(export_program(model, features, num_dense_features), path),
    )
    _check_archive(os.path.join(out, PROGRAM))
    spec = {**program_spec(features, num_dense_features, model.loss.calibrated, getattr(model, "tasks", ())), **about}
    _write(os.path.join(out, SPEC), lambda path: _write_text(path, json.dumps(spec, indent=1)))
    return spec


def write_preprocessing(source: Source, weighted: bool, out: str) -> Optional[dict[str, Any]]:
    """``preprocessing.json`` and the files it names, from ``source.raw_inputs()``; returns its
    content, or None when the source does not describe its raw rows.

    A sidecar rather than more keys of ``model.json``: ``model.json`` is the program's tensor
    contract, which a delta leaves as it is, while this is the raw rows' contract, which
    brings files with it (each with its sha256, checked by ``hybridrec.serving`` before use)."""
    raw = source.raw_inputs()
    if raw is None:
        return None
    for name, path in raw.copies.items():
        _write(os.path.join(out, name), lambda p, path=path: shutil.copyfile(path, p))
    for name, table in raw.tables.items():
        _write(os.path.join(out, name), lambda p, table=table: pq.write_table(table, p))
    spec = {
        "format": FORMAT,
        "doc": "how a raw row becomes the inputs of model.pt2 (hybridrec.data.raw_inputs describes every step and "
        "mapping; hybridrec.serving.Preprocessor applies them)",
        "rows": raw.doc,
        "program_inputs": ["dense", "values", "lengths"] + (["weights"] if weighted else []),
        "dense": raw.dense,
        "sparse": raw.sparse,
        "joins": raw.joins,
        # every file the description reads, each with its sha256 (the managed ids included:
        # hybridrec.serving refuses a description that reads a file it does not list)
        "files": {
            name: sha256(os.path.join(out, name))
            for name in dict.fromkeys(
                [*raw.copies, *raw.tables, *(f["ids"]["file"] for f in raw.sparse if "file" in f["ids"])]
            )
        },
    }
    _write(os.path.join(out, PREPROCESSING), lambda path: _write_text(path, json.dumps(spec, indent=1)))
    return spec


def program_spec(
    features: list[SparseFeature], num_dense_features: int, calibrated: bool, tasks: Sequence[Task] = ()
) -> dict[str, Any]:
    """``model.json``: how to call ``model.pt2`` without hybridrec (``tasks``: a multi-task
    model's, whose output has a column per task)."""
    inputs = {
        "dense": {
            "dtype": "float32",
            "shape": ["B", num_dense_features],
            "doc": "dense features, preprocessed as the data source feeds them to the model",
        },
        "values": {
            "dtype": "int64",
            "shape": ["sum(lengths)"],
            "doc": "every id of the batch, feature-major (KeyedJaggedTensor order): feature 0's ids "
            "for rows 0..B-1, then feature 1's, ...; each id a row of that feature's table",
        },
        "lengths": {
            "dtype": "int32",
            "shape": [f"{len(features)} * B"],
            "doc": "lengths[f * B + i] = number of ids of feature f in row i (pooled as the feature's pooling says)",
        },
    }
    if any(f.weighted for f in features):
        inputs["weights"] = {
            "dtype": "float32",
            "shape": ["sum(lengths)"],
            "doc": "the weight of each id of values, in its order; 1.0 for the ids of features that are not weighted",
        }
    spec: dict[str, Any] = {
        "program": PROGRAM,
        "load": "torch.export.load(path).module()",
        "inputs": inputs,
        "input_order": list(inputs),  # the program's positional arguments
        "features": [
            {
                "name": f.name,
                "num_embeddings": f.num_embeddings,
                "table": f.table_name,
                "pooling": f.pooling,
                "weighted": f.weighted,
            }
            for f in features
        ],
        "num_dense_features": num_dense_features,
        "output": "probability" if calibrated else "score",
        "output_doc": (
            "[B] float32: sigmoid of the logit, a click probability (the loss is calibrated)"
            if calibrated
            else "[B] float32: the raw score of a ranking objective; it orders rows, it is not a probability"
        ),
    }
    if tasks:
        spec["output"] = "tasks"
        spec["output_doc"] = (
            f"[B, {len(tasks)}] float32: column t is task t's (tasks, in order): a binary task's probability "
            "(a task after another: the probability of both), a regression task's value, an ordinal task's expected grade"
        )
        spec["tasks"] = [
            {
                "name": t.name,
                "kind": t.kind,
                "output": "probability" if t.kind == "binary" else "value",
                "after": t.after,
            }
            for t in tasks
        ]
    return spec


class _KJTTracingNotice(logging.Filter):
    """TorchRec logs, on the root logger, that tracing KeyedJaggedTensor.to_dict without
    torch.compile's strict mode is slow: it is, once per export (seconds), never when the
    exported program runs."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "non-strict torch.export KJT" not in str(record.msg)


def _quiet_tracing() -> None:
    logging.getLogger().addFilter(_KJTTracingNotice())
    # torch notes, once per process, that is_fx_tracing is also true under torch.export
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
