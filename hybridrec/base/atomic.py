"""Writing files that no reader sees half-written and that nothing planted can redirect.

Every file hybridrec writes outside a checkpoint's own commit (exports, vocabularies,
converted data, the example log) goes through one of these two: a file or symbolic link
already at the target (or at its temporary name) is replaced, never written through, so a
link planted in an output directory cannot make a run overwrite what it points to.
"""

from __future__ import annotations

import os
import tempfile
from typing import Callable


def fresh(path: str) -> str:
    """``path``, with whatever was there removed (a symbolic link: the link itself), so the
    writer that opens it next creates a new file. For writers that stream into one name
    (the temporary file of a conversion) and rename it when done."""
    if os.path.islink(path) or os.path.isfile(path):
        os.remove(path)
    return path


def replace_file(path: str, write: Callable[[str], object]) -> None:
    """``write(temp)`` into a new file beside ``path`` (``mkstemp``: created exclusively, no
    link followed), then renamed over ``path`` in one step. The temporary file is removed if
    ``write`` fails; its error propagates."""
    folder, name = os.path.split(os.path.abspath(path))
    # a hidden name (no glob of *.parquet picks it up) that keeps the extension, which some
    # writers check (torch.export.save warns about an archive not named .pt2)
    fd, temp = tempfile.mkstemp(prefix=f".{name}.", suffix=f".partial{os.path.splitext(name)[1]}", dir=folder)
    os.close(fd)
    try:
        os.chmod(temp, 0o666 & ~_umask())  # mkstemp's 0600 would hide the file from its other readers
        write(temp)
        os.replace(temp, path)
    except BaseException:
        if os.path.exists(temp):
            os.remove(temp)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
