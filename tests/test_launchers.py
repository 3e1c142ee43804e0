"""Launching through Hydra's submitit plugin: a real sweep on submitit's local executor, the
Slurm submission script rendered without a cluster, the Slurm variables -> rendezvous
derivation, the launcher rules checked before submission, and two faked Slurm nodes training
on loopback."""

import csv
import json
import os
import socket
import sys

import pytest

import commands
from conftest import compose_cfg
from hybridrec.parallel.devices import Cuda
from hybridrec.run.callbacks import check_submitit
from hybridrec.run.launch import job_nodes, start_method, world_size
from shared import TWO_NODE_RUN

# The ctr experiment's model on three small tables, a few steps: seconds per job.
TINY = [
    "+experiment=ctr",
    "data.num_embeddings_per_feature=[500,200,100]",
    "data.batch_size=128",
    "train.steps=4",
    "train.log_every=2",
    "data.eval_batches=1",
]


def _job_dirs(sweep):
    return sorted(d for d in os.listdir(sweep) if os.path.isdir(sweep / d) and not d.startswith("."))


@pytest.mark.dist
def test_submitit_local_sweep_runs_each_job(tmp_path):
    """`-m hydra/launcher=submitit_local`: each job of the sweep is a submitit job (its own
    process, pickled by submitit) that starts 2 ranks through hybridrec's elastic launcher.
    The submitting command is forked from the preloaded command server: submitit starts each
    job's process itself. Over 20 s: each job is a new interpreter with a fork server of its
    own."""
    sweep = tmp_path / "sweep"
    proc = commands.run(
        "hybridrec.train",
        "-m",
        "hydra/launcher=submitit_local",
        *TINY,
        "sharding=table_wise,row_wise",
        "launcher.nproc_per_node=2",
        f"hydra.sweep.dir={sweep}",
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    jobs = _job_dirs(sweep)
    assert len(jobs) == 2 and "sharding=table_wise" in jobs[0] and "sharding=row_wise" in jobs[1]
    for job, sharding in zip(jobs, ["table_wise", "row_wise"]):
        s = json.load(open(sweep / job / "summary.json"))
        assert s["world_size"] == 2 and s["steps"] == 4
        assert {p["sharding_type"] for p in s["plan"].values()} == {sharding}
        assert {r for p in s["plan"].values() for r in p["ranks"]} == {0, 1}
        assert 0 < s["train_loss"] < 0.7 and s["eval"]["n"] == 128
    # the sweep summary, from the submitting process once submitit's jobs are done
    rows = sorted(csv.DictReader(open(sweep / "summary.csv")), key=lambda r: int(r["job"]))  # CSV: best first
    assert [(r["status"], r["sharding"], r["dir"]) for r in rows] == [
        ("ok", "table_wise", jobs[0]),
        ("ok", "row_wise", jobs[1]),
    ]
    assert f"hybridrec: sweep summary in {sweep}/summary.md" in proc.stdout
    # ran by submitit: one folder of logs and pickles per job, the job's own id in Hydra's record
    ids = sorted(d for d in os.listdir(sweep / ".submitit") if d.isdigit())
    assert len(ids) == 2
    for job in jobs:
        assert any(f"id: '{i}'" in open(sweep / job / ".hydra" / "hydra.yaml").read() for i in ids)


SLURM = [
    "hydra/launcher=slurm",
    *TINY,
    "launcher.nproc_per_node=8",
    "launcher.device=cuda",
    "hydra.launcher.nodes=4",
    "hydra.launcher.partition=gpu",
    "hydra.launcher.timeout_min=90",
]


@pytest.mark.slow
def test_slurm_submission_script(tmp_path):
    """The sbatch script hybridrec's slurm config produces, rendered by the real plugin and
    submitit: `srun` and `sbatch` are test doubles on PATH; sbatch keeps the script and fails,
    as a machine without Slurm would. The commands are forked from the preloaded command
    server (PATH is read when a command runs, not at import)."""
    bin_dir, script = tmp_path / "bin", tmp_path / "submitted.sh"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")  # submitit only checks that srun exists
    (bin_dir / "sbatch").write_text(f'#!/bin/sh\ncp "$1" {script}\necho "sbatch: error: no cluster" >&2\nexit 1\n')
    for f in ("srun", "sbatch"):
        os.chmod(bin_dir / f, 0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    run = lambda *extra: commands.run("hybridrec.train", "-m", *SLURM, *extra, timeout=120, env=env)

    # a launcher config that cannot work is refused before anything is submitted
    bad = run("hydra.launcher.tasks_per_node=8", f"hydra.sweep.dir={tmp_path / 'bad'}")
    assert bad.returncode != 0 and not script.exists()
    assert "hybridrec: invalid launcher config: hydra.launcher.tasks_per_node=8" in bad.stderr
    bad = run("data.batch_size=100", f"hydra.sweep.dir={tmp_path / 'bad'}")  # 4 nodes x 8 ranks
    assert bad.returncode != 0 and not script.exists()
    assert "data.batch_size=100 is the global batch and must divide evenly over world_size=32" in bad.stderr

    sweep = tmp_path / "sweep"
    proc = run("sharding=table_wise,row_wise", f"hydra.sweep.dir={sweep}")
    assert "no cluster" in proc.stderr and script.exists()  # reached sbatch
    text = script.read_text()
    lines = text.splitlines()
    for flag in [
        "--nodes=4",
        "--ntasks-per-node=1",
        "--gpus-per-node=8",
        "--cpus-per-task=64",
        "--partition=gpu",
        "--time=90",
        "--array=0-1%2",
        "--job-name=train",
    ]:
        assert f"#SBATCH {flag}" in lines, (flag, text)
    assert "export SUBMITIT_EXECUTOR=slurm" in lines  # what hybridrec.run.launch.job_nodes keys on
    srun = [line for line in lines if line.startswith("srun ")]
    assert len(srun) == 1, text
    # one srun task per node (from --ntasks-per-node), running the pickled Hydra job
    assert srun[0].endswith(f"{sys.executable} -u -m submitit.core._submit {sweep}/.submitit/%j")
    assert f"--output {sweep}/.submitit/%A_%a/%A_%a_%t_log.out" in srun[0]


SLURM_ENV = {
    "SUBMITIT_EXECUTOR": "slurm",
    "SLURM_JOB_ID": "4243",
    "SLURM_ARRAY_JOB_ID": "4242",
    "SLURM_ARRAY_TASK_ID": "1",
    "SLURM_JOB_NUM_NODES": "4",
    "SLURM_NTASKS": "4",
    "SLURM_JOB_NODELIST": "gpu-[017-018,020],gpu-101",
    "SLURM_NODEID": "2",
    "SLURM_PROCID": "2",
    "SLURM_LOCALID": "0",
}


@pytest.mark.unit
def test_slurm_variables_give_the_rendezvous(monkeypatch, cfg_factory):
    for key in ("MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in SLURM_ENV.items():
        monkeypatch.setenv(key, value)
    nodes = job_nodes()
    assert nodes.count == 4 and nodes.run_id == "hybridrec-4242_1"  # one rendezvous per array task
    host, port = nodes.endpoint.split(":")
    assert host == "gpu-017" and 20000 <= int(port) <= 60000  # first node; port from the job id
    assert job_nodes().endpoint == nodes.endpoint  # every node derives the same
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert job_nodes().endpoint == "gpu-017:29500"
    assert world_size(cfg_factory(["launcher.nproc_per_node=8"])) == 32
    # one task per GPU (the plugin's other layout) would start every node's ranks several times
    monkeypatch.setenv("SLURM_NTASKS", "32")
    with pytest.raises(ValueError, match=r"32 task\(s\) on 4 node\(s\).*tasks_per_node=1"):
        job_nodes()
    # outside submitit, Slurm's variables alone (e.g. inside salloc) do not make a multi-node job
    monkeypatch.delenv("SUBMITIT_EXECUTOR")
    assert job_nodes().count == 1 and job_nodes().endpoint == "localhost:0"


def _hydra_cfg(overrides):
    return compose_cfg(overrides, hydra_keys=True)


@pytest.mark.unit
@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["hydra/launcher=slurm", "hydra.launcher.tasks_per_node=8"],
            "tasks_per_node=8: hybridrec runs one task per node",
        ),
        (
            ["hydra/launcher=submitit_slurm", "launcher.device=cuda", "launcher.nproc_per_node=8"],
            r"asks for 0 GPU\(s\) per node: set hydra.launcher.gpus_per_node=8",
        ),
        (
            ["hydra/launcher=slurm", "launcher.nproc_per_node=4", "hydra.launcher.gpus_per_node=8"],
            "gpus_per_node=8 but launcher.nproc_per_node=4",
        ),
        (["hydra/launcher=local", "hydra.launcher.nodes=2"], "1 with submitit's local executor"),
        (["hydra/launcher=slurm", "hydra.launcher.timeout_min=0"], "timeout_min must be >= 1"),
        (
            ["hydra/launcher=slurm", "hydra.launcher.nodes=3", "data.batch_size=64"],
            "must divide evenly over world_size=3",
        ),
    ],
)
def test_launcher_rules(overrides, message):
    with pytest.raises(ValueError, match=message):
        check_submitit(_hydra_cfg(overrides))


