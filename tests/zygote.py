"""The server behind ``tests/commands.py``: imports what hybridrec's commands import, once,
then forks a child per request that runs ``python -m <module> <args>`` (or a script, or
``-c`` code) as a new interpreter would, from the fork on.

    python tests/zygote.py SOCKET     # prints "ready"; ends when its stdin closes

A request is one JSON line on a connection to SOCKET: what to run (kind "module", "path" or
"code": ``python -m``, ``python script.py``, ``python -c``), args, cwd, env and the paths of
the child's stdin, stdout and stderr. The server answers ``{"pid": ...}`` at once and
``{"returncode": ...}`` when the child has ended (negative: the signal that ended it).
Single-threaded on purpose: a process forked from a multi-threaded one may inherit a lock
another thread held.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import runpy
import select
import signal
import socket
import sys

# Everything the commands import before they do anything: what a new interpreter would spend
# its first seconds on.
PRELOAD = (
    "torch",
    "torchrec",
    "fbgemm_gpu",
    "hydra",
    "omegaconf",
    "pyarrow",
    "pyarrow.parquet",
    "hybridrec.train",
    "hybridrec.evaluate",
    "hybridrec.export",
    "hybridrec.plan",
    "hybridrec.run.rank",
    "hybridrec.run.launch",
    "hybridrec.training.trainer",
    "hybridrec.data.convert",
    "hybridrec.data.example",
    "hybridrec.data.vocab",
    "matplotlib",
    "matplotlib.pyplot",
)


def child(request: dict, inherited: list[socket.socket]) -> None:
    """In the forked child: become ``python -m module args`` and run it (never returns)."""
    for s in inherited:  # the server's sockets
        s.close()
    for sig in (signal.SIGINT,):
        signal.signal(sig, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL if sig != signal.SIGPIPE else signal.SIG_IGN)
    for fd, path, mode in (
        (0, request["stdin"], os.O_RDONLY),
        (1, request["stdout"], os.O_WRONLY | os.O_CREAT),
        (2, request["stderr"], os.O_WRONLY | os.O_CREAT),
    ):
        new = os.open(path, mode, 0o644)
        os.dup2(new, fd)
        os.close(new)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # PYTHONPATH's entries go first, as the interpreter puts them (modules imported above stay)
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    kind, target = request["kind"], request["target"]
    # python -m and -c put the working directory first; python script.py the script's directory
    first = os.path.dirname(os.path.abspath(target)) if kind == "path" else request["cwd"]
    sys.path[:1] = [first, *extra]
    # the interpreter's own exit from here: SystemExit as python would report it, atexit handlers, flushing
    if kind == "module":
        sys.argv = [target, *request["args"]]
        sys.modules.pop(target, None)  # imported above as itself: python -m runs it as __main__ only
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    elif kind == "path":
        sys.argv = [target, *request["args"]]
        runpy.run_path(target, run_name="__main__")
    else:  # python -c CODE
        sys.argv = ["-c", *request["args"]]
        import __main__

        exec(compile(target, "<string>", "exec"), vars(__main__))
    sys.exit(0)


def serve(path: str) -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    # The children never collect what they inherit: a garbage collection (the last one at exit
    # at the latest) would write to the page of every preloaded object, copying it (1 s of CPU
    # a command, measured, of a 1.2 s refusal).
    gc.freeze()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)
    waiting: dict[int, socket.socket] = {}  # child pid -> the connection that asked for it
    while True:
        ready, _, _ = select.select([listener, sys.stdin], [], [], 0.05)
        if sys.stdin in ready and not sys.stdin.readline():
            break  # the test process ended
        if listener in ready:
            conn, _ = listener.accept()
            request = json.loads(conn.makefile("r").readline())
            pid = os.fork()
            if pid == 0:
                child(request, [listener, conn, *waiting.values()])
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            waiting[pid] = conn
        while waiting:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                except OSError:
                    pass  # the test gave up on it (a timeout)
                conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
