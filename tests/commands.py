"""hybridrec's commands (``python -m hybridrec.train ...``) as the tests run them: each in a
process of its own, with its own argv, working directory, environment, stdout, stderr and exit
status, exactly as ``subprocess.run([sys.executable, "-m", ...])`` would, but without
importing torch, TorchRec and Hydra again for every command (5 of a refusal's 6 seconds).

A preloaded server process (``tests/zygote.py``), started once per test process, imports
them, then forks a child per command; the child runs the command's module as ``__main__``
(``runpy``, as ``python -m`` does) and exits as the interpreter would. The same idea as the
forkserver the launcher starts its ranks from, applied to the command line.

A command whose environment changes what is read when a library is imported (thread
counts, NumPy's CPU features, a visible GPU) runs in a new interpreter instead, as does any
command with ``fresh=True``: the tests of the real start-up (signals, torchrun, the import
itself) use that, or ``subprocess`` directly.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
# Read when a library is imported (OpenMP, MKL, NumPy's dispatch, CUDA, the interpreter
# itself): a command that sets one of these needs a new interpreter.
# PYTHONPATH is the exception: the child puts its entries first on sys.path itself.
IMPORT_TIME = ("OMP_", "MKL_", "OPENBLAS_", "NPY_", "CUDA_", "PYTHON", "LD_", "TORCH_", "KMP_", "GOMP_", "COVERAGE_")

_lock = threading.Lock()
_server: Optional[tuple[subprocess.Popen, str]] = None


def _start_server() -> str:
    """The server's socket path, starting it on first use (once per test process)."""
    global _server
    with _lock:
        if _server is not None and _server[0].poll() is None:
            return _server[1]
        path = os.path.join(tempfile.mkdtemp(prefix="hybridrec-zygote-"), "socket")
        proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "zygote.py"), path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        line = proc.stdout.readline()  # "ready" once it has imported everything
        if line.strip() != "ready":
            proc.kill()
            raise RuntimeError(f"tests/zygote.py did not start: {line!r}")
        _server = (proc, path)
        atexit.register(_stop_server, proc)
        return path


def _stop_server(proc: subprocess.Popen) -> None:
    proc.stdin.close()  # the server ends when its stdin closes
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()


def _needs_fresh(env: Optional[dict[str, str]]) -> bool:
    if env is None:
        return False
    changed = {k for k in set(env) | set(os.environ) if env.get(k) != os.environ.get(k)}
    return any(k.startswith(IMPORT_TIME) and k != "PYTHONPATH" for k in changed)


class Command:
    """A started command: ``pid``, ``wait(timeout)`` -> CompletedProcess (text output)."""

    def __init__(
        self,
        kind: str,
        target: str,
        args: Sequence[str],
        cwd: Optional[str],
        env: Optional[dict[str, str]],
        input: Optional[str],
        fresh: bool,
    ) -> None:
        flag = {"module": ["-m", target], "path": [target], "code": ["-c", target]}[kind]
        self.args = [sys.executable, *flag, *map(str, args)]
        self._dir = tempfile.mkdtemp(prefix="hybridrec-command-")
        self._out, self._err = (os.path.join(self._dir, n) for n in ("stdout", "stderr"))
        stdin = os.path.join(self._dir, "stdin")
        with open(stdin, "w") as f:
            f.write(input or "")
        env = dict(os.environ if env is None else env)
        self._sock: Optional[socket.socket] = None
        if fresh or _needs_fresh(env):
            with open(stdin) as i, open(self._out, "w") as o, open(self._err, "w") as e:
                self._proc: Optional[subprocess.Popen] = subprocess.Popen(
                    self.args, cwd=cwd, env=env, stdin=i, stdout=o, stderr=e
                )
            self.pid = self._proc.pid
            return
        self._proc = None
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(_start_server())
        request = {
            "kind": kind,
            "target": target,
            "args": list(map(str, args)),
            "cwd": os.path.abspath(cwd or os.getcwd()),
            "env": env,
            "stdin": stdin,
            "stdout": self._out,
            "stderr": self._err,
        }
        self._sock.sendall(json.dumps(request).encode() + b"\n")
        self._buffer = b""
        self.pid = json.loads(self._line(None))["pid"]

    def wait(self, timeout: Optional[float] = None) -> subprocess.CompletedProcess:
        try:
            code = self._wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self._wait(30)
            raise subprocess.TimeoutExpired(self.args, timeout, self._read(self._out), self._read(self._err)) from None
        done = subprocess.CompletedProcess(self.args, code, self._read(self._out), self._read(self._err))
        shutil.rmtree(self._dir, ignore_errors=True)
        return done

    def _wait(self, timeout: Optional[float]) -> int:
        if self._proc is not None:
            return self._proc.wait(timeout)
        line = self._line(timeout)
        self._sock.close()
        return json.loads(line)["returncode"]

    def _line(self, timeout: Optional[float]) -> str:
        """The server's next line on this command's connection."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._sock.settimeout(left)
            try:
                chunk = self._sock.recv(4096)
            except (socket.timeout, TimeoutError):
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            if not chunk:
                raise RuntimeError(f"tests/zygote.py ended while {' '.join(self.args)} ran")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def kill(self) -> None:
        try:
            os.kill(self.pid, 9)
        except ProcessLookupError:
            pass

    @staticmethod
    def _read(path: str) -> str:
        try:
            with open(path, errors="replace") as f:
                return f.read()
        except FileNotFoundError:  # the child ended before opening it
            return ""


def start(
    module: str,
    *args: str,
    cwd: Optional[str] = None,
    env: Optional[dict[str, str]] = None,
    input: Optional[str] = None,
    fresh: bool = False,
) -> Command:
    """Start ``python -m module args``; ``env`` replaces the environment, as subprocess's."""
    return Command("module", module, args, cwd, env, input, fresh)


