"""Ending a run from outside: SIGTERM, or Ctrl-C (SIGINT to the terminal's whole process
group), ends it with one line and leaves no process behind, at 2 ranks and at one rank in the
entry point's own process; a rank or a DataLoader worker that a signal kills is named in one
line (exit 128 + the signal), and a restart after one is one line; a rank that stops
answering is named, with its pid, within the collective timeout."""

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
RUN = [sys.executable, "-m", "hybridrec.train", "+experiment=ctr", "train.steps=100000", "train.log_every=1",
       "train.eval_every=0", "data.num_embeddings_per_feature=[2000,1000,500,100]", "data.batch_size=256",
       "data.eval_batches=2", "data.num_workers=1", "launcher.nproc_per_node=2", "launcher.collective_timeout_s=20"]


class Run:
    """``RUN`` started as the leader of a session of its own: every process it starts (fork
    server, resource tracker, ranks, their DataLoader workers) stays in that session, so
    they are found without psutil and however they were reparented."""

    def __init__(self, tmp_path, extra=()):
        self.dir = tmp_path / "run"
        self.stderr_path = tmp_path / "stderr"
        with open(self.stderr_path, "w") as stderr:  # a file: a full pipe would block the run
            self.proc = subprocess.Popen(RUN + [*extra, f"hydra.run.dir={self.dir}"], stdout=subprocess.DEVNULL,
                                         stderr=stderr, start_new_session=True)

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
                return ranks, workers
            time.sleep(0.1)

    def gone_after(self, start: float, limit: float) -> float:
        """Seconds from ``start`` until no process of the run is left (killed if still there at ``limit``)."""
        while (left := self.processes()) and time.monotonic() - start < limit:
            time.sleep(0.05)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        assert not left, f"still running {limit:g} s later: {sorted(left)}"
        return time.monotonic() - start

    def stderr(self, since: int = 0) -> str:
        """What the run wrote to stderr, from byte ``since`` on."""
        with open(self.stderr_path, "rb") as f:
            return f.read()[since:].decode()

    def stop(self):
        for pid in self.processes():
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def run(tmp_path):
    r = Run(tmp_path)
    yield r
    r.stop()


@pytest.mark.parametrize("sig, group", [(signal.SIGTERM, False), (signal.SIGINT, True)], ids=["SIGTERM", "ctrl-c"])
def test_a_signal_ends_the_run_in_one_line_and_leaves_no_process(run, sig, group):
    run.training()
    before = os.path.getsize(run.stderr_path)
    start = time.monotonic()
    if group:
        os.killpg(run.proc.pid, sig)  # what a terminal does on Ctrl-C
    else:
        run.proc.send_signal(sig)
    returncode = run.proc.wait(timeout=30)
    gone = run.gone_after(start, limit=10)
    assert "Traceback" not in run.stderr(), run.stderr()[-3000:]
    assert run.stderr(since=before) == f"hybridrec: stopped by {sig.name}; outputs so far in {run.dir}\n"
    assert returncode == 128 + sig  # the shell's convention for a process ended by a signal
    print(f"{sig.name}: every process gone {gone:.1f} s after the signal")


def test_a_stopped_rank_is_named_within_the_collective_timeout(run):
    ranks, _ = run.training()
    before = os.path.getsize(run.stderr_path)
    start = time.monotonic()
    os.kill(ranks[1], signal.SIGSTOP)
    returncode = run.proc.wait(timeout=20)  # launcher.collective_timeout_s
    reported = time.monotonic() - start
    gone = run.gone_after(start, limit=reported + 10)
    assert "Traceback" not in run.stderr(), run.stderr()[-3000:]
    # The pids tell the ranks apart; which is rank 1 only the launcher knows.
    assert re.fullmatch(rf"hybridrec: rank [01] \(pid {ranks[1]}\) stopped responding: no heartbeat for \d+ s "
                        r"\(process state: stopped\); every rank was killed\n", run.stderr(since=before))
    assert returncode != 0
    print(f"SIGSTOP: reported after {reported:.1f} s, every process gone after {gone:.1f} s")


@pytest.mark.parametrize("target, sig", [("rank", signal.SIGKILL), ("rank", signal.SIGTERM), ("worker", signal.SIGKILL)],
                         ids=["SIGKILL to a rank", "SIGTERM to a rank", "SIGKILL to a worker"])
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
    said = (rf"hybridrec: rank [01] \(pid {pid}\) was killed by {sig.name}\n" if target == "rank" else
            rf"hybridrec: rank [01]: DataLoader worker \(pid {pid}\) was killed by {sig.name}; its batches were lost "
            r"with it \(data.num_workers=0 reads in the rank itself\)\n")
    assert re.fullmatch(said, run.stderr(since=before)), run.stderr(since=before)
    assert returncode == 128 + sig


def test_a_killed_rank_restarts_with_one_line(tmp_path):
    r = Run(tmp_path, ["launcher.max_restarts=1", f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.every_n_steps=5"])
    try:
        ranks, _ = r.training()
        os.kill(ranks[1], signal.SIGKILL)
        said = f"rank [01] \\(pid {ranks[1]}\\) was killed by SIGKILL; restarting every rank from the newest " \
               r"checkpoint \(restart 1 of launcher.max_restarts=1\)"
        deadline = time.monotonic() + 60
        while not re.search(said, (r.dir / "train.log").read_text()):
            assert time.monotonic() < deadline and r.proc.poll() is None, r.stderr()[-3000:]
            time.sleep(0.2)
        again, _ = r.training()  # the restarted ranks train
        assert ranks[1] not in again
        r.proc.send_signal(signal.SIGTERM)
        assert r.proc.wait(timeout=30) == 128 + signal.SIGTERM
        assert "Traceback" not in r.stderr() + (r.dir / "train.log").read_text(), r.stderr()[-3000:]
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
