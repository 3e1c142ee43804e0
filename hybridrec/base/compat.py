"""Every use of a private TorchRec, torch or Hydra attribute, in one place, and what an older
torch lacks.

The pins (constraints.txt: torch 2.13.0, torchrec 1.8.0, hydra-core 1.3.2) are what these were
read against; a version bump breaks them here, not across the package. Each function says
which public API is missing.

hybridrec also runs on the torch a GPU host already has, 2.11 to 2.13 with the matching
fbgemm-gpu and torchrec (1.6.x to 1.8.x; ``hybridrec/install_check.py --pairs`` names them):
what 2.11 lacks is supplied here (``read_proc_state``, ``agent_kwargs``), each fallback
tested by hiding the newer API (tests/test_compat.py).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, cast

import torch
from torch import nn

# ShardedTensor lives under torch.distributed._shard: TorchRec's sharded tables are
# ShardedTensors, and torch has no public import path for the class while it deprecates it.
from torch.distributed._shard.sharded_tensor import ShardedTensor  # noqa: F401  (re-exported)

# DCP's planner puts a loaded non-tensor value back into the nested state dict with this
# helper; a planner that loads those values safely (checkpoint.SafeLoadPlanner) needs it too.
from torch.distributed.checkpoint._traverse import set_element  # noqa: F401  (re-exported)
from torch.distributed.elastic.agent.server.api import RunResult
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.utils._pytree import tree_map_only  # noqa: F401  (re-exported: no public pytree map by type)
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.types import Topology

if TYPE_CHECKING:
    from torch.utils._config_module import ConfigModule

_torch_proc_state: Callable[[int], str | None] | None
try:  # torch >= 2.12
    from torch.distributed.elastic.utils.process_state import read_proc_state as _torch_proc_state
except ImportError:  # torch 2.11: the module does not exist
    _torch_proc_state = None


def dmp_root(dmp: DistributedModelParallel) -> nn.Module:
    """The module DMP wraps, as the data-parallel wrapper must see it. ``dmp.module`` is the
    public accessor, but it unwraps DDP/FSDP and so is not the object FSDP2's root
    ``fully_shard`` must be applied to while DMP is still building its wrapper."""
    return dmp._dmp_wrapped_module


def planner_topology(planner: EmbeddingShardingPlanner) -> Topology:
    """The topology the planner was built with (kept only privately by the planner)."""
    return planner._topology


def planner_options(planner: EmbeddingShardingPlanner, module: nn.Module, sharders: list) -> list:
    """Every sharding option the planner's enumerator offers: the planner exposes no way to
    ask why no plan fits, so the error message enumerates the options itself."""
    return planner._enumerator.enumerate(module, sharders)


def planner_reserved_share(planner: EmbeddingShardingPlanner) -> float:
    """The share of device memory the planner's storage reservation holds back (no public
    getter on either reservation policy; 0 when the policy has none)."""
    return getattr(planner._storage_reservation, "_percentage", 0.0)


def floating_to(x: Any, dtype: torch.dtype) -> Any:
    """Every floating-point tensor in a nested structure cast to ``dtype``."""
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, x)


@contextlib.contextmanager
def one_post_forward_mesh() -> Iterator[None]:
    """Inside: every ``fully_shard`` with ``reshard_after_forward=N`` (an int) on the same mesh
    shares one post-forward mesh. FSDP2 builds a new DeviceMesh, with new process groups
    (NCCL communicators), for each call; there is no public way to pass one in."""
    import torch.distributed.fsdp._fully_shard._fully_shard as fs

    build, meshes = fs._get_post_forward_mesh_info, {}

    def shared(reshard_after_forward: Any, mesh_info: Any) -> Any:
        if isinstance(reshard_after_forward, bool):
            return build(reshard_after_forward, mesh_info)
        key = (reshard_after_forward, id(mesh_info.mesh))
        if key not in meshes:
            meshes[key] = build(reshard_after_forward, mesh_info)
        return meshes[key]

    fs._get_post_forward_mesh_info = shared
    try:
        yield
    finally:
        fs._get_post_forward_mesh_info = build


def size_oblivious_export() -> Any:
    """A context in which ``torch.export`` keeps a dynamic dimension general for sizes 0 and
    1 too. By default it specializes on them, so a program traced for a batch of rows
    refuses a batch of one row (a guard failure at call time). The switch is the one torch's
    export tutorial documents as experimental: ``torch.fx.experimental._config``."""
    import torch.fx.experimental._config as fx_config

    # install_config_module made the module a ConfigModule (its patch, save_config, ...); the
    # patch("key", value) form, as ConfigModule types patch(key=value)'s value as a dict
    return cast("ConfigModule", fx_config).patch("backed_size_oblivious", True)


def failed_job_error(job_return: Any) -> BaseException:
    """The exception a failed Hydra job raised (``hydra.core.utils.JobReturn``): the public
    ``return_value`` re-raises it, after writing "Error executing job" to stderr, which a
    callback that only records the failure must not do; the dataclass keeps it in a field."""
    return job_return._return_value


def read_proc_state(pid: int) -> str | None:
    """The one-letter state of process ``pid`` (R, S, D, T, Z, ...) from /proc, None when it is
    gone: torch's ``process_state.read_proc_state`` (torch >= 2.12), or the same reading of
    ``/proc/<pid>/stat`` where torch has none."""
    if _torch_proc_state is not None:
        return _torch_proc_state(pid)
    return own_proc_state(pid)


def own_proc_state(pid: int) -> str | None:
    """``/proc/<pid>/stat``'s state field: after the command name, which may hold spaces and
    parentheses, hence the last ")"."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except OSError:
        return None
    rest = data[data.rfind(")") + 1 :].split()
    return rest[0] if rest else None


