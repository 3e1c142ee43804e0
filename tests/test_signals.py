"""Ending a run from outside: SIGTERM, or Ctrl-C (SIGINT to the terminal's whole process
group), ends it with one line and leaves no process behind, at 2 ranks and at one rank in the
entry point's own process; a rank or a DataLoader worker that a signal kills is named in one
line (exit 128 + the signal), and a restart after one is one line; a rank that stops
answering is named, with its pid, within the collective timeout.

Every run is a real subprocess, the leader of a session of its own: what is tested is how
the launcher's process, its fork server, ranks and workers end, and a terminal's Ctrl-C
reaches the whole process group. A run ends once, so each test starts its own; one run
shows a restart and then SIGTERM."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.dist  # every test starts ranks

# Far more steps than a test waits for, each logged: the run is stopped in mid-training. One
# DataLoader worker per rank, to see that the workers end too. Small tables: fast to start.
RUN = [
    sys.executable,
    "-m",
    "hybridrec.train",
    "+experiment=ctr",
    "train.steps=100000",
    "train.log_every=1",
    "train.eval_every=0",
    "data.num_embeddings_per_feature=[2000,1000,500,100]",
    "data.batch_size=256",
    "data.eval_batches=2",
    "data.num_workers=1",
    "launcher.nproc_per_node=2",
    "launcher.collective_timeout_s=20",
]


# The launcher's helper interpreters, multiprocessing's fork server and resource tracker
# (the launcher's own children), end after the launcher does, through Python's own shutdown:
# over a second of CPU for the fork server, which imported torch and TorchRec, and many on a
# loaded machine. The ranks and their workers end on the signal itself. A helper left running
# is a failure; a slow one is not.
HELPERS_LIMIT_S = 60


class Run:
    """``RUN`` started as the leader of a session of its own: every process it starts (fork
    server, resource tracker, ranks, their DataLoader workers) stays in that session, so
    they are found without psutil and however they were reparented."""

    def __init__(self, tmp_path, extra=()):
        self.dir = tmp_path / "run"
        self.stderr_path = tmp_path / "stderr"
        with open(self.stderr_path, "w") as stderr:  # a file: a full pipe would block the run
            self.proc = subprocess.Popen(
                RUN + [*extra, f"hydra.run.dir={self.dir}"],
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                start_new_session=True,
            )
        self.helpers: set[int] = set()  # the fork server and resource tracker, once training() saw them

    def processes(self) -> dict[int, int]:
        """The session's live processes (exited ones waiting to be reaped are gone), each
        with its parent's pid."""
        procs = {}
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{entry}/stat") as f:
                    state, ppid, _, session = f.read().rsplit(")", 1)[1].split()[:4]
            except OSError:
                continue
            if state != "Z" and int(session) == self.proc.pid:
                procs[int(entry)] = int(ppid)
        return procs

    def training(self) -> tuple[list[int], list[int]]:
        """Waits until both ranks train and each has its DataLoader worker; returns their pids."""
        deadline = time.monotonic() + 120
        while True:
            assert self.proc.poll() is None, self.stderr()
            assert time.monotonic() < deadline, "the run did not start training"
            procs = self.processes()
            servers = [pid for pid, ppid in procs.items() if ppid == self.proc.pid]  # and the resource tracker
            ranks = sorted(pid for pid, ppid in procs.items() if ppid in servers)
            workers = [pid for pid, ppid in procs.items() if ppid in ranks]
            log = self.dir / "train.log"
            if len(ranks) == 2 and len(workers) == 2 and log.exists() and "step 2/" in log.read_text():
                self.helpers |= set(servers)
                return ranks, workers
            time.sleep(0.1)

    def gone_after(self, start: float, limit: float) -> float:
        """Seconds from ``start`` until no process of the run is left: the ranks and their
        workers within ``limit``, the helpers within HELPERS_LIMIT_S (any still there then is
        killed, and reported)."""
        while (left := self.processes()) and time.monotonic() - start < limit:
            time.sleep(0.05)
        working = {pid: d for pid in left.keys() - self.helpers if (d := _describe(pid))}
        while not working and (left := self.processes()) and time.monotonic() - start < HELPERS_LIMIT_S:
            time.sleep(0.05)
        described = {pid: d for pid in left if (d := _describe(pid))}
        self.stop()
        assert not working, f"still running {limit:g} s later: {working}"
        assert not described, f"still running {HELPERS_LIMIT_S:g} s later: {described}"
        return time.monotonic() - start

    def stderr(self, since: int = 0) -> str:
        """What the run wrote to stderr, from byte ``since`` on."""
        with open(self.stderr_path, "rb") as f:
            return f.read()[since:].decode()

    def stop(self):
        for pid in self.processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # ended since
                pass


