"""Starting ranks: in-process for one rank, PyTorch's elastic launcher for several.

``launcher.nproc_per_node=N`` starts N workers on this machine with PyTorch's elastic agent,
the machinery behind ``torchrun`` and ``elastic_launch`` (c10d rendezvous on a free local
port, workers forked from a server that imported torch and TorchRec once, failures reported
with tracebacks, restarts after a crash).
When the process is already one rank of a launched job (torchrun, srun), it just runs.

Under Hydra's submitit launcher (``-m hydra/launcher=slurm``), each Slurm job runs one task
per node, and each task does what ``torchrun --nnodes N`` would: it starts the node's ranks
with the same elastic launcher, the nodes meeting at a c10d rendezvous on the first node of
the allocation (``job_nodes``). ``SubmititCheck`` refuses a launcher config that cannot work
before anything is submitted.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import re
import sys
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch.distributed.elastic.rendezvous.registry as rdzv_registry
from hydra.experimental.callback import Callback
from omegaconf import DictConfig
from torch.distributed.elastic.agent.server.api import RunResult, WorkerSpec
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousParameters

from hybridrec.compat import decline_restarts
from hybridrec.config import Device, validate
from hybridrec.logs import JobLogging
from hybridrec.parallel_dims import Cuda
from hybridrec.trainer import USER_ERROR_EXIT, RankJob, run

log = logging.getLogger(__name__)


class RankError(Exception):
    """A user error (``trainer.USER_ERRORS``) that stopped a rank, as its one-line message."""


class _QuietUserErrors(logging.Filter):
    """The elastic agent logs every failed rank with a traceback; a rank stopped by a user
    error has none worth showing (``spawn`` prints its one line instead)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (str(record.msg).startswith("failed (exitcode") and record.args
                    and record.args[0] == USER_ERROR_EXIT)


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


def world_size(cfg: DictConfig) -> int:
    if already_launched():
        return int(os.environ["WORLD_SIZE"])
    return cfg.launcher.nproc_per_node * job_nodes().count


def launch(cfg: DictConfig, run_dir: str, job: Optional[RankJob] = None) -> dict[str, Any]:
    """Run ``job`` (default: training) on ``world_size(cfg)`` ranks and return rank 0's
    summary."""
    if already_launched():
        if cfg.launcher.nproc_per_node != 1:
            log.info("already launched (torchrun/srun): launcher.nproc_per_node is ignored")
        return run(cfg, run_dir, job=job)
    nproc, nodes = cfg.launcher.nproc_per_node, job_nodes()
    if nproc == 1 and nodes.count == 1 and not in_sweep():
        return run(cfg, run_dir, job=job)
    # Jobs of a sweep (-m) get processes of their own, one rank included: peak memory,
    # thread settings and library state of one job must not leak into the next.
    # The ranks are new processes: they get the Hydra job's logging (console, train.log).
    return spawn(run, nproc, cfg, run_dir, True, job, JobLogging.of_this_job(),
                 max_restarts=cfg.launcher.max_restarts, nodes=nodes)


def quiet_secondary_ranks() -> None:
    """Under torchrun every rank runs the Hydra entry point, and each would create its own
    timestamped run directory and log file. Ranks other than 0 write to a scratch directory
    instead; ``trainer.run`` then adopts rank 0's directory (broadcast once the process group
    is up). Call before Hydra parses the command line."""
    if already_launched() and os.environ["RANK"] != "0":
        scratch = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"hybridrec-rank{os.environ['RANK']}")
        sys.argv += [f"hydra.run.dir={scratch}", "hydra.output_subdir=null", "hydra/job_logging=none"]


def spawn(
    fn: Callable[..., Any], nproc: int, *args: Any, max_restarts: int = 0, nodes: Optional[Nodes] = None
) -> Any:
    """The lowest rank's return value (rank 0's on its node) of ``fn(*args)`` run on ``nproc``
    local ranks, started by PyTorch's elastic agent: c10d rendezvous (on a free local port
    for one node), workers started as ``start_method`` says. Tests and benchmarks use it
    too, so they start ranks exactly as users do. ``max_restarts`` (default 0: a failed rank fails the call) lets the
    agent stop and restart every rank after a crash, up to that many times, but never after
    a user error. With ``nodes``, this call is one node of several, as torchrun --nnodes.
    A rank that exits with USER_ERROR_EXIT raises ``RankError`` with the message it recorded."""
    nodes = nodes or Nodes(1, "localhost:0", f"hybridrec-{uuid.uuid4().hex[:8]}")
    # The elastic agent logs every state change at INFO; keep the user's console for training.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    agent_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    if not any(isinstance(f, _QuietUserErrors) for f in agent_log.filters):
        agent_log.addFilter(_QuietUserErrors())
    # When one rank fails, the others are stopped with SIGTERM, each logged: the failure
    # itself is what the user needs, and it is reported.
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    try:
        results = _run_agent(fn, args, nproc, nodes, max_restarts)  # keyed by global rank, this node's ranks only
    except ChildFailedError as e:
        stopped = sorted((rank, f) for rank, f in e.failures.items() if f.exitcode == USER_ERROR_EXIT)
        if stopped:
            raise RankError(stopped[0][1].message) from None
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


