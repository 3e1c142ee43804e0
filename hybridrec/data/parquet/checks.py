"""The rules a ``data=parquet`` config obeys (``ParquetSource.check_config``): each refusal
is a ValueError naming the key, raised before any rank starts."""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from hybridrec.config.schema import DenseTransform, ParquetIdMapping
from hybridrec.config.tasks import check_tasks
from hybridrec.data.numeric import MAX_BUCKETS, SAMPLE, check_knots
from hybridrec.data.parquet.config import _dense_list, _plain, _Sparse, _sparse_list
from hybridrec.data.parquet.device import device_refusal
from hybridrec.data.parquet.partitioned import check_partitions


def check_config(cfg: DictConfig, world_size: int) -> None:
    c = _plain(cfg)
    shards = c.get("shards")
    if shards is not None and (shards < 1 or shards % world_size or c["batch_size"] % shards):
        raise ValueError(
            f"data.shards={shards} must be a multiple of the world size ({world_size}) and divide "
            f"data.batch_size={c['batch_size']}: each rank reads whole shards. Set data.shards to a "
            f"multiple of {world_size} (it changes which rows make a batch), or unset it"
        )
    fraction = c.get("valid_fraction") or 0.0
    if not 0 <= fraction < 1:
        raise ValueError(f"data.valid_fraction must be in [0, 1), got {fraction}")
    if fraction and c.get("valid_path"):
        raise ValueError("data.valid_path and data.valid_fraction are both set: choose one source of validation rows")
    if (parts := c.get("partitions")) is not None:
        check_partitions(parts, fraction, shards)
    managed = [f for f in _sparse_list(c.get("sparse")) if f.id_mapping == ParquetIdMapping.managed.value]
    if managed and parts is None:
        raise ValueError(
            f"data.sparse[{managed[0].index}].id_mapping=managed gives rows partition by partition: "
            f"set data.partitions (a directory of time partitions), or use id_mapping=hash"
        )
    if managed and not (c.get("managed_ids") or {}).get("min_count", 1) >= 1:
        raise ValueError(f"data.managed_ids.min_count must be >= 1, got {c['managed_ids']['min_count']}")
    for f in managed:
        if f.num_embeddings < 2:
            raise ValueError(
                f"data.sparse[{f.index}].num_embeddings={f.num_embeddings}: a managed table needs "
                f"row 0 (ids without a row) and at least one row to give"
            )
    if c.get("device_input") and (
        refusal := device_refusal(
            parts is not None,
            _sparse_list(c.get("sparse")),
            _dense_list(c.get("dense"), c.get("numeric_encoding"), c.get("numeric_buckets", 16)),
        )
    ):
        raise ValueError(f"data.device_input=true: {refusal}; leave data.device_input unset")
    label = c.get("label") or {}
    if c.get("labels"):  # several tasks: their columns, checked against each file's schema when it is opened
        check_tasks(c["labels"])
        label_columns = [t.get("column") or t["name"] for t in c["labels"]]
    elif not label.get("column") or label["column"] == "???":
        raise ValueError("data.label.column is not set: name the label column (or data.labels, one per task)")
    else:
        label_columns = [label["column"]]
    if c.get("weight") is not None and c.get("weight") in ("", *label_columns):
        raise ValueError(f"data.weight={c.get('weight')!r} must name a sample weight column other than the label's")
    buckets = c.get("numeric_buckets", 16)
    if not 2 <= buckets <= MAX_BUCKETS:
        raise ValueError(
            f"data.numeric_buckets must be in [2, {MAX_BUCKETS}] (one bucket says nothing of a number; the "
            f"knots are fitted on at most {SAMPLE:,} values), got {buckets}"
        )
    dense = _dense_list(c.get("dense"), c.get("numeric_encoding") or "scalar", buckets)
    seen: set[tuple[str, str]] = set()
    for i, d in enumerate(dense):
        key = f"data.dense[{i}]"
        if (d.column, d.encoding) in seen:  # a number may enter as a scalar and as ids, not twice alike
            raise ValueError(f"{key}.column={d.column!r} is listed twice in data.dense (encoding={d.encoding})")
        seen.add((d.column, d.encoding))
        given = (d.mean is not None, d.std is not None)
        if d.transform != DenseTransform.standardize.value and any(given):
            raise ValueError(f"{key}: mean and std belong to transform=standardize, not transform={d.transform}")
        if given[0] != given[1]:
            raise ValueError(f"{key}: set both mean and std, or neither (both are then fitted on the train split)")
        if d.std is not None and not d.std > 0:
            raise ValueError(f"{key}.std must be > 0, got {d.std}")
        if not 2 <= d.buckets <= MAX_BUCKETS:
            raise ValueError(f"{key}.buckets must be in [2, {MAX_BUCKETS}], got {d.buckets}")
        if d.knots is not None and (why := check_knots(list(d.knots))):
            raise ValueError(f"{key}.knots={list(d.knots)}: the bucket edges are {why} (or unset: fitted on train)")
    sparse = _sparse_list(c.get("sparse"))
    encoded = [(i, d) for i, d in enumerate(dense) if not d.scalar]
    if not sparse and not encoded:
        raise ValueError("data.sparse lists no feature: give at least one (name, column, num_embeddings)")
    names, sparse_tables = {f.name for f in sparse}, {f.table_name for f in sparse}
    for i, d in encoded:  # an encoded column is a feature with a table of its own: named like one
        used = d.name in names or d.table_name in sparse_tables
        if used or "." in d.name or hasattr(torch.nn.ModuleDict, d.table_name):
            raise ValueError(
                f"data.dense[{i}].name={d.name!r} (encoding={d.encoding}) "
                + ("is used twice (as a feature or its table)" if used else "cannot name a table")
                + ": an encoded column is a sparse feature, whose name is unique and holds no '.'; set another name"
            )
        names.add(d.name)
    names = set()
    tables: dict[str, _Sparse] = {}
    for f in sparse:
        key = f"data.sparse[{f.index}]"
        if not f.name or f.name in names:
            raise ValueError(
                f"{key}.name={f.name!r} is "
                + ("empty" if not f.name else "used twice")
                + ": feature names are the batch's keys and must be unique"
            )
        names.add(f.name)
        if f.num_embeddings < 1:
            raise ValueError(f"{key}.num_embeddings must be >= 1, got {f.num_embeddings}")
        if f.max_length is not None and f.max_length < 1:
            raise ValueError(f"{key}.max_length must be >= 1 (or unset: any length), got {f.max_length}")
        if f.truncate and f.max_length is None:
            raise ValueError(f"{key}.truncate=true cuts lists to max_length: set {key}.max_length")
        if (f.id_mapping == ParquetIdMapping.vocabulary.value) != bool(f.vocabulary):
            raise ValueError(
                f"{key}: id_mapping=vocabulary and a vocabulary file go together "
                f"(id_mapping={f.id_mapping}, vocabulary={f.vocabulary})"
            )
        if f.weights_column is not None and f.weights_column in ("", f.column):
            raise ValueError(f"{key}.weights_column={f.weights_column!r} must name a column other than its ids'")
        if f.table is not None and (not f.table or "." in f.table or hasattr(torch.nn.ModuleDict, f.table)):
            # TorchRec keeps the tables in an nn.ModuleDict keyed by name, which refuses these
            raise ValueError(
                f"{key}.table={f.table!r} cannot name a table: "
                + (
                    "leave it unset for a table of its own"
                    if not f.table
                    else "a name holds no '.'"
                    if "." in f.table
                    else "it is an attribute of torch's ModuleDict, which holds the tables"
                )
                + "; choose another name"
            )
        other = tables.setdefault(f.table_name, f)
        for attr in ("num_embeddings", "pooling", "id_mapping", "vocabulary"):
            if getattr(other, attr) != getattr(f, attr):
                raise ValueError(
                    f"data.sparse: {other.name} and {f.name} share table {f.table_name} but differ in {attr} "
                    f"({getattr(other, attr)} vs {getattr(f, attr)}): features of one table must agree on "
                    f"num_embeddings, pooling, id_mapping and vocabulary"
                )
