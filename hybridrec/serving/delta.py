"""Deltas: what changed in a model since an export, for a serving fleet that reloads a few
rows rather than a whole table after every partition.

    python -m hybridrec.export checkpoint=<checkpoint> delta=<export dir>

compares the checkpoint's weights with the export's (``model.pt2``, plus the deltas it
already has, in order) and writes ``<export dir>/deltas/delta_<NNNNN>.pt``: the rows of each
embedding table whose values changed (their ids and new values) and every other tensor that
changed, whole (the dense layers: small, and an optimizer step changes all of them). Rows a
partition never looked up are not in it: a day's delta of a large table is the day's ids.

A delta is exact: the export with its deltas applied in order holds the very bytes a full
export of the same checkpoint holds. Each delta names the weights it applies to and the
weights it gives (BLAKE3 over every tensor's name, dtype, shape and bytes), so a delta applied
to another export, out of order, twice or after a damaged one is refused in one line.

The file holds tensors, strings and integers only (``torch.load(weights_only=True)``):

    {"format": 1, "base": <digest>, "result": <digest>, "step": N, "base_step": M,
     "rows": {name: int64 [k]}, "values": {name: [k, dim]}, "dense": {name: tensor}}

``load(export_dir)`` gives the exported program's module with every delta applied; outside
hybridrec the same takes ``torch.export.load(path).module()`` and, per delta, an
``index_copy_`` of ``values[name]`` into the parameter ``name`` at ``rows[name]`` and a
``copy_`` of each ``dense`` tensor.
"""

from __future__ import annotations

import os
import re
from typing import Any, Iterable, Optional

import blake3
import torch
from torch import nn

DELTAS = "deltas"
FORMAT = 1
_NAME = re.compile(r"delta_(\d{5})\.pt")


class DeltaError(ValueError):
    """A delta that cannot be made or applied (one line: the file and why)."""