def _describe(pid: int) -> str:
    """A process as a failure reports it: its state, parent and command line ("" once it
    has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return ""
    return "" if state == "Z" else f"state {state}, parent {ppid}: {cmdline}"


@pytest.fixture
def run(tmp_path):
    r = Run(tmp_path)
    yield r
    r.stop()


def _ends_in_one_line(run, sig, group, checkpoints=None):
    """Sends ``sig`` to the training run (``group``: to its whole process group, as a
    terminal's Ctrl-C does): it ends with one line and exit status 128 + the signal, and
    leaves no process behind. ``checkpoints``: the run's checkpoint.dir, whose newest
    checkpoint (or that there is none yet) the line names."""
    before = os.path.getsize(run.stderr_path)
    start = time.monotonic()
    if group:
        os.killpg(run.proc.pid, sig)  # what a terminal does on Ctrl-C
    else:
        run.proc.send_signal(sig)
    returncode = run.proc.wait(timeout=30)
    gone = run.gone_after(start, limit=10)
    assert "Traceback" not in run.stderr(), run.stderr()[-3000:]
    line = f"hybridrec: stopped by {sig.name}; outputs so far in {run.dir}"
    if checkpoints is None:
        assert run.stderr(since=before) == line + "\n"
    else:
        saved = (
            rf"; newest checkpoint {re.escape(str(checkpoints))}/step_\d{{8}}: the same command resumes from it"
            rf"|; no checkpoint saved yet in {re.escape(str(checkpoints))}"
        )
        assert re.fullmatch(rf"{re.escape(line)}({saved})\n", run.stderr(since=before)), run.stderr(since=before)
    assert returncode == 128 + sig  # the shell's convention for a process ended by a signal
    print(f"{sig.name}: every process gone {gone:.1f} s after the signal")


def test_ctrl_c_ends_the_run_in_one_line_and_leaves_no_process(run):
    """SIGINT to the process group; SIGTERM to the launcher alone: the restart test below."""
    run.training()
    _ends_in_one_line(run, signal.SIGINT, group=True)


def test_a_stopped_rank_is_named_within_the_collective_timeout(run):
    """Over 20 s: the launcher names a silent rank after launcher.collective_timeout_s / 2 (10 s)."""
    ranks, _ = run.training()
    before = os.path.getsize(run.stderr_path)
    start = time.monotonic()
    os.kill(ranks[1], signal.SIGSTOP)
    # Named within launcher.collective_timeout_s (20 s): the line on stderr is the event. The
    # launcher's own exit after it is Python's shutdown (seconds on a loaded machine).
    while True:
        ended = run.proc.poll() is not None
        if "stopped responding" in run.stderr(since=before):
            break
        assert not ended, run.stderr()[-3000:]
        assert time.monotonic() - start < 20, f"not named within 20 s: {run.stderr()[-3000:]}"
        time.sleep(0.05)
    reported = time.monotonic() - start
    returncode = run.proc.wait(timeout=30)
    gone = run.gone_after(start, limit=reported + 10)
    assert "Traceback" not in run.stderr(), run.stderr()[-3000:]
    # The pids tell the ranks apart; which is rank 1 only the launcher knows.
    assert re.fullmatch(
        rf"hybridrec: rank [01] \(pid {ranks[1]}\) stopped responding: no heartbeat for \d+ s "
        r"\(process state: stopped\); every rank was killed\n",
        run.stderr(since=before),
    )
    assert returncode != 0
    print(f"SIGSTOP: reported after {reported:.1f} s, every process gone after {gone:.1f} s")


@pytest.mark.parametrize(
    "target, sig",
    [("rank", signal.SIGKILL), ("rank", signal.SIGTERM), ("worker", signal.SIGKILL)],
    ids=["SIGKILL to a rank", "SIGTERM to a rank", "SIGKILL to a worker"],
)
def test_a_rank_or_worker_a_signal_ends_is_named_in_one_line(run, target, sig):
    ranks, workers = run.training()
    before = os.path.getsize(run.stderr_path)
    start = time.monotonic()
    pid = ranks[1] if target == "rank" else workers[0]
    os.kill(pid, sig)
    returncode = run.proc.wait(timeout=30)
    run.gone_after(start, limit=10)
    assert "Traceback" not in run.stderr(), run.stderr()[-3000:]
    # The pids tell the ranks apart; which is rank 1 only the launcher knows.
    said = (
        rf"hybridrec: rank [01] \(pid {pid}\) was killed by {sig.name}\n"
        if target == "rank"
        else rf"hybridrec: rank [01]: DataLoader worker \(pid {pid}\) was killed by {sig.name}; its batches were lost "
        r"with it \(data.num_workers=0 reads in the rank itself\)\n"
    )
    assert re.fullmatch(said, run.stderr(since=before)), run.stderr(since=before)
    assert returncode == 128 + sig


def test_a_killed_rank_restarts_with_one_line_and_sigterm_then_ends_the_run(tmp_path):
    """One run for two things: a rank killed under launcher.max_restarts=1 is one line and a
    restart, and SIGTERM to the launcher (the restarted ranks training) ends the run in one
    line and leaves no process behind. Over 20 s: two generations of ranks, and the fork
    server's exit."""
    r = Run(tmp_path, ["launcher.max_restarts=1", f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.every_n_steps=5"])
    try:
        ranks, _ = r.training()
        os.kill(ranks[1], signal.SIGKILL)
        said = (
            f"rank [01] \\(pid {ranks[1]}\\) was killed by SIGKILL; restarting every rank from the newest "
            r"checkpoint \(restart 1 of launcher.max_restarts=1\)"
        )
        deadline = time.monotonic() + 60
        while not (m := re.search(said, log := (r.dir / "train.log").read_text())):
            assert time.monotonic() < deadline and r.proc.poll() is None, r.stderr()[-3000:]
            time.sleep(0.2)
        again, _ = r.training()  # the restarted ranks and their workers are up ...
        assert ranks[1] not in again
        deadline = time.monotonic() + 120
        while not re.search(r" - step \d+/", log[m.end() :]):  # ... and train: a step logged after the restart
            assert time.monotonic() < deadline and r.proc.poll() is None, r.stderr()[-3000:]
            time.sleep(0.1)
            log = (r.dir / "train.log").read_text()
        assert "Traceback" not in r.stderr() + (r.dir / "train.log").read_text(), r.stderr()[-3000:]
        _ends_in_one_line(r, signal.SIGTERM, group=False, checkpoints=tmp_path / "ckpt")
        assert "Traceback" not in (r.dir / "train.log").read_text()
    finally:
        r.stop()


def test_one_rank_in_the_entry_process_stops_in_one_line(tmp_path):
    r = Run(tmp_path, ["launcher.nproc_per_node=1"])
    try:
        deadline = time.monotonic() + 120
        while not ((r.dir / "train.log").exists() and "step 2/" in (r.dir / "train.log").read_text()):
            assert time.monotonic() < deadline and r.proc.poll() is None, r.stderr()[-3000:]
            time.sleep(0.1)
        before = os.path.getsize(r.stderr_path)
        start = time.monotonic()
        os.killpg(r.proc.pid, signal.SIGINT)  # Ctrl-C
        assert r.proc.wait(timeout=30) == 128 + signal.SIGINT
        r.gone_after(start, limit=10)  # the DataLoader worker too
        assert r.stderr(since=before) == f"hybridrec: stopped by SIGINT; outputs so far in {r.dir}\n", r.stderr()
        assert "Traceback" not in r.stderr()
    finally:
        r.stop()