class _UserErrorsEndTheJob(LocalElasticAgent):
    """torch's local elastic agent, except that a rank stopped by a user error (bad rows, a
    checkpoint that does not fit, a plan that cannot be met) ends the job at once: restarted
    ranks would read the same config and files and fail the same way, max_restarts times."""

    def _monitor_workers(self, worker_group: Any) -> RunResult:
        result = super()._monitor_workers(worker_group)
        if result.is_failed() and any(f.exitcode == USER_ERROR_EXIT for f in result.failures.values()):
            decline_restarts(self)
        return result


def _run_agent(fn: Callable[..., Any], args: tuple, nproc: int, nodes: Nodes, max_restarts: int) -> dict[int, Any]:
    """What ``elastic_launch`` does (torch's launch_agent, the part a CPU or GPU job here
    uses), with the agent above: elastic_launch builds its LocalElasticAgent itself, and has
    no say in which failures it restarts."""
    params = RendezvousParameters(backend="c10d", endpoint=nodes.endpoint, run_id=nodes.run_id,
                                  min_nodes=nodes.count, max_nodes=nodes.count, timeout=900)  # elastic_launch's join timeout
    spec = WorkerSpec(role="default", local_world_size=nproc, entrypoint=fn, args=tuple(args),
                      rdzv_handler=rdzv_registry.get_rendezvous_handler(params), max_restarts=max_restarts,
                      monitor_interval=0.1)
    method = start_method(Cuda.probe())
    if method == "forkserver":
        multiprocessing.set_forkserver_preload(["hybridrec.trainer", fn.__module__])
    agent = _UserErrorsEndTheJob(spec, DefaultLogsSpecs(), start_method=method)
    close_rendezvous = True
    try:
        result = agent.run()
    except SignalException:
        close_rendezvous = False  # as torch's launcher: an agent stopped by a signal may be replaced
        raise
    finally:
        if close_rendezvous:
            spec.rdzv_handler.shutdown()
    if result.is_failed():
        raise ChildFailedError(name=getattr(fn, "__name__", str(fn)), failures=result.failures)
    return result.return_values


_SUBMITIT = "hydra_plugins.hydra_submitit_launcher.submitit_launcher."


def check_submitit(cfg: DictConfig) -> None:
    """Rules for Hydra's submitit launcher (hydra/launcher=slurm, local, submitit_*), checked
    in the submitting process: a layout that cannot start hybridrec's ranks fails before any
    job is queued. Then the config itself is validated for the job's world size."""
    hl = cfg.hydra.launcher
    target = str(hl.get("_target_", ""))
    if not target.startswith(_SUBMITIT):
        return
    local = target.endswith("LocalLauncher")
    nproc, device = cfg.launcher.nproc_per_node, cfg.launcher.device
    if hl.tasks_per_node != 1:
        raise ValueError(
            f"hydra.launcher.tasks_per_node={hl.tasks_per_node}: hybridrec runs one task per node, "
            f"which starts launcher.nproc_per_node ranks itself (as torchrun does); set "
            f"hydra.launcher.tasks_per_node=1 launcher.nproc_per_node={hl.tasks_per_node}"
        )
    if hl.nodes < 1 or (local and hl.nodes != 1):
        raise ValueError(
            f"hydra.launcher.nodes={hl.nodes}: must be >= 1"
            + (", and 1 with submitit's local executor (use hydra/launcher=slurm for several)" if local else "")
        )
    if hl.timeout_min < 1:
        raise ValueError(f"hydra.launcher.timeout_min must be >= 1, got {hl.timeout_min}")
    # GPUs the job gets per node: gpus_per_node, or a gres such as gpu:8 / gpu:a100:8.
    gres = re.fullmatch(r"gpu(?::[^:,]+)?:(\d+)", str(hl.get("gres") or ""))
    gpus = hl.gpus_per_node or (int(gres.group(1)) if gres else 0)
    if device == Device.cuda and gpus < nproc:
        raise ValueError(
            f"launcher.device=cuda starts {nproc} rank(s) per node, one GPU each, but the job asks "
            f"for {gpus} GPU(s) per node: set hydra.launcher.gpus_per_node={nproc}"
        )
    if device != Device.cpu and gpus and gpus != nproc:
        raise ValueError(
            f"hydra.launcher.gpus_per_node={gpus} but launcher.nproc_per_node={nproc}: one rank per "
            f"GPU, so they must be equal (or launcher.device=cpu)"
        )
    validate(cfg, hl.nodes * nproc)


class SubmititCheck(Callback):
    """Hydra callback (hydra.callbacks in conf/config.yaml): runs ``check_submitit`` once,
    before the launcher submits the sweep's jobs."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            check_submitit(config)
        except ValueError as e:
            sys.exit(f"hybridrec: invalid launcher config: {e}")
