"""Fault tolerance: a rank killed with SIGKILL mid-run, the elastic launcher restarting the
group, every rank resuming from the newest complete checkpoint; and the start-up health check."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import commands
from dist_helpers import late_rank_health_check, spawn
from hybridrec.checkpoint import latest

pytestmark = pytest.mark.dist  # every test starts ranks

# 30 steps, a checkpoint every 10: the kill lands after the first save with steps left to
# train, and the resumed run must then end bit for bit where the uninterrupted one does.
# ctr's model on 8 small tables: its 1M-row tables would make each start and save cost
# seconds, and the restart path is the same for any size.
ARGS = [
    "+experiment=ctr",
    "train.steps=30",
    "train.log_every=10",
    "data.num_embeddings_per_feature=[20000,10000,5000,2000,1000,500,100,20]",
    "data.eval_batches=2",
    "checkpoint.every_n_steps=10",
    "launcher.nproc_per_node=2",
]
RUN = [sys.executable, "-m", "hybridrec.train", *ARGS]


def _workers(launcher_pid: int) -> list[int]:
    """The rank processes: children of the launcher's fork server (no usable GPU), or the
    launcher's own children running multiprocessing's spawn (hybridrec.run.launch.start_method)."""
    procs = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = open(f"/proc/{entry}/stat").read()
            cmdline = open(f"/proc/{entry}/cmdline").read()
        except OSError:
            continue
        procs[int(entry)] = (int(stat.rsplit(")", 1)[1].split()[1]), cmdline)
    servers = {pid for pid, (ppid, cmd) in procs.items() if ppid == launcher_pid and "forkserver" in cmd}
    return sorted(
        pid
        for pid, (ppid, cmd) in procs.items()
        if ppid in servers or (ppid == launcher_pid and "spawn_main" in cmd and "resource_tracker" not in cmd)
    )


def test_killed_rank_is_restarted_and_resumes_exactly(tmp_path):
    """The elastic agent restarting the ranks of the real command is the subject: a
    subprocess. The uninterrupted reference run is forked from the preloaded command server.
    Over 20 s: two 30-step runs of 2 ranks, one of them started twice."""
    ckpt = tmp_path / "ckpt"
    proc = subprocess.Popen(
        RUN + ["launcher.max_restarts=1", f"checkpoint.dir={ckpt}", f"hydra.run.dir={tmp_path / 'run'}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 180
    while latest(str(ckpt)) is None:  # some work is saved ...
        assert proc.poll() is None and time.time() < deadline, "no checkpoint was written"
        time.sleep(0.05)
    workers = _workers(proc.pid)
    assert len(workers) == 2
    os.kill(workers[-1], signal.SIGKILL)  # ... then a rank dies without warning
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    resumed = json.load(open(tmp_path / "run" / "summary.json"))
    assert resumed["train"]["resumed_from_step"] >= 10  # the new ranks started from a checkpoint
    ref_run = commands.run(
        "hybridrec.train",
        *ARGS,
        f"checkpoint.dir={tmp_path / 'ref_ckpt'}",
        f"hydra.run.dir={tmp_path / 'ref'}",
        timeout=300,
    )
    assert ref_run.returncode == 0, ref_run.stderr[-3000:]
    reference = json.load(open(tmp_path / "ref" / "summary.json"))
    # the interrupted run ends exactly where the uninterrupted one does
    assert resumed["train_loss"] == reference["train_loss"] and resumed["eval"] == reference["eval"]


def test_health_check_names_the_rank_that_does_not_answer():
    assert "Ranks 1 failed to pass monitoredBarrier" in spawn(late_rank_health_check, 2, 3.0, 1.0)
    assert spawn(late_rank_health_check, 2, 0.0, 10.0) == "ok"
