"""What a run prints: Hydra's job logging in every rank, the libraries kept quiet, progress.

Hydra configures logging (``hydra/job_logging``: the console and ``<run dir>/train.log``, one
format) in the process it runs in. Ranks that ``launch.spawn`` starts are new processes, so
the Hydra process hands them its resolved logging config (``JobLogging``) and each rank
applies it with Hydra's own ``configure_log``: rank 0's evaluation lines and summary reach
``train.log`` in the same format whether the run has one rank or several.

Verbosity is Hydra's switch, ``hydra.verbose``: ``hydra.verbose=torchrec.distributed.planner``
shows TorchRec's planner lines, ``hydra.verbose=true`` everything at DEBUG. Preferred to a
key of hybridrec's own: it is what Hydra users know, and through ``JobLogging`` it reaches
the ranks too.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Optional, cast

from tqdm import tqdm

# Library loggers held above INFO unless hydra.verbose names them (or a parent): what they
# say at INFO is about their own internals. TorchRec's planner logs one line per partitioner
# pass, 100 to 260 per plan; its enumerator warns for every (sharding type, kernel) pair a
# constraint rules out (expected, not actionable); torch.fx logs a notice per traced module.
QUIET = {
    "torchrec.distributed.planner": logging.WARNING,
    "torchrec.distributed.planner.enumerators": logging.ERROR,
    "torch.fx._symbolic_trace": logging.ERROR,
}


def verbose_about(name: str, verbose: Any) -> bool:
    """Whether ``hydra.verbose`` (false, true, a logger name or a list of them) asks for the
    logger ``name``: all loggers, or the name itself or one of its parents."""
    if isinstance(verbose, bool):
        return verbose
    names = [verbose] if isinstance(verbose, str) else list(verbose)
    return any(name == v or name.startswith(v + ".") for v in names)


def quiet_libraries(verbose: Any = False) -> None:
    for name, level in QUIET.items():
        if not verbose_about(name, verbose):
            logging.getLogger(name).setLevel(level)


def hydra_verbose() -> Any:
    """This process's ``hydra.verbose`` (False outside a Hydra job)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    if not HydraConfig.initialized():
        return False
    verbose = HydraConfig.get().verbose
    return OmegaConf.to_container(verbose) if OmegaConf.is_config(verbose) else verbose


@dataclass(frozen=True)
class JobLogging:
    """The Hydra job's logging, resolved in the Hydra process (file paths included), for
    ranks started as new processes."""

    config: Optional[dict[str, Any]]
    """``hydra.job_logging`` (None: Hydra's default console logging)."""
    verbose: Any
    """``hydra.verbose``."""

    @classmethod
    def of_this_job(cls) -> Optional[JobLogging]:
        from hydra.core.hydra_config import HydraConfig
        from omegaconf import OmegaConf

        if not HydraConfig.initialized():
            return None
        job_logging = HydraConfig.get().job_logging
        return cls(
            # a mapping node (a logging dictConfig): its container is a dict
            cast(dict[str, Any], OmegaConf.to_container(job_logging, resolve=True))
            if job_logging is not None
            else None,
            hydra_verbose(),
        )

    def apply(self) -> None:
        """Configure this process's logging as Hydra configured the job's."""
        from hydra.core.utils import configure_log
        from omegaconf import OmegaConf

        verbose = self.verbose if isinstance(self.verbose, (bool, str)) else OmegaConf.create(self.verbose)
        log_config = OmegaConf.create(self.config) if self.config is not None else None
        # Hydra's annotation omits the None it takes (None: its default console logging)
        configure_log(log_config, verbose)  # type: ignore[arg-type]  # None is valid, see above


class _RankPrefix(logging.Filter):
    """Marks the lines of ranks other than 0, which speak only to warn or fail."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.prefix = f"[rank{rank}] "

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "hybridrec_rank_prefix", False):  # once, whatever the number of handlers
            record.msg, record.hybridrec_rank_prefix = self.prefix + str(record.msg), True
        return True


def configure_rank(rank: int, job_logging: Optional[JobLogging]) -> None:
    """A rank's logging: the job's handlers and format (``job_logging`` in a process of its
    own; Hydra's already in the Hydra process), then hybridrec's INFO on rank 0 only and the
    libraries' warnings, unless hydra.verbose asks for more."""
    if job_logging is not None:
        job_logging.apply()
    verbose = job_logging.verbose if job_logging is not None else hydra_verbose()
    root = logging.getLogger()
    if rank != 0:
        if not root.handlers:  # torchrun's ranks other than 0 run with hydra/job_logging=none
            logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
        for handler in root.handlers:
            handler.addFilter(_RankPrefix(rank))
    # Libraries log at INFO (fbgemm prints every kernel's arguments): only hybridrec's own
    # INFO is shown, on rank 0; other ranks speak on failure.
    if verbose is not True:
        root.setLevel(logging.WARNING)
    if not verbose_about("hybridrec", verbose):
        logging.getLogger("hybridrec").setLevel(logging.INFO if rank == 0 else logging.WARNING)
    quiet_libraries(verbose)


def _not_progress(record: logging.LogRecord) -> bool:
    return not getattr(record, "hybridrec_progress", False)


class Progress:
    """Training progress on rank 0: tqdm's bar when stderr is a terminal, otherwise (a file,
    a pipe, a batch job's log) one log line per report. Written here because tqdm has no
    such mode: it redraws its bar with carriage returns, which a file keeps as one line that
    grows with every update. The lines reach train.log in both cases."""

    def __init__(
        self, total: int, initial: int, enabled: bool, logger: logging.Logger, terminal: Optional[bool] = None
    ) -> None:
        self.total, self.initial, self.enabled, self.log = total, initial, enabled, logger
        terminal = sys.stderr.isatty() if terminal is None else terminal
        self.bar = None
        if enabled and terminal:
            # tqdm's default lock is a multiprocessing semaphore: a rank stopped while another
            # reports a data error would leave it behind, and Python warns of the leak at exit.
            tqdm.set_lock(threading.RLock())
            self.bar = tqdm(total=total, initial=initial, desc="train", unit="step")

    def advance(self, step: int) -> None:
        """Training step ``step`` is done."""
        if self.bar is not None:
            self.bar.update(step - self.bar.n)

    def report(self, step: int, loss: float, samples_per_second: float, elapsed: float) -> None:
        """The loss after ``step`` and the training rate; ``elapsed``: training seconds of this
        run so far (evaluation excluded), from which the time left is estimated."""
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{samples_per_second:,.0f}")
        if self.enabled:
            left = elapsed / max(1, step - self.initial) * (self.total - step)
            self.log.info(
                f"step {step}/{self.total}  loss {loss:.4f}  {samples_per_second:,.0f} samples/s  "
                f"ETA {tqdm.format_interval(left)}",
                extra={"hybridrec_progress": True},
            )

    @contextlib.contextmanager
    def logging(self) -> Iterator[None]:
        """Where log lines go while training: with a bar, the console's lines are written
        above it (tqdm's own redirection of the console handlers) and the progress lines
        only to the files (the bar shows them); without one, every line goes through."""
        if self.bar is None:
            yield
            return
        from tqdm.contrib.logging import logging_redirect_tqdm

        with logging_redirect_tqdm():
            for handler in logging.getLogger().handlers:
                if not isinstance(handler, logging.FileHandler):
                    handler.addFilter(_not_progress)
            yield

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
