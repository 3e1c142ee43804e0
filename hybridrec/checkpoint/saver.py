"""Saving: what a rank's checkpoint holds (``Resumable``), the ``Checkpointer`` that writes
``step_<N>.partial`` and commits it once the state is known sane, the staging copy of an
asynchronous save, and the lock that keeps one run per directory."""

from __future__ import annotations

import copy
import errno
import fcntl
import logging
import math
import os
import shutil
import socket
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, NoReturn, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from hybridrec.base.compat import ShardedTensor
from hybridrec.checkpoint.compatibility import writer_of
from hybridrec.checkpoint.errors import CheckpointError, Diverged, one_line, root_cause
from hybridrec.checkpoint.safety import CONFIG_YAML
from hybridrec.checkpoint.state import TrainState, check_complete, committed, hash_files, own_files
from hybridrec.config.objective import Selection
from hybridrec.data import SparseFeature
from hybridrec.parallel.optim import TrainOptimizer

log = logging.getLogger(__name__)
LOCK = ".lock"  # in checkpoint.dir: held by the run writing there


@dataclass
class Resumable:
    """What a checkpoint saves from one rank and a resume restores into it, named explicitly:
    the checkpoint code sees nothing else of the trainer."""

    model: nn.Module
    optimizer: TrainOptimizer
    """Its combined sparse + dense optimizer and the LR schedulers."""
    features: list[SparseFeature]
    """The sparse features: export rebuilds the model from them, without the data files."""
    num_dense_features: int
    losses: list[float]
    """The global mean loss of every step so far (the trainer appends; a resume refills it)."""
    runs: list[str]
    """This run's id after the ids of the runs it continues: what keep_last may delete."""
    selection: Selection
    """The best validation evaluation so far (keep_best, early stopping)."""
    stream: dict[str, Any] = field(default_factory=dict)
    """train.schedule=continuous: the stream's state (``hybridrec.training.continuous.Stream.state``),
    kept current by the trainer; empty otherwise."""
    history: list[dict[str, Any]] = field(default_factory=list)
    """Rank 0: the run's metrics.jsonl records so far (``hybridrec.reports.runlog.MetricsLog.records``),
    saved with each checkpoint as they are at its step; empty on the other ranks."""

    data_version: Optional[int] = None
    """``Source.version`` of the data (recorded: a resume onto rows another version draws is refused)."""

    def dcp_state(self) -> dict[str, Any]:
        """What DCP saves and loads in place: the sharded model and optimizer state."""
        return {"model": self.model.state_dict(), "optim": self.optimizer.optimizer.state_dict()}

    def train_state(self, step: int) -> TrainState:
        """The rest, after ``step`` (collective: gathers every rank's RNG state)."""
        rng: list[Any] = [None] * dist.get_world_size()  # every rank's RNG state, once gathered
        dist.all_gather_object(rng, torch.get_rng_state())
        return TrainState(
            step=step,
            schedulers=copy.deepcopy([s.state_dict() for s in self.optimizer.schedulers]),
            features=[vars(f) for f in self.features],
            num_dense_features=self.num_dense_features,
            rng=torch.stack(rng),
            losses=torch.tensor(self.losses, dtype=torch.float64),
            runs=list(self.runs),
            selection=self.selection.to_dict(),
            stream=copy.deepcopy(self.stream),
            history=copy.deepcopy(self.history),  # as at this step: later records are not this checkpoint's
            data_version=self.data_version,
        )


@dataclass
class _Pending:
    """A save written (or being written) to ``partial``, not yet committed."""

    step: int
    partial: str
    final: str
    state: TrainState
    write: Future
    """DCP's save, then this rank's checksums (``own_files``): done at once without async_save."""
    confirmed: bool = False
    """The loss of a later step (or the final evaluation) was finite: the state may be committed."""


