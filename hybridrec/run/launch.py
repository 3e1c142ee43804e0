"""Starting ranks: in-process for one rank, PyTorch's elastic launcher for several.

``launcher.nproc_per_node=N`` starts N workers on this machine with PyTorch's elastic agent,
the machinery behind ``torchrun`` and ``elastic_launch`` (c10d rendezvous on a free local
port, workers forked from a server that imported torch and TorchRec once, failures reported
with tracebacks, restarts after a crash).
When the process is already one rank of a launched job (torchrun, srun), it just runs.

Ending: SIGTERM or SIGINT (Ctrl-C) to the launcher ends every rank and each rank's DataLoader
workers at once, and the command with one line and exit status 128 + the signal's number.
A rank that stops answering (stopped with SIGSTOP, frozen, stuck holding Python's GIL) is
killed and named, with its pid, well within launcher.collective_timeout_s; the healthy ranks
would otherwise fail at that timeout, with errors that name themselves. A launcher killed
with SIGKILL leaves no rank behind. Under torchrun, its agent stops the ranks: there, ranks
and their workers still end at once and silently and die with the agent, but no rank is
watched for silence (the collective timeout ends a hung job).

Under Hydra's submitit launcher (``-m hydra/launcher=slurm``), each Slurm job runs one task
per node, and each task does what ``torchrun --nnodes N`` would: it starts the node's ranks
with the same elastic launcher, the nodes meeting at a c10d rendezvous on the first node of
the allocation (``job_nodes``). ``SubmititCheck`` refuses a launcher config that cannot work
before anything is submitted.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any, Callable, Iterator, Mapping, Optional, cast

import torch.distributed.elastic.rendezvous.registry as rdzv_registry
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.agent.server.api import RunResult, WorkerSpec
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousParameters

from hybridrec.base.compat import (
    AgentFailureLogFilter,
    ExtensibleAgent,
    agent_kwargs,
    read_proc_state,
    stop_rendezvous_heartbeats,
)
from hybridrec.base.signals import Killed, signal_name
from hybridrec.checkpoint import committed
from hybridrec.parallel.devices import Cuda
from hybridrec.parallel.distributed import as_launched_rank, tie_forks_to_this_process
from hybridrec.reports.logs import JobLogging
from hybridrec.run.errors import USER_ERROR_EXIT
from hybridrec.run.rank import RankJob, run

log = logging.getLogger("hybridrec.launch")  # its name before the packages: hydra.verbose keeps it
RENDEZVOUS_TIMEOUT_S = 900  # how long nodes wait for each other: elastic_launch's join timeout


class RankError(Exception):
    """What ended the ranks, as one line: a user error (``errors.USER_ERRORS``) that stopped
    a rank, with the message the rank recorded, or one of the launcher's own reports below."""


