"""Install check: the environment holds the CPU or the CUDA build that ``make install`` asked for.

``python hybridrec/install_check.py --gpu 0|1 --other`` prints the other build's packages that
are installed (the Makefile uninstalls them before switching a .venv); ``--gpu 0|1`` checks
the result. Run as a file, before hybridrec itself is installed: it imports nothing of
hybridrec.

Why by hand: pip cannot express "this environment must hold the CUDA build". ``torch==2.13.0``
is satisfied by a local ``+cpu`` wheel as well as by the CUDA one, and ``fbgemm-gpu`` and
``fbgemm-gpu-cpu`` both provide the ``fbgemm_gpu`` module, so installing one over the other
leaves files of both.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import sys

FBGEMM = {False: "fbgemm-gpu-cpu", True: "fbgemm-gpu"}
# The fbgemm-gpu and torchrec that load with each torch (fbgemm's compiled ops are tied to
# one torch ABI), for `make install GPU=1 SYSTEM_TORCH=1` on a host's own torch. 2.13: the
# pins of constraints.txt, tested; 2.11: ran on an H100 (fbgemm-gpu 1.6.0, torchrec 1.6.1);
# 2.12: the releases between them, not yet run.
PAIRS = {"2.13": ("1.8.0", "1.8.0"), "2.12": ("1.7.0", "1.7.0"), "2.11": ("1.6.0", "1.6.1")}


def pairs(torch_version: str) -> list[str]:
    """The constraints for fbgemm-gpu and torchrec that fit ``torch_version`` (ValueError when
    hybridrec has none for it)."""
    minor = ".".join(torch_version.split("+")[0].split(".")[:2])
    if minor not in PAIRS:
        raise ValueError(
            f"torch {torch_version}: hybridrec runs on torch {', '.join(sorted(PAIRS))} (with their "
            f"fbgemm-gpu and torchrec); install one of them, or use the pinned build (no SYSTEM_TORCH)"
        )
    fbgemm, torchrec = PAIRS[minor]
    return [f"fbgemm-gpu=={fbgemm}", f"torchrec=={torchrec}"]


def installed(name: str) -> bool:
    try:
        metadata.version(name)
        return True
    except metadata.PackageNotFoundError:
        return False


def other_build(gpu: bool, torch_cuda: str | None) -> list[str]:
    """The installed packages of the build not asked for, to uninstall before installing."""
    names = [FBGEMM[not gpu]] if installed(FBGEMM[not gpu]) else []
    if installed("torch") and (torch_cuda is None) == gpu:  # a CPU torch for GPU=1, or the reverse
        names.append("torch")
    return names


def problems(gpu: bool, torch_version: str, torch_cuda: str | None, cuda_usable: bool) -> list[str]:
    """Why this environment is not the build asked for (empty: it is)."""
    found = []
    if gpu and torch_cuda is None:
        found.append(
            f"torch {torch_version} has no CUDA (torch.version.cuda is None): the index offered a CPU "
            f"wheel; install the CUDA one (make install GPU=1 CUDA=cu128, matching the driver)"
        )
    if not gpu and torch_cuda is not None:
        found.append(
            f"torch {torch_version} is a CUDA build in a CPU install (several GB): `make clean install`, "
            f"with the CPU wheel offered (pip's --find-links or https://download.pytorch.org/whl/cpu)"
        )
    if installed(FBGEMM[not gpu]):
        found.append(
            f"{FBGEMM[not gpu]}, the {'CPU' if gpu else 'CUDA'} build, is installed: it provides the "
            f"fbgemm_gpu module {FBGEMM[gpu]} provides; `make clean install{' GPU=1' if gpu else ''}`"
        )
    if gpu and torch_cuda is not None and not cuda_usable:
        print(
            f"install check: torch has CUDA {torch_cuda}, but no GPU is usable on this machine "
            f"(fine on a login node; training here would be refused)",
            file=sys.stderr,
        )
    return found


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", type=int, choices=(0, 1), required=True)
    parser.add_argument("--other", action="store_true", help="print the other build's installed packages")
    parser.add_argument(
        "--pairs", action="store_true", help="print the fbgemm-gpu and torchrec constraints for the installed torch"
    )
    args = parser.parse_args(argv)
    gpu = bool(args.gpu)
    if args.pairs:
        try:
            print("\n".join(pairs(metadata.version("torch"))))
        except (ValueError, metadata.PackageNotFoundError) as e:
            print(f"hybridrec: install check: {e}", file=sys.stderr)
            return 1
        return 0
    if args.other:
        cuda = None
        if installed("torch"):
            try:
                import torch

                cuda = torch.version.cuda
            except ImportError:  # a half-removed torch: reinstall it either way
                cuda = "unknown" if not gpu else None
        print(" ".join(other_build(gpu, cuda)))
        return 0
    import fbgemm_gpu  # noqa: F401  (its ops must load with this torch)
    import torch
    import torchrec

    found = problems(gpu, torch.__version__, torch.version.cuda, torch.cuda.is_available())
    for problem in found:
        print(f"hybridrec: install check: {problem}", file=sys.stderr)
    if not found:
        print(
            f"torch {torch.__version__} | CUDA {torch.version.cuda} | GPUs {torch.cuda.device_count()} | "
            f"torchrec {torchrec.__version__} | {FBGEMM[gpu]} {metadata.version(FBGEMM[gpu])}"
        )
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
