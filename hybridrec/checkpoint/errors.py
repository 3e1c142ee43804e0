"""What goes wrong with a checkpoint, as the exceptions every part of the package raises,
and how DCP's wrapped failures are unwrapped to the cause a user can act on."""

from __future__ import annotations

from torch.distributed.checkpoint.api import CheckpointException


class CheckpointError(ValueError):
    """A checkpoint hybridrec refuses to load: state files holding pickled objects, a format
    written by an older hybridrec, or files missing."""


class UnsafeCheckpoint(CheckpointError):
    """A checkpoint file that opening would make run code: refused before anything in it ran."""


class Diverged(ValueError):
    """Training state that must not be committed: a non-finite loss, weights or scores."""


def one_line(e: BaseException) -> str:
    """The first line of an exception's message: what goes into a one-line error."""
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def root_cause(e: BaseException) -> BaseException:
    """What went wrong under DCP's wrapper: a ``CheckpointException`` holds each failed rank's
    exception (lowest rank first here), and an exception may be chained to its cause."""
    while True:
        cause = e.__cause__ or e.__context__
        if isinstance(e, CheckpointException) and e.failures:
            e = e.failures[min(e.failures)][0]
        elif isinstance(e, (OSError, CheckpointError)) or cause is None:
            return e
        else:
            e = cause