class Stopped(RankError):
    """The launcher received SIGTERM, SIGINT (Ctrl-C), SIGHUP or SIGQUIT, and ended its ranks."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")


class Unresponsive(RankError):
    """A rank sent no heartbeat for too long; the launcher killed it, and the job ended."""


_HANDLED_FAILURE_PIDS: set[int] = set()
"""The ranks of this attempt that the launcher killed for a silent rank: that is the report."""


def _reported_otherwise(exitcode: object, pid: object) -> bool:
    """A failure hybridrec reports in one line itself (torch logs each with a traceback of its
    own code): a rank stopped by a user error (its message is the report), a rank a signal
    ended (exit code < 0) or one whose DataLoader worker a signal ended (> 128, the message
    recorded), or ranks killed for a silent rank. Any other failure (a bug) is logged as
    torch logs it, traceback included."""
    return (
        exitcode == USER_ERROR_EXIT
        or isinstance(exitcode, int)
        and (exitcode < 0 or exitcode > 128)
        or pid in _HANDLED_FAILURE_PIDS
    )


def _killed(failures: dict[int, Any]) -> Optional[Killed]:
    """The lowest rank of ``failures`` (the agent's, by global rank) that a signal ended, or
    whose DataLoader worker a signal ended, as the one line the command reports; None if
    no signal ended any."""
    for rank, f in sorted(failures.items()):
        if f.exitcode < 0:
            return Killed(f"rank {rank} (pid {f.pid}) was killed by {signal_name(-f.exitcode)}", -f.exitcode)
        if f.exitcode > 128:
            return Killed(
                f.message or f"rank {rank} (pid {f.pid}) ended by {signal_name(f.exitcode - 128)}", f.exitcode - 128
            )
    return None


def already_launched() -> bool:
    """True when an outer launcher (torchrun, Slurm + env) made this process one rank."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


@dataclass(frozen=True)
class Nodes:
    """The machines one job runs on, as the elastic launcher's rendezvous needs them."""

    count: int
    endpoint: str
    """host:port of the c10d rendezvous; port 0 = a free port (one node only)."""
    run_id: str
    """Shared by every node of the job, distinct between jobs."""


def job_nodes() -> Nodes:
    """This job's nodes: one (this machine), unless the process is a task of a submitit job.

    There, submitit's own view of the allocation is used: ``JobEnvironment`` reads Slurm's
    SLURM_JOB_NUM_NODES, SLURM_NTASKS and SLURM_JOB_ID and parses SLURM_JOB_NODELIST, and
    ``TorchDistributedEnvironment`` picks the rendezvous address (the first node) and port
    (MASTER_PORT if set, else one derived from the job id, so every node derives the same).
    Raises ValueError when the job runs other than one task per node: several tasks on a
    node would each start the node's ranks.
    """
    if "SUBMITIT_EXECUTOR" not in os.environ:
        return Nodes(1, "localhost:0", f"hybridrec-{uuid.uuid4().hex[:8]}")
    import submitit
    from submitit.helpers import TorchDistributedEnvironment

    job = submitit.JobEnvironment()
    if job.num_tasks != job.num_nodes:
        raise ValueError(
            f"this submitit job runs {job.num_tasks} task(s) on {job.num_nodes} node(s); hybridrec "
            f"needs one task per node (hydra.launcher.tasks_per_node=1), which starts "
            f"launcher.nproc_per_node ranks on its node"
        )
    if job.num_nodes == 1:
        return Nodes(1, "localhost:0", f"hybridrec-{job.job_id}")
    torch_env = TorchDistributedEnvironment()
    return Nodes(job.num_nodes, f"{torch_env.master_addr}:{torch_env.master_port}", f"hybridrec-{job.job_id}")


def in_sweep() -> bool:
    """True inside a Hydra multirun job (``-m``), where jobs share the Hydra process."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def in_search() -> bool:
    """True inside a job of a sweeper that reads the jobs' return values to choose the next
    ones (Optuna, Nevergrad, Ax, ...): every sweeper but Hydra's basic one, which runs a fixed
    list of jobs."""
    from hydra.core.hydra_config import HydraConfig

    return in_sweep() and not str(HydraConfig.get().sweeper.get("_target_", "")).endswith(".BasicSweeper")


def world_size(cfg: DictConfig) -> int:
    if already_launched():
        return int(os.environ["WORLD_SIZE"])
    return cfg.launcher.nproc_per_node * job_nodes().count


def launch(cfg: DictConfig, run_dir: str, job: Optional[RankJob] = None) -> Mapping[str, Any]:
    """Run ``job`` (default: training) on ``world_size(cfg)`` ranks and return rank 0's
    summary. A signal that stops the launched ranks ends this process (see ``Stopped``)."""
    if already_launched():
        if cfg.launcher.nproc_per_node != 1:
            log.info("already launched (torchrun/srun): launcher.nproc_per_node is ignored")
        # torch's elastic agent (torchrun) is this rank's parent; srun's is Slurm's step daemon,
        # which ends its tasks itself.
        as_launched_rank(parent_ends_it="TORCHELASTIC_RUN_ID" in os.environ)
        # torch's @record types run as returning None too (for a SystemExit(0), which run never raises)
        return cast("Mapping[str, Any]", run(cfg, run_dir, job=job))
    nproc, nodes = cfg.launcher.nproc_per_node, job_nodes()
    if nproc == 1 and nodes.count == 1 and not in_sweep():
        with _stops_in_one_line(run_dir, cfg.checkpoint.dir):
            return cast("Mapping[str, Any]", run(cfg, run_dir, job=job))  # (as above)
    # Jobs of a sweep (-m) get processes of their own, one rank included: peak memory,
    # thread settings and library state of one job must not leak into the next.
    # The ranks are new processes: they get the Hydra job's logging (console, train.log).
    # A rank may be silent for half the collective timeout (at most 30 s): then it is named
    # before the collective timeout fails its peers.
    # Until the ranks have met and planned, nothing else is printed: say what is under way.
    if nodes.count > 1:
        log.info(
            f"waiting at the c10d rendezvous {nodes.endpoint} for all {nodes.count} nodes "
            f"({nproc} rank(s) each; up to {RENDEZVOUS_TIMEOUT_S} s): the same command runs on every node"
        )
    else:
        log.info(
            f"starting {nproc} ranks (PyTorch's elastic launcher): they load torch and TorchRec, meet, "
            f"and plan the tables; the plan is printed when they have"
        )
    try:
        return spawn(
            run,
            nproc,
            resolved(cfg),
            run_dir,
            True,
            job,
            JobLogging.of_this_job(),
            max_restarts=cfg.launcher.max_restarts,
            nodes=nodes,
            silence_s=min(30.0, cfg.launcher.collective_timeout_s / 2),
        )
    except Stopped as e:
        # The user asked the whole command to end, a sweep's jobs still to run included: one
        # line, and the shell's exit status of a process ended by that signal.
        print(stopped_line(str(e), run_dir, cfg.checkpoint.dir), file=sys.stderr, flush=True)
        raise SystemExit(128 + e.signum) from None


def stopped_line(why: str, run_dir: str, checkpoint_dir: Optional[str]) -> str:
    """The one line a stopped run ends with: why, where its outputs are, and with a
    checkpoint.dir, its newest committed checkpoint and that the same command resumes from it
    (checkpoint.resume=auto). Cheap enough for a signal handler: a directory listing."""
    line = f"hybridrec: {why}; outputs so far in {os.path.abspath(run_dir)}"
    if not checkpoint_dir:
        return line
    saved = committed(checkpoint_dir) if os.path.isdir(checkpoint_dir) else []
    if not saved:
        return f"{line}; no checkpoint saved yet in {checkpoint_dir}"
    return f"{line}; newest checkpoint {saved[-1][1]}: the same command resumes from it"


@contextlib.contextmanager
def _stops_in_one_line(run_dir: str, checkpoint_dir: Optional[str] = None) -> Iterator[None]:
    """One rank in this process: SIGTERM, SIGINT (Ctrl-C), SIGHUP or SIGQUIT end it as they end
    launched ranks: one line and exit status 128 + the signal, at once. Python's default
    would unwind the rank (KeyboardInterrupt: some 60 lines of traceback, after the
    collective or kernel it is in returns). Nothing is left half-done that a later run
    trusts: a save being written stays a ``.partial``, which resume never picks; the
    checkpoint lock is the kernel's; DataLoader workers end with this process (the fork
    hook ``as_launched_rank`` installs in ranks)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    owner = os.getpid()

    def stop(signum: int, frame: Any) -> None:
        if os.getpid() == owner:  # a DataLoader worker inherits the handler: it ends without a word
            line = stopped_line(f"stopped by {signal_name(signum)}", run_dir, checkpoint_dir)
            os.write(2, f"{line}\n".encode())
        os._exit(128 + signum)

    tie_forks_to_this_process()
    handlers = {s: signal.signal(s, stop) for s in _AGENT_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def oversubscribed(cfg: DictConfig, env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """A warning when this node's ranks would run more threads than it has cores: it works,
    slower than fewer ranks or threads would, so it is said once, with the numbers."""
    env = os.environ if env is None else env
    cores = len(os.sched_getaffinity(0))
    nproc = cfg.launcher.nproc_per_node
    omp = env.get("OMP_NUM_THREADS", "")
    threads = cfg.launcher.threads_per_rank or (int(omp) if omp.isdigit() else 0) or max(1, cores // nproc)
    if nproc * threads <= cores:
        return None
    return (
        f"launcher.nproc_per_node={nproc} ranks x {threads} thread(s) each = {nproc * threads} threads on "
        f"{cores} cores: they share cores and run slower than fewer would; lower launcher.nproc_per_node or "
        f"launcher.threads_per_rank (unset, the cores are split between the ranks)"
    )


def resolved(cfg: DictConfig) -> DictConfig:
    """A copy of hybridrec's keys with every interpolation resolved. The ranks are other
    processes, where Hydra's own resolver (``${hydra:runtime.output_dir}``, say in
    checkpoint.dir to give each sweep job its own directory) does not exist: they get values."""
    out = copy.deepcopy(cfg)
    for key in out:
        if key != "hydra" and isinstance(out[key], DictConfig):  # Hydra's node, when present, stays Hydra's
            OmegaConf.resolve(out[key])
    return out


def quiet_secondary_ranks() -> None:
    """Under torchrun every rank runs the Hydra entry point, and each would create its own
    timestamped run directory and log file. Ranks other than 0 write to a scratch directory
    instead; ``rank.run`` then adopts rank 0's directory (broadcast once the process group
    is up). Call before Hydra parses the command line."""
    if already_launched() and os.environ["RANK"] != "0":
        scratch = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"hybridrec-rank{os.environ['RANK']}")
        sys.argv += [f"hydra.run.dir={scratch}", "hydra.output_subdir=null", "hydra/job_logging=none"]


def spawn(
    fn: Callable[..., Any],
    nproc: int,
    *args: Any,
    max_restarts: int = 0,
    nodes: Optional[Nodes] = None,
    silence_s: float = 30.0,
) -> Any:
    """The lowest rank's return value (rank 0's on its node) of ``fn(*args)`` run on ``nproc``
    local ranks, started by PyTorch's elastic agent: c10d rendezvous (on a free local port
    for one node), workers started as ``start_method`` says. Tests and benchmarks use it
    too, so they start ranks exactly as users do. ``max_restarts`` (default 0: a failed rank fails the call) lets the
    agent stop and restart every rank after a crash, up to that many times, but never after
    a user error. With ``nodes``, this call is one node of several, as torchrun --nnodes.
    A rank that exits with USER_ERROR_EXIT raises ``RankError`` with the message it recorded.
    A rank silent for ``silence_s`` seconds is killed, and ``Unresponsive`` raised (unless a
    restart is left); a signal that stops the launcher raises ``Stopped``, its ranks ended."""
    nodes = nodes or Nodes(1, "localhost:0", f"hybridrec-{uuid.uuid4().hex[:8]}")
    # The elastic agent logs every state change at INFO; keep the user's console for training.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    # and not the failures reported in one line, nor the signal that stops the job
    AgentFailureLogFilter.install(_reported_otherwise)
    # When one rank fails, the others are stopped with SIGTERM, each logged: the failure
    # itself is what the user needs, and it is reported.
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    try:
        # keyed by global rank, this node's ranks only
        results = _run_agent(fn, args, nproc, nodes, max_restarts, silence_s)
    except SignalException as e:  # raised by the agent's handler, once it has ended the ranks
        raise Stopped(e.sigval) from None
    except KeyboardInterrupt:  # Ctrl-C before the agent's handler was set: no rank started yet
        raise Stopped(signal.SIGINT) from None
    except ChildFailedError as e:
        stopped = sorted((rank, f) for rank, f in e.failures.items() if f.exitcode == USER_ERROR_EXIT)
        if stopped:
            raise RankError(stopped[0][1].message) from None
        if killed := _killed(e.failures):
            raise killed from None
        raise
    return results[min(results)]


def start_method(cuda: Cuda) -> str:
    """How the ranks' processes start. Without a usable GPU: forked from one server process
    that imported torch, TorchRec and the entry point's module once ("forkserver", preloaded),
    so that N ranks, and the ranks an elastic restart starts again, do not each pay the
    imports (about 5 s of CPU each). With one: "spawn", every rank a fresh interpreter:
    importing fbgemm_gpu calls torch.cuda.is_available(), which initializes CUDA in the
    importing process, and a process forked after that cannot use CUDA."""
    return "spawn" if cuda.devices else "forkserver"


class _Rank:
    """What the elastic agent runs in each rank: ``fn``, in a process that ends with the
    launcher and tells it, once a second, that it still runs."""

    def __init__(self, fn: Callable[..., Any], beats: Any) -> None:
        self.fn, self.beats = fn, beats
        self.__qualname__ = fn.__qualname__  # the agent names its entrypoint in its logs

    def __call__(self, *args: Any) -> Any:
        as_launched_rank()
        threading.Thread(
            target=_heartbeat, args=(self.beats, int(os.environ["LOCAL_RANK"])), name="hybridrec-heartbeat", daemon=True
        ).start()
        return self.fn(*args)


def _heartbeat(beats: Any, slot: int) -> None:
    """Each second, the time (``time.monotonic``: one clock for every process of the machine)
    into the rank's slot of the agent's shared array, until the launcher ends: then the rank
    ends too. The fork server the rank came from outlives the launcher while its ranks run,
    so a launcher killed with SIGKILL would otherwise leave them training."""
    launcher = multiprocessing.parent_process()  # the launcher, not the fork server
    assert launcher is not None  # a rank is a process the launcher started
    while True:
        beats[slot] = time.monotonic()
        if wait([launcher.sentinel], timeout=1.0):
            os._exit(1)


_STATES = {
    "R": "running",
    "S": "sleeping",
    "D": "uninterruptible sleep",
    "T": "stopped",
    "t": "stopped by a debugger",
    "Z": "exited",
}


class _Agent(ExtensibleAgent):
    """torch's local elastic agent, with two rules of hybridrec's.

    A rank stopped by a user error (bad rows, a checkpoint that does not fit, a plan that
    cannot be met) ends the job at once: restarted ranks would read the same config and files
    and fail the same way, max_restarts times.

    A rank whose heartbeat is older than ``silence_s`` is killed, with the other ranks (which
    then cannot print errors about the silent one), and reported by rank and pid. Its peers
    would otherwise wait in their collectives until the collective timeout. The heartbeat
    comes from a thread: a rank stopped (SIGSTOP), frozen or stuck holding the GIL is caught;
    a rank deadlocked with the GIL released still beats, and the collective timeout ends it.
    """

    def __init__(self, spec: WorkerSpec, *args: Any, beats: Any, silence_s: float, **kwargs: Any) -> None:
        super().__init__(spec, *args, **kwargs)
        self.max_restarts = spec.max_restarts
        self.beats, self.silence_s = beats, silence_s
        self.unresponsive: Optional[str] = None  # the report, once this attempt's ranks were killed
        self.last_look = self.awake_since = time.monotonic()

    def workers_starting(self, worker_group: Any) -> None:
        self.beats[:] = [0.0] * len(self.beats)  # 0: no heartbeat yet (a spawned rank imports first)
        self.unresponsive = None
        _HANDLED_FAILURE_PIDS.clear()  # the killed ranks' failures are logged before a restart

    def before_check(self, worker_group: Any) -> None:
        """End the silent ranks."""
        now = time.monotonic()
        if now - self.last_look > 2.0:
            # The agent itself did not run (Ctrl-Z stops every process of the job, fg continues
            # them all): the ranks get their time again from now.
            self.awake_since = now
        self.last_look = now
        if self.unresponsive:
            return
        silent = [
            w
            for w in worker_group.workers
            if self.beats[w.local_rank] and now - max(self.beats[w.local_rank], self.awake_since) > self.silence_s
        ]
        if not silent:
            return
        first = min(silent, key=lambda w: w.global_rank)
        state = read_proc_state(first.id)
        self.unresponsive = (
            f"rank {first.global_rank} (pid {first.id}) stopped responding: no heartbeat for "
            f"{now - self.beats[first.local_rank]:.0f} s (process state: "
            f"{_STATES.get(state or '', state or 'gone')}); every rank was killed"
        )
        if self.restarts_left > 0:
            log.warning(f"{self.unresponsive}; restarting them")
        # The silent ranks last: their peers must not see their connections close and fail.
        for w in sorted(worker_group.workers, key=lambda w: w in silent):
            _HANDLED_FAILURE_PIDS.add(w.id)
            try:
                os.kill(w.id, signal.SIGKILL)  # a stopped process ignores SIGTERM until continued
            except ProcessLookupError:
                pass

    def after_check(self, worker_group: Any, result: RunResult) -> None:
        if not result.is_failed():
            return
        if any(f.exitcode == USER_ERROR_EXIT for f in result.failures.values()):
            self.decline_restarts()
        elif self.restarts_left > 0 and not self.unresponsive:
            # torch's own report of a failure that is restarted is a traceback of the agent's
            # code; a signal's is filtered (_reported_otherwise) and said here in one line
            killed = _killed(result.failures)
            rank, f = min(result.failures.items())
            what = str(killed) if killed else f"rank {rank} (pid {f.pid}) failed with exit code {f.exitcode}"
            done = self.max_restarts - self.restarts_left + 1
            log.warning(
                f"{what}; restarting every rank from the newest checkpoint (restart {done} of "
                f"launcher.max_restarts={self.max_restarts})"
            )


# The signals torch's agent turns into SignalException (TORCHELASTIC_SIGNALS_TO_HANDLE).
_AGENT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def _run_agent(
    fn: Callable[..., Any], args: tuple, nproc: int, nodes: Nodes, max_restarts: int, silence_s: float
) -> dict[int, Any]:
    """What ``elastic_launch`` does (torch's launch_agent, the part a CPU or GPU job here
    uses), with the agent above: elastic_launch builds its LocalElasticAgent itself, and has
    no say in which failures it restarts."""
    params = RendezvousParameters(
        backend="c10d",
        endpoint=nodes.endpoint,
        run_id=nodes.run_id,
        min_nodes=nodes.count,
        max_nodes=nodes.count,
        timeout=RENDEZVOUS_TIMEOUT_S,
    )
    beats = multiprocessing.RawArray("d", nproc)  # shared memory, one slot per local rank
    spec = WorkerSpec(
        role="default",
        local_world_size=nproc,
        entrypoint=_Rank(fn, beats),
        args=tuple(args),
        rdzv_handler=rdzv_registry.get_rendezvous_handler(params),
        max_restarts=max_restarts,
        monitor_interval=0.1,
    )
    method = start_method(Cuda.probe())
    if method == "forkserver":
        multiprocessing.set_forkserver_preload(["hybridrec.run.rank", fn.__module__, __name__])
    # Ranks end at once on the agent's SIGTERM; one that does not (stopped, or in the kernel)
    # is killed after 5 s rather than torch's 30.
    agent = _Agent(
        spec,
        DefaultLogsSpecs(),
        start_method=method,
        beats=beats,
        silence_s=silence_s,
        **agent_kwargs(shutdown_timeout=5),
    )
    # The agent sets handlers for these and leaves them: after it, a signal would raise its
    # exception anywhere in this process (the next job of a sweep).
    handlers = (
        {s: signal.getsignal(s) for s in _AGENT_SIGNALS}
        if threading.current_thread() is threading.main_thread()
        else {}
    )
    close_rendezvous = True
    try:
        result = agent.run()
    except SignalException:
        close_rendezvous = False  # as torch's launcher: an agent stopped by a signal may be replaced
        stop_rendezvous_heartbeats(spec.rdzv_handler)
        raise
    finally:
        for sig, handler in handlers.items():
            if handler is not None:
                signal.signal(sig, handler)
        if close_rendezvous:
            spec.rdzv_handler.shutdown()
    if result.is_failed():
        if agent.unresponsive:
            raise Unresponsive(agent.unresponsive)
        raise ChildFailedError(name=getattr(fn, "__name__", str(fn)), failures=result.failures)
    return result.return_values