def digest(state: dict[str, torch.Tensor]) -> str:
    """BLAKE3 of every tensor's name, dtype, shape and bytes, in name order."""
    h = blake3.blake3()
    for name in sorted(state):
        t = state[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, one row per row (1-D: one row)."""
    t = t.detach().contiguous()
    return t.view(torch.uint8).reshape(t.shape[0] if t.dim() > 1 else 1, -1)


def _is_table(name: str, t: torch.Tensor) -> bool:
    """An embedding table (rows of ids): its delta is the changed rows."""
    return t.dim() == 2 and (".embedding_bags." in name or ".embeddings." in name)


def make(base: dict[str, torch.Tensor], new: dict[str, torch.Tensor], step: int, base_step: int) -> dict[str, Any]:
    """The delta that turns ``base`` into ``new`` (same names and shapes)."""
    if base.keys() != new.keys() or any(base[k].shape != new[k].shape or base[k].dtype != new[k].dtype for k in base):
        differ = sorted(set(base) ^ set(new)) or [
            k for k in base if base[k].shape != new[k].shape or base[k].dtype != new[k].dtype
        ]
        raise DeltaError(
            f"the checkpoint's model is not the export's ({differ[0]} differs): a delta updates the "
            f"weights of one model; make a full export instead"
        )
    rows, values, dense = {}, {}, {}
    for name, t in new.items():
        # compared as bytes: a NaN that stayed NaN is unchanged, -0.0 and 0.0 are not the same
        now, was = _bytes(t), _bytes(base[name])
        if _is_table(name, t):
            changed = (now != was).any(dim=1).nonzero().flatten()
            if len(changed):
                rows[name], values[name] = changed.to(torch.int64), t[changed].clone()
        elif not torch.equal(now, was):
            dense[name] = t.clone()
    return {
        "format": FORMAT,
        "base": digest(base),
        "result": digest(new),
        "step": step,
        "base_step": base_step,
        "rows": rows,
        "values": values,
        "dense": dense,
    }


def apply(state: dict[str, torch.Tensor], delta: dict[str, Any], where: str) -> None:
    """Apply ``delta`` (read from ``where``) to ``state`` in place, checking that it was made
    for these weights and that it gives the weights it names."""
    if delta.get("format") != FORMAT:
        raise DeltaError(f"{where}: not a hybridrec delta of format {FORMAT}")
    if digest(state) != delta["base"]:
        raise DeltaError(
            f"{where} was made for other weights (base {delta['base'][:12]}, step {delta['base_step']}) "
            f"than these ({digest(state)[:12]}): apply a delta to the export it was made from, after "
            f"the deltas before it, once each"
        )
    for name, ids in delta["rows"].items():
        state[name].index_copy_(0, ids, delta["values"][name].to(state[name].dtype))
    for name, t in delta["dense"].items():
        state[name].copy_(t)
    if digest(state) != delta["result"]:
        raise DeltaError(f"{where} is damaged: the weights it gives are not those it was made with")


def read(path: str) -> dict[str, Any]:
    try:
        return torch.load(path, weights_only=True)
    except Exception as e:  # a damaged zip, or not a weights-only file: either way not a delta to apply
        raise DeltaError(f"{path} is damaged or not a delta ({str(e).strip().splitlines()[0][:200]})") from None


def deltas_of(export_dir: str) -> list[str]:
    """The deltas of an export, in order (``deltas/delta_NNNNN.pt``)."""
    folder = os.path.join(export_dir, DELTAS)
    if not os.path.isdir(folder):
        return []
    return [os.path.join(folder, n) for n in sorted(os.listdir(folder)) if _NAME.fullmatch(n)]


def _program(export_dir: str) -> Any:
    from hybridrec.serving.exported import PROGRAM, _check_archive

    path = os.path.join(export_dir, PROGRAM)
    if not os.path.isfile(path):
        raise DeltaError(f"{export_dir}: no {PROGRAM} (the base export a delta applies to)")
    _check_archive(path)  # nothing in it is unpickled or run
    return torch.export.load(path)


def exported_state(export_dir: str) -> tuple[dict[str, torch.Tensor], int]:
    """The weights of an export with its deltas applied, and the step they are at."""
    import json

    from hybridrec.serving.exported import SPEC

    program = _program(export_dir)
    state = {k: v.detach().clone() for k, v in program.state_dict.items()}
    with open(os.path.join(export_dir, SPEC)) as f:
        step = int(json.load(f).get("step", 0))
    for path in deltas_of(export_dir):
        d = read(path)
        apply(state, d, path)
        step = d["step"]
    return state, step


def load(export_dir: str) -> nn.Module:
    """The exported program's module with every delta of ``export_dir`` applied, in order."""
    module = _program(export_dir).module()
    state = module.state_dict()  # the module's own tensors: updated in place
    for path in deltas_of(export_dir):
        with torch.no_grad():
            apply(state, read(path), path)
    return module


def write(
    checkpoint: str,
    export_dir: str,
    trusted: Iterable[str] = (),
    allow_unverified: bool = False,
    base: Optional[tuple[dict[str, torch.Tensor], int]] = None,
) -> tuple[str, dict[str, torch.Tensor]]:
    """Write the delta from ``export_dir`` (with its deltas) to ``checkpoint``; returns its path
    and the weights it gives. ``base``: those weights and their step when the caller has them
    (a training run writing a delta per partition), else they are read from ``export_dir``.
    An export with managed ids also gets the checkpoint's ids, whole, beside the delta
    (``managed_ids_NNNNN.parquet``: 16 bytes a row)."""
    import json

    from hybridrec.base.atomic import replace_file
    from hybridrec.checkpoint import TrainState, saved_config
    from hybridrec.models.sequential import SequenceRanker
    from hybridrec.models.two_tower import TwoTower
    from hybridrec.serving.exported import SPEC, Scorer, load_weights_of, write_managed_ids

    with open(os.path.join(export_dir, SPEC)) as f:
        spec = json.load(f)
    if "features" not in spec:
        raise DeltaError(f"{export_dir} is a sequence ranker's export: deltas cover the scoring programs")
    model, features, step = load_weights_of(checkpoint, trusted, allow_unverified)
    if isinstance(model, (SequenceRanker, TwoTower)):
        raise DeltaError(
            f"{checkpoint}: deltas cover the scoring programs of click and ranking models, not "
            f"{type(model).__name__}'s vectors"
        )
    new = Scorer(
        model, [f.name for f in features], model.loss.calibrated, any(f.weighted for f in features)
    ).state_dict()
    before, base_step = base if base is not None else exported_state(export_dir)
    after = {k: v.detach().clone() for k, v in new.items()}
    delta = make(before, after, step, base_step)
    if delta["base"] == delta["result"]:
        raise DeltaError(
            f"{checkpoint} holds the weights of {export_dir} with its deltas (step {base_step}): "
            f"nothing changed, no delta written"
        )
    folder = os.path.join(export_dir, DELTAS)
    if os.path.islink(folder):
        raise DeltaError(f"{folder} is a symbolic link: deltas are written into the export's own directory")
    os.makedirs(folder, exist_ok=True)
    number = len(deltas_of(export_dir)) + 1
    path = os.path.join(folder, f"delta_{number:05d}.pt")
    if os.path.isfile(os.path.join(export_dir, "managed_ids.parquet")):  # the ids first: the delta names them
        from hybridrec.data.raw_inputs import sha256

        ids = f"managed_ids_{number:05d}.parquet"
        write_managed_ids(
            saved_config(checkpoint, trusted), TrainState.from_files(checkpoint, allow_unverified), folder, ids
        )
        delta["managed_ids_sha256"] = sha256(os.path.join(folder, ids))  # checked by hybridrec.serving before use
    replace_file(path, lambda p: torch.save(delta, p))
    return path, after


def describe(delta: dict[str, Any], state: dict[str, torch.Tensor]) -> str:
    tables = (
        ", ".join(
            f"{name.split('.')[-2]} {len(ids):,} of {state[name].shape[0]:,} rows"
            for name, ids in delta["rows"].items()
        )
        or "no table row"
    )
    return f"step {delta['base_step']} -> {delta['step']}: {tables}; {len(delta['dense'])} dense tensors"
