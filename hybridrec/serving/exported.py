"""What an export is made of, shared by ``hybridrec.export`` (whole exports) and
``hybridrec.serving.delta`` (what changed since one): the checkpoint's model with its weights, the
module the program traces (``Scorer``), the check that an archive holds nothing to unpickle
or run, the managed ids' file, and files written whole."""

from __future__ import annotations

import io
import json
import os
import pickle
import warnings
import zipfile
from typing import Any, Iterable, Optional

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from hybridrec.base.atomic import replace_file
from hybridrec.checkpoint import CheckpointError, TrainState, refusal, root_cause, safe_load, saved_config
from hybridrec.config.schema import ParquetIdMapping
from hybridrec.data import RecBatch, SparseFeature, build_source
from hybridrec.data.raw_inputs import MANAGED_FILE
from hybridrec.models import Ranker, build_model

PROGRAM, SPEC = "model.pt2", "model.json"


def load_model(checkpoint: str, trusted: Iterable[str] = (), allow_unverified: bool = False) -> Ranker:
    """The checkpoint's model, unsharded, on CPU, uninitialized. Its config is read as
    evaluate and resume read it (``checkpoint.saved_config``): nothing in it runs code."""
    cfg = saved_config(checkpoint, trusted)
    state = TrainState.from_files(checkpoint, allow_unverified)
    model = build_model(cfg, [SparseFeature(**f) for f in state.features], state.num_dense_features)
    model.sparse_module().to_empty(device="cpu")  # the tables were created on `meta`
    return model


