"""The command line's error policy: which errors are the user's to fix, and how a command
stops on one (one ``hybridrec: ...`` line and a non-zero exit; the traceback only with
HYDRA_FULL_ERROR=1, Hydra's own switch). Errors that are not listed here are bugs: they keep
their traceback."""

from __future__ import annotations

import os
import sys
from typing import NoReturn

from hybridrec.base.signals import Killed
from hybridrec.checkpoint import CheckpointError, Diverged
from hybridrec.data import DataError
from hybridrec.parallel.distributed import LaunchError
from hybridrec.parallel.sharding import PlanError


class OutOfMemory(Exception):
    """A rank's device ran out of memory (a step, or a batch made on it ahead of the step): one
    line with the device's words and the settings that lower the memory, not torch's traceback."""


def out_of_memory(error: BaseException, rank: int) -> OutOfMemory:
    said = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return OutOfMemory(
        f"rank {rank}: the device ran out of memory ({said}); the last committed checkpoint is kept, nothing "
        f"after it was saved. Lower data.batch_size or data.prefetch, or spread the tables over more devices "
        f"(python -m hybridrec.plan prints the planner's memory per device)"
    )


# Errors the user can fix (bad input files, a damaged or mismatched checkpoint, a full disk,
# a plan the planner cannot meet: under torchrun the ranks plan before anything else has,
# a launcher environment without the local layout, a device out of memory): reported as one line naming the
# file or key, without a traceback, and never restarted.
USER_ERRORS = (DataError, CheckpointError, Diverged, PlanError, LaunchError, OutOfMemory)
USER_ERROR_EXIT = 3
"""Exit code of a rank stopped by a user error (its message is in the elastic error file)."""


def full_errors() -> bool:
    """HYDRA_FULL_ERROR=1 (Hydra's own switch) shows the traceback of user errors too."""
    return os.environ.get("HYDRA_FULL_ERROR") == "1"


def user_message(error: BaseException) -> str:
    """The one line a user error found before launch is reported with."""
    if isinstance(error, (CheckpointError, Diverged, LaunchError, DataError, OutOfMemory)):
        return f"hybridrec: {error}"  # a file or a process, named in the message
    return f"hybridrec: invalid config: {error}"  # PlanError included


def exit_user_error(error: BaseException, message: str) -> NoReturn:
    """How an entry point stops on a user error: its one-line ``message`` and a non-zero
    exit (128 + the signal for a process a signal ended, ``Killed``), or the traceback with
    HYDRA_FULL_ERROR=1."""
    if full_errors():
        raise error
    if isinstance(error, Killed):
        print(message, file=sys.stderr, flush=True)
        sys.exit(error.exit_code)
    sys.exit(message)


def check_command_line(config_name: str) -> None:
    """Before Hydra: a mistyped key or group option among the command line's overrides is
    one line with the nearest name (``config.overrides``), not Hydra's advice to append it.
    Command lines with flags (-m sweeps, --config-dir, --help) are Hydra's to read."""
    from hybridrec.config import overrides

    argv = sys.argv[1:]
    if not argv or any(a.startswith("-") for a in argv):
        return  # (a flag may take a value: --config-dir <dir>)
    if bare := next((a for a in argv if "=" not in a and not a.startswith(("-", "~"))), None):
        # Hydra would answer "missing EQUAL at '<EOF>'"
        app = "evaluate" if config_name == "evaluate" else "train"
        if app == "evaluate":
            fix = f"give checkpoint={bare}"
        elif os.path.exists(bare):
            fix = f"to resume from it, give checkpoint.resume={bare}"
        else:
            fix = "every argument is an override, key=value or +experiment=<name>"
        sys.exit(f"hybridrec: {bare} is not key=value: {fix} (python -m hybridrec.{app} --help lists them)")
    try:
        overrides.check(argv, config_name)
    except ValueError as e:
        exit_user_error(e, user_message(e))