@pytest.mark.unit
def test_launcher_rules_accept_what_the_configs_ship():
    check_submitit(_hydra_cfg(["hydra/launcher=slurm", "launcher.nproc_per_node=8", "launcher.device=cuda"]))
    check_submitit(
        _hydra_cfg(
            [
                "hydra/launcher=slurm",
                "hydra.launcher.gpus_per_node=null",
                "hydra.launcher.gres=gpu:a100:8",
                "launcher.nproc_per_node=8",
                "launcher.device=cuda",
            ]
        )
    )
    check_submitit(_hydra_cfg(["hydra/launcher=local", "launcher.nproc_per_node=2"]))
    check_submitit(_hydra_cfg(["launcher.nproc_per_node=3"]))  # Hydra's basic launcher: not checked here


@pytest.mark.dist
def test_two_faked_slurm_nodes_train_like_one_node(tmp_path, one_node_losses):
    """What each node's task does in a 2-node Slurm job, on loopback: Slurm's variables are
    faked (node list `localhost,localhost`), each "node" runs the Hydra job, which starts its
    rank through the elastic launcher; the two meet at the derived rendezvous and train with
    the losses of one 2-rank node. Each node's command is forked from the preloaded command
    server (the Slurm variables are read when the job starts, not at import); the ranks are
    started by the elastic launcher, as on a cluster. Over 20 s with the one-node reference
    it trains first: three launches, each with a fork server of its own."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = TWO_NODE_RUN
    nodes = []
    for node in (0, 1):
        env = {
            **os.environ,
            **SLURM_ENV,
            "SLURM_JOB_NUM_NODES": "2",
            "SLURM_NTASKS": "2",
            "SLURM_JOB_NODELIST": "localhost,localhost",
            "SLURM_NODEID": str(node),
            "SLURM_PROCID": str(node),
            "MASTER_PORT": str(port),
        }
        nodes.append(commands.start("hybridrec.train", *args, f"hydra.run.dir={tmp_path / 'slurm'}", env=env))
    for node in nodes:
        done = node.wait(timeout=240)
        assert done.returncode == 0, done.stderr[-3000:]
    plan = json.load(open(tmp_path / "slurm" / "plan.json"))
    assert plan["topology"]["world_size"] == 2 and plan["topology"]["local_world_size"] == 1
    losses = lambda d: [r["loss"] for r in map(json.loads, open(tmp_path / d / "metrics.jsonl")) if "loss" in r]
    assert len(losses("slurm")) == 6
    assert losses("slurm") == pytest.approx(one_node_losses, rel=1e-5, abs=1e-6)


@pytest.mark.unit
def test_ranks_are_forked_from_a_preloaded_server_only_where_no_gpu_is_usable():
    """Importing fbgemm_gpu calls torch.cuda.is_available(), which initializes CUDA in the
    fork server, and a process forked after that cannot use CUDA: a GPU machine spawns."""
    assert start_method(Cuda("12.8", 8)) == "spawn"
    assert start_method(Cuda("12.8", 0)) == "forkserver"  # a CUDA build with no usable GPU: CPU ranks
    assert start_method(Cuda(None, 0)) == "forkserver"


@pytest.mark.unit
def test_a_stopped_run_names_its_newest_checkpoint_and_how_to_resume(tmp_path):
    from hybridrec.run.launch import stopped_line

    run, ck = tmp_path / "run", tmp_path / "ck"
    assert stopped_line("stopped by SIGINT", str(run), None) == f"hybridrec: stopped by SIGINT; outputs so far in {run}"
    assert stopped_line("stopped by SIGINT", str(run), str(ck)).endswith(f"; no checkpoint saved yet in {ck}")
    for name in ("step_00000010", "step_00000020", "step_00000030.partial"):  # 30: a save cut short
        os.makedirs(ck / name)
    assert stopped_line("stopped by SIGTERM", str(run), str(ck)) == (
        f"hybridrec: stopped by SIGTERM; outputs so far in {run}; newest checkpoint {ck / 'step_00000020'}: the "
        f"same command resumes from it"
    )
