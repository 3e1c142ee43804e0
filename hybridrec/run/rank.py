"""The rank program: what every rank of a job runs, whichever launcher started it.

``run`` sets the rank's device and threads, brings up the process group, runs a job
(training by default: ``trainer.train_job``; ``scoring.ScoreCheckpoint`` for a saved model)
and tears the group down. The same function runs in the Hydra process for one rank, in each
process the local launcher starts (``launch.spawn``, torch's elastic agent) and in each
process torchrun or srun started (``launch.launch`` calls it there directly).
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from typing import Any, Callable, Iterable, Mapping, Optional

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch.distributed.elastic.multiprocessing.errors import record

from hybridrec.base.compat import record_error_message
from hybridrec.base.signals import Killed
from hybridrec.data.loader import worker_killed
from hybridrec.parallel.devices import pick_device
from hybridrec.parallel.distributed import health_check, init_distributed, local_layout, shutdown_distributed
from hybridrec.reports.logs import JobLogging, configure_rank
from hybridrec.run.errors import USER_ERROR_EXIT, USER_ERRORS, full_errors, out_of_memory
from hybridrec.training.trainer import train_job


def _quiet_deprecations() -> None:
    # Notices about the libraries' own internals that a user can do nothing about: TorchRec's
    # embedding shards are ShardedTensors, and FSDP2 calls collectives torch has renamed.
    # Matched by message, so any other warning still shows.
    for message in (
        "Please use DTensor instead and we are deprecating ShardedTensor",
        r"`torch.distributed.\w+` is deprecated",
    ):
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)


log = logging.getLogger("hybridrec.rank")
IDLE_WINDOW_S = 0.3
"""How long the cores are watched for what is idle before the threads are chosen."""


def _cpu_ticks(stat: str, cpus: set[int]) -> dict[int, tuple[int, int]]:
    """Per CPU of ``cpus``: its idle ticks (idle + iowait) and all its ticks, from /proc/stat."""
    out = {}
    with open(stat) as f:
        for line in f:
            name, *fields = line.split()
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
                ticks = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
                out[int(name[3:])] = (ticks[3] + ticks[4], sum(ticks))
    return out


def idle_cores(cpus: Iterable[int], window_s: float = IDLE_WINDOW_S, stat: str = "/proc/stat") -> Optional[float]:
    """How many of ``cpus`` sat idle over ``window_s``, in cores (Linux's per-CPU counters in
    /proc/stat); None where they cannot be read."""
    wanted = set(cpus)
    try:
        before = _cpu_ticks(stat, wanted)
        time.sleep(window_s)
        after = _cpu_ticks(stat, wanted)
    except (OSError, ValueError, IndexError):
        return None
    if not before or before.keys() != after.keys():
        return None
    idle = 0.0
    for cpu, (was_idle, was_total) in before.items():
        now_idle, now_total = after[cpu]
        idle += (now_idle - was_idle) / (now_total - was_total) if now_total > was_total else 1.0
    return idle


def intra_op_threads(
    cfg: DictConfig, env: Mapping[str, str], idle: Callable[..., Optional[float]] = idle_cores
) -> Optional[int]:
    """The rank's intra-op thread count, or None to leave torch's (OMP_NUM_THREADS) as is.

    Unset (``launcher.threads_per_rank``, OMP_NUM_THREADS): the node's cores split between its
    ranks, but no more than the cores idle now. N local ranks each at every core oversubscribe
    the CPU (torchrun sets OMP_NUM_THREADS=1 for this reason; elastic_launch does not); and a
    core another process keeps busy stalls every parallel region, whose OpenMP threads wait
    for the one that shares that core (measured: 3x slower than one thread with one busy
    neighbour on 2 cores, docs/performance.md). On GPUs too: each rank's input pipeline,
    optimizer on CPU and host-side work share the cores."""
    if cfg.launcher.threads_per_rank:
        return int(cfg.launcher.threads_per_rank)
    if "OMP_NUM_THREADS" in env:
        return None
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    world = local_layout(env).world_size
    share = max(1, len(cpus) // world)
    if (free := idle(cpus)) is not None:
        share = max(1, min(share, int(free / world + 0.5)))  # the idle cores, split, to the nearest
        if share < len(cpus) // world:
            log.info(
                f"intra-op threads: {share} per rank ({free:.1f} of {len(cpus)} cores idle: other work is "
                f"running; launcher.threads_per_rank sets the count)"
            )
    return share


RankJob = Callable[[DictConfig, str, torch.device], Mapping[str, Any]]
"""What a rank does once its process group is up: ``job(cfg, run_dir, device)`` -> its result
(a summary: a TypedDict, ``RunSummary`` or ``ScoreSummary``)."""


@record  # under the elastic launcher, a failing rank's traceback reaches the user
def run(
    cfg: DictConfig,
    run_dir: str,
    parent_reports: bool = False,
    job: Optional[RankJob] = None,
    job_logging: Optional[JobLogging] = None,
) -> Mapping[str, Any]:
    """One rank's whole job: process group, ``job`` (default: training; ``ScoreCheckpoint``
    for ``python -m hybridrec.evaluate``), teardown. Returns the job's result (a summary).

    ``parent_reports``: the rank was started by ``launch.spawn``, which prints a user error's
    one line itself; the rank then records the message in the elastic error file and exits
    quietly with USER_ERROR_EXIT. Otherwise a user error propagates to the caller.
    ``job_logging``: the Hydra job's logging, for a rank in a process of its own."""
    device = pick_device(cfg)
    if threads := intra_op_threads(cfg, os.environ):
        torch.set_num_threads(threads)
    init_distributed(device, cfg.launcher.collective_timeout_s, cfg.mesh.cpu_offload)
    summary = None
    try:
        health_check(cfg.launcher.health_check_timeout_s)
        configure_rank(dist.get_rank(), job_logging)
        _quiet_deprecations()
        # Under torchrun every rank ran Hydra on its own; rank 0's run directory is the one.
        shared = [run_dir]
        dist.broadcast_object_list(shared, src=0)
        summary = (job or train_job)(cfg, shared[0], device)  # what it built is freed when it returns
        dist.barrier()  # leave together: no rank tears down while another still communicates
        return summary
    except USER_ERRORS as e:
        if parent_reports and not full_errors() and record_error_message(str(e)):
            sys.exit(USER_ERROR_EXIT)
        raise
    except torch.OutOfMemoryError as e:
        oom = out_of_memory(e, dist.get_rank())
        if parent_reports and not full_errors() and record_error_message(str(oom)):
            sys.exit(USER_ERROR_EXIT)
        raise oom from None
    except (Killed, RuntimeError) as e:  # a DataLoader worker of this rank was killed: one line
        killed = e if isinstance(e, Killed) else worker_killed(e, dist.get_rank())
        if killed is None:
            raise  # a bug: its traceback
        if parent_reports and not full_errors() and record_error_message(str(killed)):
            sys.exit(killed.exit_code)
        raise killed from None
    finally:
        shutdown_distributed(clean=summary is not None)
