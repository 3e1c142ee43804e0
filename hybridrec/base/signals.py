"""How a process of a job ended by a signal is named: the one line a user sees, and the
exit code (128 + the signal's number). Shared by the ranks' process groups
(``parallel.distributed``), the input pipeline's workers (``data.loader``) and the
launcher."""

from __future__ import annotations

import signal


class Killed(RuntimeError):
    """A process of the job was ended by a signal from outside (a rank, a DataLoader worker):
    reported in one line naming the process and the signal, and the command exits with
    128 + the signal's number, the shell's convention for a process a signal ended."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