class Scorer(nn.Module):
    """A model behind plain tensors: what ``model.pt2`` holds.

    ``forward(dense, values, lengths[, weights])``: ``dense`` float32
    ``[B, num_dense_features]``; ``values`` int64, every id of the batch, feature-major
    (feature 0's ids for rows 0..B-1, then feature 1's, ...: TorchRec's KeyedJaggedTensor
    order); ``lengths`` int32 ``[num_features * B]``, ``lengths[f * B + i]`` = the ids of
    feature f in row i; ``weights`` float32, one per value, exactly when ``weighted`` (a
    feature is weighted; the others' ids weigh 1.0). Returns ``[B]`` float32:
    sigmoid(logit), a click probability, when the loss is calibrated (``Loss.calibrated``:
    loss=pointwise); the raw score otherwise (a ranking objective's score orders rows and is
    not a probability). A multi-task model (``hybridrec.models.multitask``) returns ``[B, T]``,
    column t task t's: a binary task's probability, a regression task's value, an ordinal task's expected grade."""

    def __init__(self, model: Ranker, keys: list[str], calibrated: bool, weighted: bool = False) -> None:
        super().__init__()
        self.model, self.keys, self.calibrated, self.weighted = model, list(keys), calibrated, weighted

    def forward(
        self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor, weights: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        sparse = KeyedJaggedTensor(
            keys=self.keys, values=values, lengths=lengths, weights=weights if self.weighted else None
        )
        logits = self.model.score(
            RecBatch(dense_features=dense, sparse_features=sparse, labels=dense.new_zeros(dense.shape[0]))
        )
        tasks = getattr(self.model, "tasks", None)
        if tasks:  # a multi-task model: [B, T], a binary task's probability, a regression task's value
            return torch.cat(
                [
                    torch.sigmoid(logits[:, t : t + 1]) if task.kind == "binary" else logits[:, t : t + 1]
                    for t, task in enumerate(tasks)
                ],
                dim=1,
            )
        return torch.sigmoid(logits) if self.calibrated else logits


def load_weights_of(
    checkpoint: str, trusted: Iterable[str] = (), allow_unverified: bool = False
) -> tuple[Ranker, list[SparseFeature], int]:
    """The checkpoint's model with its weights, unsharded, on CPU, in eval mode; its features
    and its step."""
    model = load_model(checkpoint, trusted, allow_unverified)
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # DCP notes that it loads in one process: what no_dist asks for
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            safe_load(state, checkpoint, no_dist=True)  # one process: loads full tensors
        except CheckpointException as e:  # DCP wraps what the safe reader or its own weights_only read refused
            if isinstance(cause := root_cause(e), (CheckpointError, pickle.UnpicklingError)):
                raise refusal(cause, f"a .distcp file of {checkpoint}") from None
            raise
    model.load_state_dict(state["model"])
    model.eval()
    train_state = TrainState.from_files(checkpoint, allow_unverified)
    return model, [SparseFeature(**f) for f in train_state.features], train_state.step


def write_managed_ids(cfg: Any, state: TrainState, out: str, name: str = MANAGED_FILE) -> Optional[dict[str, Any]]:
    """For a model with managed ids (``hybridrec.data.parquet.managed``): ``managed_ids.parquet``,
    the rows its ids had in the last partition it trained on (columns table, key, row), made
    again from the run's partitions (the checkpoint names them). None without managed ids."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hybridrec.data.parquet.partitions import list_partitions

    if not any(
        getattr(m := f.get("id_mapping"), "value", m) == ParquetIdMapping.managed.value
        for f in cfg.data.get("sparse") or []
    ):
        return None
    # the last partition the checkpoint's steps trained on (the step's position in the ledger)
    done, last = 0, None
    for i, p in enumerate(state.stream.get("partitions", [])):
        if p["batches"] and done < state.step:
            last = i
        done += p["batches"]
    if last is None:
        raise CheckpointError("the checkpoint records no partition trained on: its managed ids have no rows to export")
    source = build_source(cfg.data, cfg.seed)
    listed = {
        p.name: p
        for p in list_partitions(
            source.train_root, source.partitioning["pattern"], source.partitioning.get("ready_marker")
        )
    }
    names = [p["name"] for p in state.stream["partitions"]]
    if missing := [n for n in names if n not in listed]:
        raise CheckpointError(
            f"partition {missing[0]} of {source.train_root}, which the checkpoint trained on, is "
            f"gone: the managed ids' rows are made from the partitions"
        )
    source.set_partitions([listed[n] for n in names])
    tables, keys, rows = [], [], []
    for table in source.managed.tables:
        v = source.managed.version(table, last)
        tables += [table] * len(v.keys)
        keys.append(v.keys)
        rows.append(v.rows)
    path = os.path.join(out, name)
    data = pa.table(
        {
            "table": pa.array(tables, pa.string()),
            "key": pa.array(np.concatenate(keys), pa.uint64()),
            "row": pa.array(np.concatenate(rows), pa.int64()),
        }
    )
    _write(path, lambda p: pq.write_table(data, p))
    return {
        "file": name,
        "partition": names[last],
        "key": f"the id's 64-bit key (hybridrec.data.parquet.hash_ints / hash_strings, "
        f"data.hash_seed={source.hash_seed}); a key not in the file reads row 0",
        "rows_used": {t: int(n) for t, n in zip(*np.unique(np.array(tables), return_counts=True))},
    }


def _check_archive(path: str) -> None:
    """Refuse to leave a ``model.pt2`` behind that loading would have to unpickle or run:
    torch.export writes plain tensors as raw bytes, but tensor subclasses and script objects
    as pickles, and AOTInductor code as a library; this model must have none of them."""
    from torch.export.pt2_archive.constants import AOTINDUCTOR_DIR, SAMPLE_INPUTS_DIR

    with zipfile.ZipFile(path) as archive:
        for name in archive.namelist():
            inner = name.split("/", 1)[-1]  # below the archive's root folder
            if inner.startswith(AOTINDUCTOR_DIR):
                raise RuntimeError(f"{path}: holds compiled code ({name})")
            if inner.endswith("_config.json"):  # the weights' and constants' payload configs
                for key, payload in json.loads(archive.read(name))["config"].items():
                    if payload.get("use_pickle") or payload.get("tensor_meta") is None:
                        raise RuntimeError(f"{path}: {key} is stored as a pickled object")
            if inner.startswith(SAMPLE_INPUTS_DIR):  # torch.export.load falls back to a full unpickle
                torch.load(io.BytesIO(archive.read(name)), weights_only=True)


def _write_text(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text + "\n")


def _write(path: str, write: Any) -> None:
    """``write(p)`` into a new file beside ``path``, then renamed over it: a reader never sees
    half a file, and a file (or a symbolic link) planted at ``path`` is replaced, never
    written through."""
    try:
        replace_file(path, write)
    except (OSError, RuntimeError) as e:  # torch's file writer reports open and write failures as RuntimeError
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise OSError(f"{path}: {reason}") from e
