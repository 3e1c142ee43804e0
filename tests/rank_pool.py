"""Ranks started once per test process, running many scenarios in turn: what PyTorch's own
``MultiProcContinuousTest`` does for its distributed tests (processes and imports paid once,
a failing case reported as itself), for hybridrec's 2-rank and 1-rank cases.

    from rank_pool import ranks
    result = ranks(2).run(train_and_gather, cfgs, run_dir)    # rank 0's return value

A scenario is a module-level function (``dist_helpers``'s): each rank calls it with the
same arguments, and it creates and destroys its own process group, as a rank the launcher
starts does (``hybridrec.parallel.distributed.init_distributed``, ``env://``: each scenario meets
at a store on a port of its own). A scenario that raises on any rank raises
``ScenarioFailed`` in the test, with every rank's traceback and output; if a rank is then
left inside a collective or with its process group up, the pool is ended and the next
scenario starts new ranks (the poison rule of PyTorch's harness: only a failure costs a
restart).

The ranks start as hybridrec's launcher starts its own (``launch.start_method``): forked
from multiprocessing's fork server, with torch, TorchRec and the helpers imported there
once, or, where a GPU is used, each a new interpreter.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import socket
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
GRACE_S = 20.0  # how long the other ranks get to end a failed scenario before the pool is ended


class ScenarioFailed(AssertionError):
    """A scenario raised on a rank (or a rank died): every rank's report."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_loop(rank: int, world: int, conn: Connection, out_dir: str) -> None:
    """A pool rank: runs each scenario it receives, reporting its result or traceback."""
    sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "benchmarks")]  # the tests' and benchmarks' scenarios
    import torch.distributed as dist

    from hybridrec.parallel.distributed import as_launched_rank

    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
    )
    as_launched_rank(parent_ends_it=False)
    # a rank's stdout and stderr go to a file per scenario: the report of a failure
    saved = os.dup(1), os.dup(2)
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return  # the test process ended
        n, fn, args, port = message
        os.environ["MASTER_PORT"] = str(port)
        path = os.path.join(out_dir, f"scenario{n}_rank{rank}.log")
        with open(path, "w") as log:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(log.fileno(), 1), os.dup2(log.fileno(), 2)
        try:
            reply = ("ok", fn(*args))
        except BaseException as e:  # noqa: BLE001  (reported to the test, with its traceback)
            reply = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
        if reply[0] == "ok" and dist.is_initialized():  # the next scenario could not start its own
            reply = (
                "error",
                f"{getattr(fn, '__name__', fn)} returned with its process group up: "
                "a scenario destroys the group it creates",
            )
        try:
            conn.send(reply)
        except Exception as e:  # an unpicklable result
            conn.send(("error", f"the scenario's result could not be sent: {e}"))


class Pool:
    """``world`` ranks that run scenarios one at a time."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.out_dir = tempfile.mkdtemp(prefix=f"hybridrec-ranks{world}-")
        self.count = 0
        self.procs: list[multiprocessing.Process] = []
        self.conns: list[Connection] = []

    def _start(self) -> None:
        from hybridrec.parallel.devices import Cuda
        from hybridrec.run.launch import start_method

        method = start_method(Cuda.probe())  # a new interpreter per rank where a GPU is used, as the launcher does
        ctx = multiprocessing.get_context(method)
        if method == "forkserver":  # (no effect once the fork server runs: the launcher may have started it)
            multiprocessing.set_forkserver_preload(["hybridrec.run.rank", "dist_helpers", "rank_pool"])
        self.procs, self.conns = [], []
        for rank in range(self.world):
            ours, theirs = ctx.Pipe()
            # not daemonic: a rank starts DataLoader workers of its own, as a launched rank does
            # (it ends when the test process closes its pipe: _stop_all, before multiprocessing's
            # own exit handler joins it)
            p = ctx.Process(
                target=_rank_loop, args=(rank, self.world, theirs, self.out_dir), daemon=False, name=f"pool-rank{rank}"
            )
            p.start()
            theirs.close()
            self.procs.append(p)
            self.conns.append(ours)

    def stop(self) -> None:
        for c in self.conns:
            c.close()
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        self.procs, self.conns = [], []

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 900.0) -> Any:
        """``fn(*args)`` on every rank; rank 0's return value. Raises ScenarioFailed."""
        if not self.procs or not all(p.is_alive() for p in self.procs):
            self.stop()
            self._start()
        self.count += 1
        n, port = self.count, _free_port()
        for c in self.conns:
            c.send((n, fn, args, port))
        replies: dict[int, tuple[str, Any]] = {}
        pending = dict(enumerate(self.conns))
        deadline = None
        limit = time.monotonic() + timeout
        while pending:
            now = time.monotonic()
            wait_s = min(limit, deadline or limit) - now
            ready = wait(list(pending.values()) + [p.sentinel for p in self.procs], timeout=max(0.0, wait_s))
            for rank, c in list(pending.items()):
                if c in ready:
                    try:
                        replies[rank] = c.recv()
                    except EOFError:
                        replies[rank] = ("error", f"rank {rank} died (exit code {self.procs[rank].exitcode})")
                    del pending[rank]
                elif self.procs[rank].sentinel in ready and not self.procs[rank].is_alive():
                    replies[rank] = ("error", f"rank {rank} died (exit code {self.procs[rank].exitcode})")
                    del pending[rank]
            if pending and any(kind == "error" for kind, _ in replies.values()) and deadline is None:
                deadline = time.monotonic() + GRACE_S  # the others may be waiting in a collective
            if pending and time.monotonic() >= min(limit, deadline or limit):
                for rank in pending:
                    replies[rank] = (
                        "error",
                        "did not finish the scenario (left in a collective, or over "
                        f"{timeout:.0f} s): the pool's ranks were ended",
                    )
                self.stop()
                break
        if all(kind == "ok" for kind, _ in replies.values()):
            return replies[0][1]
        # a failed scenario leaves its process group up (shutdown_distributed skips the
        # collective destroy on failure): the next scenario gets new ranks
        self.stop()
        report = [f"scenario {getattr(fn, '__name__', fn)} failed on {self.world} rank(s):"]
        for rank in sorted(replies):
            kind, value = replies[rank]
            log = os.path.join(self.out_dir, f"scenario{n}_rank{rank}.log")
            output = open(log, errors="replace").read()[-4000:] if os.path.exists(log) else ""
            report.append(
                f"--- rank {rank}: {'ok' if kind == 'ok' else value}"
                + (f"\n--- rank {rank} output:\n{output}" if output else "")
            )
        raise ScenarioFailed("\n".join(report))


_pools: dict[int, Pool] = {}


def ranks(world: int) -> Pool:
    """The pool of ``world`` ranks of this test process (started on first use)."""
    if world not in _pools:
        _pools[world] = Pool(world)
    return _pools[world]


@atexit.register
def _stop_all() -> None:
    for pool in _pools.values():
        pool.stop()
