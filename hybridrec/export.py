"""Export a checkpoint as one unsharded state dict for inference:

    python -m hybridrec.export checkpoint=<checkpoint dir> [out=<file>]

Rebuilds the plain (non-distributed) model from the checkpoint's own config and feature
list, lets torch.distributed.checkpoint load every sharded tensor into its full form (no
process group needed), and saves ``model.state_dict()`` with torch.save (default:
``<checkpoint>/model.pt``). Load it with ``build_model(checkpoint)`` +
``load_state_dict(torch.load(file))``.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed.checkpoint as dcp
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch import nn

from hybridrec.data import SparseFeature


def build_model(checkpoint: str) -> nn.Module:
    """The checkpoint's model, unsharded, on CPU, uninitialized."""
    cfg = OmegaConf.load(os.path.join(checkpoint, "config.yaml"))
    state = torch.load(os.path.join(checkpoint, "trainer_state.pt"), weights_only=False)
    model = instantiate(
        cfg.model,
        features=[SparseFeature(**f) for f in state["features"]],
        num_dense_features=state["num_dense_features"],
    )
    model.sparse_module().to_empty(device="cpu")  # the tables were created on `meta`
    return model


def export(checkpoint: str, out: str) -> nn.Module:
    model = build_model(checkpoint)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=checkpoint, no_dist=True)  # one process: loads full tensors
    model.load_state_dict(state["model"])
    torch.save(model.state_dict(), out)
    return model


def main(argv: list[str]) -> None:
    args = dict(a.split("=", 1) for a in argv if "=" in a)
    unknown = set(args) - {"checkpoint", "out"} or [a for a in argv if "=" not in a]
    if "checkpoint" not in args or unknown:
        sys.exit(f"usage: python -m hybridrec.export checkpoint=<dir> [out=<file>] (unknown: {sorted(unknown)})")
    ckpt = args["checkpoint"]
    if not os.path.isfile(os.path.join(ckpt, ".metadata")):
        sys.exit(f"hybridrec.export: {ckpt} is not a complete checkpoint (no .metadata)")
    out = args.get("out", os.path.join(ckpt, "model.pt"))
    model = export(ckpt, out)
    print(f"hybridrec.export: {sum(p.numel() for p in model.parameters()):,} parameters -> {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
