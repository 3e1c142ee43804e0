"""Entry point: ``python -m hybridrec.export checkpoint=<dir> [out=<dir> | delta=<export dir>]``.

The checkpoint is checked before anything is loaded; each failure is one line naming the
file. What an export holds and how it is written: ``hybridrec.serving.export``."""

from __future__ import annotations

import os
import sys

from hybridrec.checkpoint import CheckpointError, check_checkpoint, resolve_checkpoint
from hybridrec.serving import delta
from hybridrec.serving import export as writer
from hybridrec.serving.export import PREPROCESSING, PROGRAM, SPEC, _quiet_tracing, export


def check_export_dir(checkpoint: str, out: str) -> None:
    """The default ``out``, ``<checkpoint>/export``, is a directory of the checkpoint's own:
    a symbolic link planted there (to another model's export, or anywhere) is refused, so
    an export never writes outside the directories the user named."""
    if os.path.islink(out):
        raise CheckpointError(
            f"{out} is a symbolic link (to {os.path.realpath(out)}): the export is written into the "
            f"checkpoint's own export directory, never through a link; remove the link, or give "
            f"out=<dir> to write elsewhere"
        )


USAGE = (
    "usage: python -m hybridrec.export checkpoint=<dir> [out=<dir> | delta=<export dir>] "
    "[overwrite=true] [trusted_targets=<class>,...] [allow_unverified=true]"
)


def check_out(out: str, overwrite: bool) -> None:
    """``out`` is a new or empty directory, or an export that ``overwrite`` replaces: an
    export never writes among files of something else (a run's outputs, a source tree)."""
    if os.path.lexists(out) and not os.path.isdir(out):
        raise CheckpointError(f"out={out} is a file: give a directory (a new one, or an export to replace)")
    entries = os.listdir(out) if os.path.isdir(out) else []
    if not entries:
        return
    if not os.path.isfile(os.path.join(out, SPEC)):
        raise CheckpointError(
            f"out={out} holds {len(entries)} entries and no export ({SPEC}): give a new or empty directory"
        )
    if not overwrite:
        raise CheckpointError(f"out={out} holds an export already: overwrite=true replaces it, or give another out")


def main(argv: list[str]) -> None:
    if any(a in ("-h", "--help") for a in argv):
        print(f"{USAGE}\n\n{writer.__doc__.strip()}")
        return
    args = dict(a.split("=", 1) for a in argv if "=" in a)
    unknown = set(args) - {"checkpoint", "out", "trusted_targets", "allow_unverified", "delta", "overwrite"} or [
        a for a in argv if "=" not in a
    ]
    if "checkpoint" not in args or unknown or ("delta" in args and "out" in args):
        sys.exit(f"{USAGE} (unknown: {sorted(unknown)}; --help says more)")
    # Classes of the user's own that the checkpoint's config may name (never read from it).
    trusted = [t for t in args.get("trusted_targets", "").strip("[]").split(",") if t]
    allow = args.get("allow_unverified", "false").lower()
    if allow not in ("true", "false"):
        sys.exit(f"hybridrec.export: allow_unverified={args['allow_unverified']}: give true or false")
    overwrite = args.get("overwrite", "false").lower()
    if overwrite not in ("true", "false"):
        sys.exit(f"hybridrec.export: overwrite={args['overwrite']}: give true or false")
    # Checked before anything is loaded: each failure is one line naming the file.
    try:
        # a checkpoint.dir stands for its newest loadable checkpoint
        ckpt, which = resolve_checkpoint(args["checkpoint"], allow == "true")
        if which:
            print(f"hybridrec.export: {which}")
        out = args.get("out", os.path.join(ckpt, "export"))
        check_checkpoint(ckpt, allow == "true")
        if "out" not in args:
            check_export_dir(ckpt, out)
        if "delta" not in args:
            check_out(out, overwrite == "true")
    except CheckpointError as e:
        sys.exit(f"hybridrec.export: {e}")
    if "delta" in args:  # what changed since that export (hybridrec.serving.delta)
        _quiet_tracing()
        try:
            path, _ = delta.write(ckpt, args["delta"], trusted, allow == "true")
        except (CheckpointError, delta.DeltaError) as e:
            sys.exit(f"hybridrec.export: {e}")
        except OSError as e:
            sys.exit(f"hybridrec.export: cannot write {e}")
        d = delta.read(path)
        state, _ = delta.exported_state(args["delta"])
        print(f"hybridrec.export: delta {delta.describe(d, state)} -> {path} ({os.path.getsize(path) / 2**20:.2f} MB)")
        return
    folder = out if os.path.isdir(out) else os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        sys.exit(f"hybridrec.export: out={out}: {folder} is not a writable directory")
    _quiet_tracing()
    try:
        spec = export(ckpt, out, trusted, allow == "true")
    except CheckpointError as e:
        sys.exit(f"hybridrec.export: {e}")
    except OSError as e:  # disk full, a file named like the directory
        sys.exit(f"hybridrec.export: cannot write {e}")
    if "features" not in spec:  # a sequence ranker's user encoder
        print(
            f"hybridrec.export: user encoder -> {os.path.join(out, PROGRAM)}, {spec['catalogue']:,} item vectors -> "
            f"{os.path.join(out, spec['item_vectors'])} (how to score: {os.path.join(out, SPEC)})"
        )
        return
    print(
        f"hybridrec.export: {len(spec['features'])} sparse and {spec['num_dense_features']} dense features -> "
        f"{os.path.join(out, PROGRAM)} (outputs a {spec['output']}; inputs in {os.path.join(out, SPEC)})"
    )
    if spec["preprocessing"]:
        print(
            f"hybridrec.export: raw rows -> inputs: {os.path.join(out, PREPROCESSING)} "
            f"(hybridrec.serving.Preprocessor.load({out!r}))"
        )
    else:
        print(f"hybridrec.export: no {PREPROCESSING}: {spec['preprocessing_missing']}")


if __name__ == "__main__":
    main(sys.argv[1:])