def agent_kwargs(shutdown_timeout: int, cls: type[Any] = LocalElasticAgent) -> dict[str, Any]:
    """Keyword arguments for torch's ``LocalElasticAgent`` (``cls``) that its torch accepts:
    torch 2.12 added ``shutdown_timeout`` (the grace before a worker that ignores SIGTERM is
    killed); an older agent keeps its fixed 30 s."""
    if "shutdown_timeout" in inspect.signature(cls.__init__).parameters:
        return {"shutdown_timeout": shutdown_timeout}
    return {}


class ExtensibleAgent(LocalElasticAgent):
    """torch's local elastic agent (what ``torchrun`` and ``elastic_launch`` run) with public
    hooks. Torch documents subclassing the agent and extending ``_monitor_workers`` as the
    way to add policy ("Elastic Agent: Extending the Agent"), but the methods and the restart
    counter are underscored: this class is the only code that touches them."""

    def workers_starting(self, worker_group: Any) -> None:
        """Called before each start of the workers (the first and every restart)."""

    def before_check(self, worker_group: Any) -> None:
        """Called before each monitoring pass (every ``monitor_interval`` seconds)."""

    def after_check(self, worker_group: Any, result: RunResult) -> None:
        """Called with each monitoring pass's result."""

    def decline_restarts(self) -> None:
        """End the job at this failure instead of restarting the workers: the agent restarts
        while its ``_remaining_restarts`` is above 0, and has no public way to refuse one."""
        self._remaining_restarts = 0

    @property
    def restarts_left(self) -> int:
        """Restarts the agent will still make after a failure (no public getter)."""
        return self._remaining_restarts

    def _start_workers(self, worker_group: Any) -> dict[int, Any]:
        self.workers_starting(worker_group)
        return super()._start_workers(worker_group)

    def _monitor_workers(self, worker_group: Any) -> RunResult:
        self.before_check(worker_group)
        result = super()._monitor_workers(worker_group)
        self.after_check(worker_group, result)
        return result


def record_error_message(message: str) -> bool:
    """Write ``message`` as this worker's error for its elastic agent, which reads it back into
    ``ChildFailedError`` (what the launcher then reports). The file is the documented
    TORCHELASTIC_ERROR_FILE, but torch writes it only from an exception (``@record``), with
    its traceback; the JSON layout below is the one its error handler reads. False when the
    worker was not started by an agent."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    with open(path, "w") as f:
        json.dump({"message": message, "timestamp": int(time.time())}, f)
    return True


class AgentFailureLogFilter(logging.Filter):
    """Drops the elastic agent's log lines about worker failures that ``hide(exitcode, pid)``
    says are reported otherwise, and its lines about the signal that stops the job. Matched
    on torch's own message formats, which are not an API: the format strings are read here."""

    LOGGERS = ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api")

    def __init__(self, hide: Callable[[Any, Any], bool]) -> None:
        super().__init__()
        self.hide = hide

    def filter(self, record: logging.LogRecord) -> bool:
        # torch's agent formats its lines with positional args: a tuple, never a mapping
        msg, args = str(record.msg), cast("tuple[Any, ...]", record.args or ())
        if msg.startswith("failed (exitcode") and len(args) > 2:  # (exitcode, local_rank, pid, ...)
            return not self.hide(args[0], args[2])
        return not msg.startswith(("Received %s death signal", "Closing process %s via signal"))

    @classmethod
    def install(cls, hide: Callable[[Any, Any], bool]) -> None:
        """On the agent's loggers, once per process."""
        for name in cls.LOGGERS:
            agent_log = logging.getLogger(name)
            if not any(isinstance(f, cls) for f in agent_log.filters):
                agent_log.addFilter(cls(hide))


def dataloader_worker_exits(iterator: Any) -> list[tuple[int, int]]:
    """(pid, exit code) of the worker processes of a DataLoader's iterator that have ended.
    When one dies, DataLoader raises "worker (pid(s) N) exited unexpectedly" without the
    signal; its workers are ``multiprocessing.Process`` objects kept in the private
    ``_workers`` of its multi-process iterator."""
    workers = getattr(iterator, "_workers", None) or []
    return [(w.pid, w.exitcode) for w in workers if w.exitcode is not None]


def pipeline_model(pipeline: Any) -> nn.Module:
    """The model a TorchRec train pipeline drives (kept only in its private ``_model``)."""
    return pipeline._model


def stop_rendezvous_heartbeats(handler: Any) -> None:
    """Stop a c10d rendezvous handler's keep-alive thread, from this thread, without closing
    the rendezvous (an agent stopped by a signal leaves it open, as torch's launcher does, so
    that a replacement may join). torch has no public call for it: left running, the thread's
    timer is stopped by a ``weakref.finalize`` whenever the handler is collected, and when that
    happens on the keep-alive thread itself, its ``join`` prints "Exception ignored ...
    RuntimeError: cannot join current thread" under the one line a stopped run ends with."""
    stop = getattr(handler, "_stop_heartbeats", None)  # DynamicRendezvousHandler (c10d), torch 2.11 to 2.13
    if stop is not None:
        stop()