def start_argv(argv: Sequence[str], **kwargs) -> Command:
    """Start ``[sys.executable, "-m", module | "-c", code | script, *args]`` (what a program
    under test would pass to subprocess)."""
    argv = list(map(str, argv))
    if argv[1] in ("-m", "-c"):
        return Command("module" if argv[1] == "-m" else "code", argv[2], argv[3:], **_defaults(kwargs))
    return Command("path", argv[1], argv[2:], **_defaults(kwargs))


def _defaults(kwargs: dict) -> dict:
    return {
        "cwd": kwargs.get("cwd"),
        "env": kwargs.get("env"),
        "input": kwargs.get("input"),
        "fresh": kwargs.get("fresh", False),
    }


def subprocess_run(
    cmd: Sequence[str],
    *,
    stdout=None,
    stderr=None,
    capture_output: bool = False,
    text: bool = False,
    check: bool = False,
    timeout: Optional[float] = None,
    **kwargs,
) -> subprocess.CompletedProcess:
    """A stand-in for ``subprocess.run`` in a module under test (``monkeypatch.setattr(module.subprocess,
    "run", commands.subprocess_run)``): Python commands of this interpreter go through the server,
    anything else to the real ``subprocess.run``. stdout may be a file (stderr=STDOUT joins it)."""
    if not cmd or cmd[0] != sys.executable or len(cmd) < 2 or (cmd[1].startswith("-") and cmd[1] not in ("-m", "-c")):
        return _real_run(
            cmd,
            stdout=stdout,
            stderr=stderr,
            capture_output=capture_output,
            text=text,
            check=check,
            timeout=timeout,
            **kwargs,
        )
    done = start_argv(cmd, **kwargs).wait(timeout)
    out, err = done.stdout, done.stderr
    if hasattr(stdout, "write"):
        stdout.write(out + (err if stderr == subprocess.STDOUT else ""))
        stdout.flush()
    if hasattr(stderr, "write"):
        stderr.write(err)
        stderr.flush()
    keep = capture_output or stdout == subprocess.PIPE
    result = subprocess.CompletedProcess(
        cmd,
        done.returncode,
        (out if text else out.encode()) if keep else None,
        (err if text else err.encode()) if capture_output or stderr == subprocess.PIPE else None,
    )
    if check:
        result.check_returncode()
    return result


_real_run = subprocess.run


def run(
    module: str,
    *args: str,
    timeout: Optional[float] = 300,
    cwd: Optional[str] = None,
    env: Optional[dict[str, str]] = None,
    input: Optional[str] = None,
    fresh: bool = False,
) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
    ...)``: a CompletedProcess with the exit status and the text of stdout and stderr."""
    return start(module, *args, cwd=cwd, env=env, input=input, fresh=fresh).wait(timeout)


def warm() -> float:
    """Start the server now (seconds it took): before timing a command, or in a fixture."""
    t = time.monotonic()
    _start_server()
    return time.monotonic() - t
