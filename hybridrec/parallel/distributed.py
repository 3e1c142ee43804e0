"""Process groups: where a rank finds its place on the node, how the default group is set
up, checked and torn down, and how a launched rank's process ends. Every entry (the
trainer's ``run``, the evaluator, the test and benchmark helpers) goes through these
functions, so there is one way to start a rank.
"""

from __future__ import annotations

import ctypes
import datetime
import gc
import os
import signal
import sys
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.distributed as dist


class LaunchError(ValueError):
    """The launcher's environment does not say where this rank runs (a user's launch error)."""


@dataclass(frozen=True)
class LocalLayout:
    rank: int
    """This rank's index on its node (selects its GPU)."""
    world_size: int
    """Ranks on this node."""


def _slurm_tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """Slurm's SLURM_TASKS_PER_NODE ("4(x2),3": 4 tasks on each of 2 nodes, then 3) for one node."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        n, _, times = part.partition("(x")
        counts += [int(n)] * (int(times.rstrip(")")) if times else 1)
    return counts[node_id]


def local_layout(env: Mapping[str, str] = os.environ) -> LocalLayout:
    """This rank's place on its node, from the launcher's environment.

    torchrun and the elastic launcher set LOCAL_RANK / LOCAL_WORLD_SIZE; ``srun`` sets
    SLURM_LOCALID / SLURM_TASKS_PER_NODE, from which they are derived. A rank of a
    multi-rank job with neither is refused: guessing would put every rank on cuda:0 and
    plan the job as one node.
    """
    rank, size = env.get("LOCAL_RANK", env.get("SLURM_LOCALID")), env.get("LOCAL_WORLD_SIZE")
    if size is None and "SLURM_TASKS_PER_NODE" in env:
        size = str(_slurm_tasks_on_node(env["SLURM_TASKS_PER_NODE"], int(env.get("SLURM_NODEID", 0))))
    if (rank is None or size is None) and int(env.get("WORLD_SIZE", 1)) > 1:
        raise LaunchError(
            "RANK/WORLD_SIZE are set but not LOCAL_RANK and LOCAL_WORLD_SIZE (nor Slurm's SLURM_LOCALID and "
            "SLURM_TASKS_PER_NODE): launch with torchrun or srun, or export LOCAL_RANK and LOCAL_WORLD_SIZE"
        )
    return LocalLayout(int(rank or 0), int(size or 1))


_PR_SET_PDEATHSIG = 1  # prctl(2)
_forks_tied = False


def _kill_me_when_parent_ends(libc: ctypes.CDLL) -> None:
    # SIGKILL: neither a DataLoader worker nor a rank whose launcher is gone has anything
    # left to save.
    libc.prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGKILL))


def as_launched_rank(parent_ends_it: bool = False) -> None:
    """Process settings of a rank that a launcher started and stops (hybridrec's launcher,
    torchrun). Call from the rank's main thread, before it forks.

    SIGTERM and SIGINT end the rank at once, without a word: the launcher stops its ranks
    with the signal it received, a terminal's Ctrl-C reaches every rank directly, and the
    launcher reports. A Python handler (KeyboardInterrupt) would wait until the collective
    the rank is in returns, up to launcher.collective_timeout_s, and print a traceback.

    Every process the rank forks (DataLoader workers) is killed when the rank ends, however
    it ends: torch's workers otherwise poll for their parent only every 5 s. The kernel sends
    the signal when the forking thread ends: the DataLoader forks from the main thread.

    ``parent_ends_it``: the rank is killed when its parent ends, for a parent that is the
    launcher itself (torchrun's agent), so a launcher killed with SIGKILL leaves no rank
    training on.
    """
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    if sys.platform != "linux":
        return
    tie_forks_to_this_process()
    if parent_ends_it:
        _kill_me_when_parent_ends(ctypes.CDLL(None, use_errno=True))


def tie_forks_to_this_process() -> None:
    """Every process this one forks from now on (DataLoader workers) is killed when the
    thread that forked it ends, however this process ends (Linux; elsewhere nothing)."""
    global _forks_tied
    if sys.platform != "linux" or _forks_tied:  # hooks cannot be removed: one is enough
        return
    libc = ctypes.CDLL(None, use_errno=True)  # loaded here: not in a child just forked
    os.register_at_fork(after_in_child=lambda: _kill_me_when_parent_ends(libc))
    _forks_tied = True


def backend(device: torch.device, cpu_offload: bool = False) -> str:
    """The default group's backend: gloo on CPU, NCCL on CUDA.

    With FSDP2's CPU offload the gradients live on the CPU, so gradient clipping all-reduces
    CPU tensors, which NCCL cannot do: such a job gets a group with both backends, each
    tensor going to its device's (as torchtitan does)."""
    if device.type != "cuda":
        return "gloo"
    return "cuda:nccl,cpu:gloo" if cpu_offload else "nccl"


def init_distributed(device: torch.device, timeout_s: float = 300.0, cpu_offload: bool = False) -> None:
    """The default process group, however the rank was started (a single process gets one too,
    so there is one code path)."""
    kind = backend(device, cpu_offload)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before NCCL's first communicator: it binds to the current device
    timeout = datetime.timedelta(seconds=timeout_s)  # every collective's timeout
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # Started by the elastic agent, whose store outlives restarts. Prefix this attempt's
        # keys: after a restart, gloo otherwise read the dead attempt's peer addresses from
        # the shared store and failed to connect (seen on torch 2.13).
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
        )
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(
            kind,
            store=dist.PrefixStore(f"hybridrec/attempt_{attempt}", store),
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=timeout,
        )
    elif "RANK" in os.environ:  # another launcher (e.g. srun): rendezvous through env://
        dist.init_process_group(kind, timeout=timeout)
    else:
        dist.init_process_group(kind, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def health_check(timeout_s: float) -> None:
    """One monitored barrier across all ranks: a rank that does not answer in time is named
    (gloo's monitored_barrier reports which ranks failed) instead of everyone hanging. NCCL
    has no monitored barrier, so GPU jobs run it on a gloo group."""
    group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    try:
        dist.monitored_barrier(group, timeout=datetime.timedelta(seconds=timeout_s), wait_all_ranks=True)
    except RuntimeError as e:
        raise RuntimeError(f"health check: not every rank answered within {timeout_s:g} s: {e}") from e


def shutdown_distributed(clean: bool) -> None:
    """Release everything that holds a process group, then destroy the groups.

    The model, pipeline and FSDP2 mesh keep references to gloo/NCCL groups (TorchRec creates
    sub-groups too); left to interpreter shutdown, their transport threads are torn down in
    arbitrary order, which can abort a rank after a successful run. On failure, skip the
    collective destroy, which could block on a peer that is still inside a collective
    (as torchtitan does); the launcher then stops the other ranks.
    """
    gc.collect()
    if clean:
        dist.destroy_process_group()
