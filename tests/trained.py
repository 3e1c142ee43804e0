"""What several tests read, built once per test run: trained runs, checkpoints, exports.

    from trained import once
    ckpt = once(tmp_path_factory, "tiny-2ranks", build)   # build(path) runs once; every caller gets path

Built in a directory shared by the test run's processes (pytest-xdist's workers share the
parent of their base temporary directories), under a file lock, so that two workers needing
the same run build it once. A test that damages what it reads works on ``copy_of(path,
tmp_path)``. A build that raises leaves nothing behind, and the next caller builds again
(and reports the error again).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

from filelock import FileLock


def shared_root(tmp_path_factory) -> Path:
    """A directory every process of this test run sees (the workers' common base)."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "trained"
    root.mkdir(exist_ok=True)
    return root


def once(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """``root/name`` after ``build(root/name)`` has run once in this test run."""
    root = shared_root(tmp_path_factory)
    path, done = root / name, root / f"{name}.done"
    with FileLock(str(root / f"{name}.lock")):
        if not done.exists():
            if path.exists():
                shutil.rmtree(path)  # a build that failed earlier
            path.mkdir()
            try:
                build(path)
            except BaseException:
                shutil.rmtree(path, ignore_errors=True)
                raise
            done.touch()
    return path


def copy_of(path: Path, tmp_path: Path) -> Path:
    """A private copy of a shared run or checkpoint, for a test that changes or damages it."""
    out = tmp_path / path.name
    shutil.copytree(path, out, symlinks=True)
    return out
