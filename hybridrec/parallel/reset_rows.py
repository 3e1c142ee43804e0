"""Rows of embedding tables set back to how the table started: the values ``init_embeddings``
gave them (the same seeded draw, so any plan and world size gets the same rows) and the
optimizer state of a row never updated (zero; Adagrad's ``initial_accumulator_value`` for
its sum). Managed ids use it when a row an evicted id held is given to a new id
(``data.managed_ids.reset``), as TorchRec's managed-collision modules reset an evicted row.

Why by hand: TorchRec's reset is part of its managed-collision modules (their sharded
lookup calls FBGEMM's ``reset_embedding_weight_momentum`` on the rows its own remapper
evicted, batch by batch); hybridrec's managed ids are remapped per partition, outside the
model, so the rows are known before the partition is read and are written here through the
tables' and the optimizers' local shards, which alias the kernels' storage, for every kind
of shard (row-, column-, table-wise, data-parallel, 2D replicas).

May import: base, config, parallel.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from hybridrec.parallel.optim import TrainOptimizer
from hybridrec.parallel.parallelize import _INIT_BLOCK, local_shards, table_blocks


@torch.no_grad()
def reset_rows(sparse_module: nn.Module, optimizer: TrainOptimizer, seed: int, rows: dict[str, np.ndarray]) -> int:
    """Set ``rows[table]`` (global row indices) of each table back to their initial values
    and their optimizer state to a fresh one, in this rank's shards. Every rank calls it with
    the same ``rows``; no collective. Returns the number of (table, row) pairs this rank
    holds a part of."""
    rows = {t: np.unique(np.asarray(r, np.int64)) for t, r in rows.items() if len(r)}
    if not rows:
        return 0
    touched = 0
    spans: dict[str, list[tuple[int, int]]] = {}  # per table, this rank's shards' (first row, rows)
    for key, weight in sparse_module.state_dict().items():
        table = key.split(".")[-2]
        if table not in rows:
            continue
        total, dim = weight.size()
        for (row0, col0), local in local_shards(weight):
            spans.setdefault(table, []).append((row0, local.size(0)))
            row1, col1 = row0 + local.size(0), col0 + local.size(1)
            mine = rows[table][(rows[table] >= row0) & (rows[table] < row1)]
            touched += len(mine)
            for block in np.unique(mine // _INIT_BLOCK):
                lo, hi = max(row0, int(block) * _INIT_BLOCK), min(row1, (int(block) + 1) * _INIT_BLOCK)
                values = torch.empty(hi - lo, col1 - col0)
                for r, c, part in table_blocks(seed, table, total, dim, lo, hi, col0, col1):
                    values[r : r + part.size(0), c : c + part.size(1)] = part
                at = mine[(mine >= lo) & (mine < hi)]
                index = torch.from_numpy(at - row0).to(local.device)
                local[index] = values[torch.from_numpy(at - lo)].to(local.device, local.dtype)
    for name, opt in optimizer.optimizer.optimizers:
        _reset_state(opt, rows, spans, fused=name == "sparse")
    return touched


def _reset_state(opt: Any, rows: dict[str, np.ndarray], spans: dict[str, list[tuple[int, int]]], fused: bool) -> None:
    """The optimizer state of ``rows``. Fused optimizers name each state ``<table>.<state>``,
    one local shard per shard of the table, in the same order: the k-th holds the rows of the
    table's k-th (its offsets do not say which: a column-wise table's row-wise state stacks
    its column shards). A data-parallel table's plain optimizer keys it by the parameter,
    named ``...<table>.weight``, whole."""
    names = {id(p): n for n, p in getattr(opt, "params", {}).items()}
    initial = opt.param_groups[0].get("initial_accumulator_value", 0.0) if opt.param_groups else 0.0
    for param, state in opt.state.items():
        owner = names.get(id(param), "").split(".")
        for state_name, value in state.items():
            table = state_name.split(".")[0] if fused else (owner[-2] if len(owner) > 1 else "")
            if table not in rows or not isinstance(value, torch.Tensor) or value.dim() == 0:
                continue  # another table's, or a step counter
            fill = initial if state_name.split(".")[-1] == "sum" else 0.0
            shards = [local for _, local in local_shards(value)]
            for local, (row0, n) in zip(shards, spans[table]) if fused else [(shards[0], (0, value.size(0)))]:
                if local.size(0) != n:
                    raise RuntimeError(f"{state_name}: a state shard of {local.size(0)} rows for a table shard of {n}")
                mine = rows[table][(rows[table] >= row0) & (rows[table] < row0 + n)]
                local[torch.from_numpy(mine - row0).to(local.device)] = fill