class Checkpointer:
    """Saves the trainer's state every ``checkpoint.every_n_steps`` and at the end, and
    commits a save only once the state is known sane (the module docstring): ``save(N)``
    writes ``step_<N>.partial``; the trainer calls ``confirm(M)`` once the losses up to a
    step M > N are finite, or ``finish(ok)`` after the final evaluation; ``discard()`` drops
    a save of a run that diverged.

    With ``checkpoint.async_save``, DCP first copies the state into CPU staging memory and
    writes it from a background thread while training goes on; the checkpoint is committed
    once that write has finished and the save is confirmed, at the next save or at the end.
    Its background collectives run on a gloo group of their own, so they never interleave
    with the training's collectives.
    """

    def __init__(
        self, cfg: DictConfig, live: Resumable, device: torch.device, resumed_from: Optional[str] = None
    ) -> None:
        self.run_cfg, self.cfg, self.live, self.device = cfg, cfg.checkpoint, live, device
        self.rank = dist.get_rank()
        self.group = dist.new_group(backend="gloo") if self.cfg.async_save else None
        # A new thread starts on cuda:0: the writer is put on this rank's GPU before DCP
        # touches any device state (its planning runs on the group's device).
        self.writer = ThreadPoolExecutor(
            max_workers=1, initializer=_use_device, initargs=(device,), thread_name_prefix="hybridrec-ckpt"
        )
        self.pending: Optional[_Pending] = None
        # Called on rank 0 after each commit, with the step and the checkpoint (a continuous
        # run's export of deltas to serving); the other ranks wait for it at the barrier.
        self.on_commit: Optional[Callable[[int, str], None]] = None
        self.last: Optional[str] = resumed_from  # the newest committed checkpoint of this run's training
        # Checkpoints known loadable without hashing them again: those this process committed
        # or verified (keep_last counts only loadable ones).
        self.loadable: set[str] = {os.path.realpath(resumed_from)} if resumed_from else set()

    def path(self, step: int) -> str:
        """Where the checkpoint of ``step`` is committed."""
        return os.path.join(self.cfg.dir, f"step_{step:08d}")

    def save(self, step: int) -> None:
        """Write the state after ``step`` (collective). Commits the previous save first, which
        must have been confirmed: the trainer checks the losses before every save."""
        self.commit()
        if bad := _non_finite(self.live.dcp_state(), self.device):
            what = "weights" if bad.startswith("model.") else "optimizer state"
            raise Diverged(
                f"non-finite {what} after step {step} ({bad}): the model diverged (a learning rate too "
                f"high is the usual cause); nothing of step {step} was saved; {self.resume_hint()}"
            )
        final = self.path(step)
        partial = final + ".partial"
        if self.rank == 0:
            try:
                shutil.rmtree(partial, ignore_errors=True)
                os.makedirs(partial)
            except OSError as e:
                self._abandon(step, partial, e)
        dist.barrier()
        state = self.live.train_state(step)  # captured now, written at commit
        if self.cfg.async_save:
            # DCP's async_save cannot stage TorchRec's ShardedTensors (no data_ptr), so
            # copy the state here and run DCP's save on the copy in a background thread:
            # what async_save does, with a stager that knows ShardedTensors.
            write = self.writer.submit(_write, _stage(self.live.dcp_state()), partial, self.rank, self.group)
        else:
            write = Future()
            try:
                write.set_result(_write(self.live.dcp_state(), partial, self.rank, None))
            # DCP wraps every rank's failure in a CheckpointException (a BaseException), on every rank
            except (CheckpointException, OSError) as e:
                self._abandon(step, partial, e)
        self.pending = _Pending(step, partial, final, state, write)

    def confirm(self, step: int, losses: list[float]) -> None:
        """``losses`` (the global loss of every step so far) are checked finite up to ``step``:
        a save of an earlier step is committed (now without async_save; with it, at the next
        save or at the end) if the loss of the step after it did not explode
        (``checkpoint.max_loss_ratio``), else dropped with a warning."""
        if not self.pending or self.pending.step >= step:
            return
        after = losses[self.pending.step]
        if over := exploded(after, losses[: self.pending.step], self.cfg.max_loss_ratio):
            if self.rank == 0:
                log.warning(
                    f"checkpoint {self.pending.final} not committed: the loss of the step after it, "
                    f"{after:.4g}, is {over} (the model is diverging)"
                )
            self.discard()
            return
        self.pending.confirmed = True
        if not self.cfg.async_save:
            self.commit()

    def finish(self, ok: bool) -> None:
        """The end of training: commit the last save if ``ok`` (the final evaluation's scores
        were finite), else drop it."""
        self.settle(ok)
        self.writer.shutdown()

    def settle(self, ok: bool) -> None:
        """Commit the last save now if ``ok``, else drop it, with no later step to confirm it:
        the end of training, or a continuous run about to wait for data (collective)."""
        if self.pending and ok:
            self.pending.confirmed = True
            self.commit()
        self.discard()

    def discard(self) -> None:
        """Drop a save that will not be committed (the training diverged after it)."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        pending.write.exception()  # wait for the write: its files are removed next
        if self.rank == 0:
            shutil.rmtree(pending.partial, ignore_errors=True)
        if self.live.selection.best_checkpoint == pending.final:
            self.live.selection.best_checkpoint = None  # the best model's save was dropped
            if self.rank == 0:
                log.warning(
                    f"the best validation evaluation (step {pending.step}) has no checkpoint: its save was "
                    f"not committed"
                )

    def resume_hint(self) -> str:
        """Where a diverged run can go on from, for its one-line error."""
        if self.last:
            return (
                f"the newest committed checkpoint, {self.last}, was followed by a finite loss: resume from it "
                f"with a lower learning rate (checkpoint.resume=auto)"
            )
        return "no checkpoint of this run was committed"

    def commit(self) -> None:
        """Commit the pending save, if any (collective): after its write and its confirmation."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        assert pending.confirmed, f"step {pending.step}'s save was not confirmed before the next save"
        step, partial, final, state = pending.step, pending.partial, pending.final, pending.state
        try:
            hashes = pending.write.result()
        except (CheckpointException, OSError) as e:
            self._abandon(step, partial, e)
        every: list[Any] = [None] * dist.get_world_size()  # every rank's file hashes, once gathered
        dist.all_gather_object(every, hashes)  # every rank's files are written, and their checksums here
        if self.rank == 0:
            if os.path.isdir(final) and writer_of(final) not in self.live.runs:
                shutil.rmtree(partial, ignore_errors=True)
                raise CheckpointError(
                    f"{final} was written by another run: not replaced (saving step {step}); use another checkpoint.dir"
                )
            for part in every:
                state.files.update(part)
            try:
                if unhashed := sorted(set(os.listdir(partial)) - set(state.files)):
                    # DCP named a file otherwise than own_files expects: a torch upgrade, not a user error
                    raise RuntimeError(f"{partial}: no rank hashed {unhashed[0]}: update checkpoint.own_files")
                OmegaConf.save(self.run_cfg, os.path.join(partial, CONFIG_YAML), resolve=True)
                state.to_files(partial)
                _fsync_dir(partial)
                shutil.rmtree(final, ignore_errors=True)  # a re-run of the same step (this run's) replaces it
                os.replace(partial, final)  # the commit: atomic on one filesystem
                _fsync_dir(self.cfg.dir)
            except OSError as e:
                self._abandon(step, partial, e)
            self.loadable.add(os.path.realpath(final))
            self._prune()
            if self.on_commit:
                self.on_commit(step, final)
        self.last = final
        dist.barrier()
        log.info(f"checkpoint committed: {final}")

    def _abandon(self, step: int, partial: str, error: BaseException) -> NoReturn:
        """A save that failed: remove what it wrote and, when the cause is the storage (disk
        full, read-only, permissions, I/O), say why in one line. Nothing else was touched, so
        the previous checkpoint stays loadable. Any other cause is a bug: its traceback is kept."""
        cause = root_cause(error)
        what, fix = _storage_problem(cause, self.cfg.dir)  # before the removal frees space and inodes
        free = _free(self.cfg.dir)
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        # torch's zip writer reports a short write (a full disk) as "unexpected pos", not OSError
        if not (isinstance(cause, OSError) or "unexpected pos" in str(cause)):
            raise error
        previous = self.last
        removed = (
            f"removed the partial save {partial}"
            if not os.path.exists(partial)
            else f"left the partial save {partial} (resume never picks a .partial)"
        )
        raise CheckpointError(
            f"checkpoint save at step {step} failed{': ' + what if what else ''} ({type(cause).__name__}: "
            f"{one_line(cause)}; {free} in checkpoint.dir={self.cfg.dir}); {removed}; "
            + (f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint of this run")
            + f". {fix}"
        ) from error

    def _prune(self) -> None:
        """Delete all but the newest ``keep_last`` loadable checkpoints written by this run and
        the runs it continues: never one another run wrote, nor one whose writer is unknown.
        A damaged one is not counted and not deleted (resume skips it, with a warning), so the
        checkpoint a run fell back to survives until ``keep_last`` newer loadable ones exist."""
        ours = [path for _, path in committed(self.cfg.dir) if writer_of(path) in self.live.runs]
        best = self.live.selection.best_checkpoint
        kept = 0
        for path in reversed(ours):
            if not self._is_loadable(path):
                continue
            kept += 1
            # checkpoint.keep_best: the best one is kept besides the keep_last newest
            if kept > self.cfg.keep_last and not (best and os.path.realpath(path) == os.path.realpath(best)):
                shutil.rmtree(path, ignore_errors=True)
                self.loadable.discard(os.path.realpath(path))

    def _is_loadable(self, path: str) -> bool:
        if os.path.realpath(path) in self.loadable:
            return True
        try:
            check_complete(path)
        except CheckpointError as e:
            log.warning(f"keep_last: {e}; not counted among the kept checkpoints, left in place")
            return False
        self.loadable.add(os.path.realpath(path))
        return True


def _write(state: dict[str, Any], partial: str, rank: int, group: Any) -> dict[str, str]:
    """DCP's save of this rank's part into ``partial``, then the checksums of its files."""
    dcp.save(state, checkpoint_id=partial, process_group=group)
    return hash_files(partial, own_files(partial, rank))


# The losses of a run's first steps: where it began, whatever its median does later.
_START_STEPS = 10


def typical_loss(losses: list[float]) -> float:
    """What a loss is compared with to call it exploded: the lowest of the median of the
    run's losses so far, the median of its first ``_START_STEPS`` steps, and its first
    step's loss (the untrained model's). A run that diverges drags its own median up with it
    (to 6.8e33 in a run whose loss reached 1.8e34), and one that diverges from its second
    step its first steps' median too; the first loss stays where the run began, so no
    median that diverged with the run can excuse it. Resumed runs count from the first step
    of the run they continue."""
    median = lambda xs: sorted(xs)[len(xs) // 2]
    return min(median(losses), median(losses[:_START_STEPS]), losses[0])


def exploded(loss: float, before: list[float], ratio: Optional[float]) -> Optional[str]:
    """Why ``loss`` counts as exploded against the losses ``before`` it (``checkpoint.
    max_loss_ratio``), or None: never without a ratio, a history, or a positive typical loss
    (a loss that can be negative, a ranking loss, is not compared)."""
    if not ratio or not before:
        return None
    typical = typical_loss(before)
    if typical > 0 and loss > ratio * typical:
        return f"over checkpoint.max_loss_ratio={ratio:g} x the run's typical loss {typical:.4g}"
    return None


def _local_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors this rank holds of a state value: table shards, an FSDP2 shard, a tensor."""
    if isinstance(value, ShardedTensor):
        return [shard.tensor for shard in value.local_shards()]
    if isinstance(value, DTensor):
        return [value.to_local()]
    return [value] if isinstance(value, torch.Tensor) else []


def _first_non_finite(node: Any, key: str = "") -> Optional[str]:
    """The key of the first floating-point value of a nested state (dicts, lists, tensors,
    numbers) that this rank holds and that is not finite, or None."""
    if isinstance(node, dict):
        items: Any = node.items()
    elif isinstance(node, (list, tuple)):
        items = enumerate(node)
    elif isinstance(node, float):
        return None if math.isfinite(node) else key
    else:
        tensors = _local_tensors(node)
        return key if any(t.is_floating_point() and not bool(torch.isfinite(t).all()) for t in tensors) else None
    for k, value in items:
        if found := _first_non_finite(value, f"{key}.{k}" if key else str(k)):
            return found
    return None


def _non_finite(state: dict[str, Any], device: torch.device) -> Optional[str]:
    """The first key of ``state`` (the model's and the optimizers' state, dense and fused
    sparse: everything a save commits) with a value that is not finite on any rank, or None
    (collective: every rank learns the answer, named by the lowest rank that found one)."""
    bad = _first_non_finite(state)
    flag = torch.tensor([int(bad is None)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if flag.item():
        return None
    found: list[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(found, bad)
    return next(b for b in found if b is not None)


def _storage_problem(cause: BaseException, directory: str) -> tuple[str, str]:
    """What the storage error ``cause`` means for a user, and the fix."""
    code = getattr(cause, "errno", None)
    try:
        stat = os.statvfs(directory)
        no_inodes, no_space = stat.f_files > 0 and stat.f_favail == 0, stat.f_bavail == 0
    except OSError:
        no_inodes = no_space = False
    if no_inodes and code in (errno.ENOSPC, None):
        return "no free inodes on the device", "Delete files there or point checkpoint.dir elsewhere"
    if code == errno.ENOSPC or no_space or "unexpected pos" in str(cause):
        return "no space left on device", "Free space there or point checkpoint.dir elsewhere"
    if code == errno.EDQUOT:
        return "disk quota exceeded", "Free space within the quota or point checkpoint.dir elsewhere"
    if code == errno.EROFS:
        return "read-only file system", "Remount it read-write or point checkpoint.dir elsewhere"
    if code in (errno.EACCES, errno.EPERM):
        return "permission denied", "Make checkpoint.dir writable by this user or point it elsewhere"
    return "", "Check the storage, or point checkpoint.dir elsewhere"


def _free(directory: str) -> str:
    try:
        return f"{shutil.disk_usage(directory).free:,} bytes free"
    except OSError:
        return "? bytes free"


def _fsync_dir(directory: str) -> None:
    """Make a rename or a new file in ``directory`` durable (a crash after the commit must
    not lose it)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DirLock:
    """One run per ``checkpoint.dir``: an exclusive ``flock(2)`` on ``<dir>/.lock`` for the
    run's lifetime, held by the process that launches the ranks. The kernel releases it when
    that process exits, however it exits (``kill -9`` included), so it is never stale. The
    file records who holds it, for the refusal message; it is never deleted (deleting a lock
    file races with a run opening it)."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, LOCK)
        self.fd: Optional[int] = None

    def acquire(self, about: str) -> None:
        """Take the lock or raise ``CheckpointError`` naming the run holding it. ``about``:
        where this run's outputs go, recorded for the next one."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 4096).decode(errors="replace").strip() or "a run that recorded nothing"
            os.close(fd)
            raise CheckpointError(
                f"checkpoint.dir={os.path.dirname(self.path)} is in use by another run ({holder}): wait for it to "
                f"end, or give this run another checkpoint.dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(
            fd,
            f"pid {os.getpid()} on {socket.gethostname()}, started "
            f"{time.strftime('%Y-%m-%d %H:%M:%S')}, outputs in {about}\n".encode(),
        )
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the lock
            self.fd = None


def _use_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)


def _stage(state: Any) -> Any:
    """A CPU copy of a state dict that training can no longer change, for the background
    writer. CUDA tensors are copied into pinned host memory without blocking, then the
    copies are awaited once; a copy on the GPU would double the tables' and optimizer's
    device memory at every save."""
    staged = _to_host(state)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()  # every non-blocking device-to-host copy has landed
    return staged


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    pinned = t.is_cuda  # pinned memory exists only with CUDA (and makes the copy asynchronous)
    out = torch.empty_like(t, device="cpu", pin_memory=pinned)
    return out.copy_(t.detach(), non_blocking=pinned)


def _to_host(obj: Any) -> Any:
    if isinstance(obj, ShardedTensor):
        # TorchRec's table shards: ShardedTensor.to rewrites the shards' placements to CPU
        # (metadata a hand-made copy would have to patch), copying even on CPU (copy=True).
        # Pageable, not pinned: pinned shards would also need the metadata's pin_memory flag.
        return obj.to(device="cpu", copy=True)
    if isinstance(obj, DTensor):  # FSDP2's parameters and states: copy the local shard, keep the layout
        return DTensor.from_local(
            _host_copy(obj.to_local()),
            obj.device_mesh,
            obj.placements,
            run_check=False,
            shape=obj.shape,
            stride=obj.stride(),
        )
    if isinstance(obj, torch.Tensor):
        return _host_copy(obj)
    if isinstance(obj, dict):
        return {k: _to_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_host(v) for v in obj)
    return copy.deepcopy(obj)
