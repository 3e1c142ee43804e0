"""Export a checkpoint as one unsharded state dict for inference:

    python -m hybridrec.export checkpoint=<checkpoint dir> [out=<file>]

Rebuilds the plain (non-distributed) model from the checkpoint's own config and feature
list, lets torch.distributed.checkpoint load every sharded tensor into its full form (no
process group needed), and saves ``model.state_dict()`` with torch.save (default:
``<checkpoint>/model.pt``). Load it with ``load_model(checkpoint)`` +
``load_state_dict(torch.load(file, weights_only=True))``: it holds tensors only. For a
two-tower model it also writes ``item_vectors.pt`` beside it (tensors only too): every
catalogue item's id and item-tower vector (needs the run's data, to build the item
features), ready for a nearest-neighbour index.

A checkpoint whose hybridrec state holds pickled objects is refused, never loaded
(``checkpoint.TrainState``).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from torch import nn

from hybridrec import models
from hybridrec.checkpoint import CheckpointError, TrainState, check_complete
from hybridrec.data import SparseFeature, build_source


def load_model(checkpoint: str) -> nn.Module:
    """The checkpoint's model, unsharded, on CPU, uninitialized."""
    cfg = OmegaConf.load(os.path.join(checkpoint, "config.yaml"))
    state = TrainState.from_files(checkpoint)
    model = models.build_model(cfg, [SparseFeature(**f) for f in state.features], state.num_dense_features)
    model.sparse_module().to_empty(device="cpu")  # the tables were created on `meta`
    return model


def export(checkpoint: str, out: str) -> nn.Module:
    model = load_model(checkpoint)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=checkpoint, no_dist=True)  # one process: loads full tensors
    model.load_state_dict(state["model"])
    _save(model.state_dict(), out)
    if hasattr(model, "item_vectors"):  # two-tower: the item side of nearest-neighbour search
        cfg = OmegaConf.load(os.path.join(checkpoint, "config.yaml"))
        items, batch = build_source(cfg.data, cfg.seed).catalogue_batch()
        model.eval()
        with torch.no_grad():
            vectors = model.item_vectors(batch)
        path = os.path.join(os.path.dirname(out), "item_vectors.pt")
        _save({"item_ids": torch.from_numpy(items), "vectors": vectors}, path)
        print(f"hybridrec.export: {len(items):,} item vectors of width {vectors.shape[1]} -> {path}")
    return model


def _save(obj: object, path: str) -> None:
    try:
        torch.save(obj, path)
    except (OSError, RuntimeError) as e:  # torch's file writer reports open and write failures as RuntimeError
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise OSError(f"{path}: {reason}") from e


def main(argv: list[str]) -> None:
    args = dict(a.split("=", 1) for a in argv if "=" in a)
    unknown = set(args) - {"checkpoint", "out"} or [a for a in argv if "=" not in a]
    if "checkpoint" not in args or unknown:
        sys.exit(f"usage: python -m hybridrec.export checkpoint=<dir> [out=<file>] (unknown: {sorted(unknown)})")
    ckpt = args["checkpoint"]
    out = args.get("out", os.path.join(ckpt, "model.pt"))
    # Checked before anything is loaded: each failure is one line naming the file.
    try:
        check_complete(ckpt)
        if not os.path.isfile(os.path.join(ckpt, "config.yaml")):
            raise CheckpointError(f"{ckpt} is not a complete checkpoint (no config.yaml)")
    except CheckpointError as e:
        sys.exit(f"hybridrec.export: {e}")
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        sys.exit(f"hybridrec.export: out={out}: {folder} is not a writable directory")
    try:
        model = export(ckpt, out)
    except CheckpointError as e:
        sys.exit(f"hybridrec.export: {e}")
    except OSError as e:  # disk full, a directory named like the file
        sys.exit(f"hybridrec.export: cannot write {e}")
    print(f"hybridrec.export: {sum(p.numel() for p in model.parameters()):,} parameters -> {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
