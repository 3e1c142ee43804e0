"""The user-facing commands, run for real: the elastic launcher with 2 ranks, torchrun (one
node and two), and a Hydra multirun sweep."""

import csv
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

import commands
from shared import TWO_NODE_RUN, assert_readable, trainer_log

pytestmark = pytest.mark.dist  # every test starts ranks: the elastic launcher, torchrun, a multirun's spawned jobs

# The ctr experiment's 26 features on small tables and small MLPs, on a shorter run: it still
# learns the planted signal in 40 steps, at a fraction of the full model's cost. The width
# stays 64: narrower, the planner makes most tables data-parallel, not table-wise.
SHORT = [
    "+experiment=ctr",
    "data.num_embeddings_per_feature=[1000,500,300,200,100,50,20,10,10,5,5,5,5,5,5,5,5,5,5,5,5,5,5,5,4,3]",
    "model.dense_arch_layer_sizes=[64,64]",
    "model.over_arch_layer_sizes=[64,32,1]",
    "data.batch_size=512",
    "train.steps=40",
    "train.log_every=10",
    "data.eval_batches=4",
]
TINY = [
    "data.num_embeddings_per_feature=[500,200,100]",
    "data.batch_size=128",
    "train.steps=6",
    "train.log_every=3",
    "data.eval_batches=2",
]


def _run(cmd, timeout=240):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    # torchrun's agent prefixes its lines with W/I<date>; keep the rest, where errors are
    err = "\n".join(line for line in proc.stderr.splitlines() if not re.match(r"[WI]\d{4} ", line))
    assert proc.returncode == 0, f"{cmd}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{err[-8000:]}"
    return proc


def _summary(run_dir):
    with open(os.path.join(run_dir, "summary.json")) as f:
        return json.load(f)


def test_two_ranks_via_elastic_launcher(tmp_path):
    """The whole command as a user runs it, in a new interpreter (what it prints from its
    imports on is checked): 2 ranks, validation, TensorBoard, and the profiler from the first
    step, with its one-time costs (its ProfilerStep#0 and the dense optimizer's first step),
    without a warning on the console. Over 20 s: a new interpreter and fork server, and the
    40 steps the planted signal needs to be learned."""
    run_dir = tmp_path / "run"
    proc = _run(
        [
            sys.executable,
            "-m",
            "hybridrec.train",
            *SHORT,
            "launcher.nproc_per_node=2",
            "train.eval_every=20",
            "profile.enabled=true",
            "profile.start_step=0",
            "profile.steps=5",
            "logger=tensorboard",
            f"hydra.run.dir={run_dir}",
        ]
    )
    assert f"outputs in {run_dir}" in proc.stdout
    s = _summary(run_dir)
    assert s["world_size"] == 2 and s["steps"] == 40 and s["dense_parallel"] == "fsdp"
    assert len(s["peak_rss_mb"]) == 2 and all(m > 100 for m in s["peak_rss_mb"])
    assert s["samples_per_second"] > 0 and 0 < s["train_loss"] < 0.7
    # 26 tables, spread over both ranks by the planner
    assert len(s["plan"]) == 26
    assert {r for p in s["plan"].values() for r in p["ranks"]} == {0, 1}
    # the planted signal is learned: eval over 4 global batches of 512
    assert s["eval"]["n"] == 4 * 512
    assert s["eval"]["auc"] > 0.7 and s["eval"]["ne"] < 0.95
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [r["step"] for r in records if "loss" in r] == [10, 20, 30, 40]
    # validation every 20 steps and at the end; the test split once, at the end
    assert [(r["step"], r["split"]) for r in records if "eval" in r] == [(20, "valid"), (40, "valid"), (40, "eval")]
    assert set(records[0]) >= {"step", "loss", "loss_mean", "samples_per_second", "elapsed_s", "lr"}
    # summary schema
    assert set(s["eval"]) == {"auc", "ne", "logloss", "calibration", "ctr", "accuracy", "n"}
    assert [(e["step"], e["split"]) for e in s["eval_history"]] == [(20, "valid"), (40, "valid")]
    assert s["eval_history"][-1]["auc"] == s["valid"]["auc"] != s["eval"]["auc"]
    assert s["valid"]["n"] == 4 * 512 and s["valid"]["auc"] > 0.7
    prov = s["provenance"]
    assert prov["resumed_from"] is None and len(prov["config_sha256"]) == 64
    assert prov["versions"]["torch"].startswith("2.13.0") and prov["versions"]["torchrec"] == "1.8.0"
    t = s["train"]
    assert t["steps"] == 40 and t["samples"] == 40 * 512 and t["samples_per_second"] > 0
    assert 0 < t["step_time_p50_ms"] <= t["step_time_p95_ms"]
    # profiling: a trace per rank, and comm + compute = the profiled time
    for r, p in enumerate(s["profile"]):
        assert (run_dir / "profile" / f"trace_rank{r}.json").stat().st_size > 0
        assert p["profiled_steps"] == 5 and 0 < p["comm_share"] < 1
        assert p["comm_ms"] + p["compute_ms"] == pytest.approx(p["profiled_ms"])
        # the per-step breakdown covers the step: its phases add up to the profiled time
        assert sum(p["breakdown_ms"].values()) * 5 == pytest.approx(p["profiled_ms"], rel=1e-3)
        assert (
            p["breakdown_ms"]["dense forward + backward"] > 0 and p["breakdown_ms"]["embedding lookup + all-to-all"] > 0
        )
        assert "embedding all-to-all" in p["comm_ms_by_kind"]
        # profile.start_step=0: the window starts at the first step
        trace = json.load(open(run_dir / "profile" / f"trace_rank{r}.json"))
        steps = sorted(e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#"))
        assert steps == [f"ProfilerStep#{i}" for i in range(5)]
    # the plot and the TensorBoard events
    assert open(run_dir / "report.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(run_dir / "tensorboard"))
    # the console: rank 0's plan table (once) and progress; no warnings, nothing from rank 1
    lines = [line for line in proc.stderr.replace("\r", "\n").splitlines() if line.strip()]
    noise = [
        line for line in lines if re.search(r"warn|error|traceback|rank ?1\b", line, re.I) and "USDT" not in line
    ]  # the profiler's own start/stop lines
    assert noise == [], noise
    assert not re.search(r"warn", proc.stdout + proc.stderr, re.I)
    assert (proc.stdout + proc.stderr).count("Embedding plan: 2 rank(s)") == 1
    assert (run_dir / "plan.json").exists()
    # without a terminal: one line per progress report, and rank 0's log in train.log in
    # Hydra's format, as a one-rank run writes it (tests/test_movielens.py)
    assert_readable(proc.stdout + proc.stderr, run_dir, steps=40, log_every=10)
    order = [
        m.split(":")[0] if " @ " in m else m.split()[1]
        for m in trainer_log(run_dir)
        if m.startswith("step ") or " @ step " in m
    ]
    assert order == ["10/40", "20/40", "valid @ step 20", "30/40", "40/40", "valid @ step 40", "eval @ step 40"]


def test_torchrun_shares_one_run_directory(tmp_path):
    """torchrun starts each rank as a new interpreter running the entry point: its start-up
    is the subject, so a real subprocess."""
    run_dir = tmp_path / "run"
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    _run(
        [
            torchrun,
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "hybridrec.train",
            *TINY,
            "sharding=row_wise",
            f"hydra.run.dir={run_dir}",
        ]
    )
    s = _summary(run_dir)
    assert s["world_size"] == 2
    assert {p["sharding_type"] for p in s["plan"].values()} == {"row_wise"}
    assert os.listdir(tmp_path) == ["run"]  # one run directory, not one per rank


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """One multirun over three optimizers, read by the two tests below: adagrad, adam (fused
    Adam has no CPU kernel: refused before launch) and sgd, which runs after the failure.
    Forked from the preloaded command server: the subject is the sweep, not the start-up."""
    out = tmp_path_factory.mktemp("multirun") / "sweep"
    proc = commands.run(
        "hybridrec.train", "-m", *TINY, "optimizer=adagrad,adam,sgd", f"hydra.sweep.dir={out}", timeout=300
    )
    return out, proc


def test_multirun_sweeps_optimizers(sweep):
    sweep, proc = sweep
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = sorted(d for d in os.listdir(sweep) if os.path.isdir(sweep / d) and not d.startswith("."))
    assert len(jobs) == 3 and "optimizer=adagrad" in jobs[0] and "optimizer=adam" in jobs[1]
    assert "optimizer=sgd" in jobs[2]
    ok = [jobs[0], jobs[2]]
    summaries = [_summary(sweep / j) for j in ok]
    assert summaries[0]["train_loss"] != summaries[1]["train_loss"]
    # the sweep summary (hybridrec.reports.sweep.SweepSummary): one row per job, from its summary.json;
    # the finished jobs best first by the validation objective
    rows = [r for r in csv.DictReader(open(sweep / "summary.csv")) if r["status"] == "ok"]
    assert [float(r["objective"]) for r in rows] == sorted(s["valid"]["logloss"] for s in summaries)
    assert [r["chosen"] for r in rows] == ["yes", ""]
    rows.sort(key=lambda r: int(r["job"]))
    assert [(r["job"], r["status"], r["optimizer"], r["dir"]) for r in rows] == [
        ("0", "ok", "adagrad", jobs[0]),
        ("2", "ok", "sgd", jobs[2]),
    ]
    for row, s in zip(rows, summaries):
        assert float(row["test_auc"]) == s["eval"]["auc"] and float(row["valid_ne"]) == s["valid"]["ne"]
        assert float(row["samples_per_second"]) == s["samples_per_second"] > 0
        assert float(row["peak_rss_mb"]) == max(s["peak_rss_mb"]) > 100
        # the default DLRM over 3 tables: bottom 13-64-16, top over 16 + 6 dot products (4 vectors) -> 64-32-1
        assert (
            int(row["dense_parameters"])
            == s["dense_parameters"]
            == (13 * 64 + 64 + 64 * 16 + 16 + (16 + 6) * 64 + 64 + 64 * 32 + 32 + 32 + 1)
        )
    markdown = (sweep / "summary.md").read_text()
    assert markdown.count("| ok | ") == 2 and "| optimizer |" in markdown
    assert f"hybridrec: sweep summary in {sweep}/summary.md" in proc.stdout and markdown in proc.stdout


def test_multirun_failed_job_is_a_row(sweep):
    """A job refused before launch (fused Adam has no CPU kernel) fails that job only: it
    prints its one line and returns the objective's worst value (what every sweeper ranks
    last), the next one runs, and the summary has every row, the best finished one chosen."""
    sweep, proc = sweep
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    refusal = "hybridrec: invalid config: optimizer.sparse=torch.optim.Adam has no fused CPU kernel"
    line = next(line for line in proc.stderr.splitlines() if line.startswith("hybridrec: invalid config"))
    assert line.startswith(refusal) and line.endswith("(job returns inf, the worst value)")
    rows = list(csv.DictReader(open(sweep / "summary.csv")))
    assert [(r["status"], r["chosen"]) for r in rows] == [("ok", "yes"), ("ok", ""), ("failed", "")]
    assert (rows[2]["job"], rows[2]["optimizer"]) == ("1", "adam")  # the failed row last
    assert sorted(r["optimizer"] for r in rows[:2]) == ["adagrad", "sgd"]  # the job after it ran
    assert rows[2]["error"].startswith(refusal) and rows[2]["test_auc"] == "" and rows[2]["objective"] == ""
    summary = _summary(sweep / rows[0]["dir"])
    assert float(rows[0]["test_auc"]) == summary["eval"]["auc"]
    assert float(rows[0]["objective"]) == summary["objective"]["value"] == summary["valid"]["logloss"]
    assert "| 1 | failed | adam |" in (sweep / "summary.md").read_text()


def test_two_simulated_nodes_match_one_node(tmp_path, one_node_losses):
    """Two torchrun launchers (--nnodes 2 --nproc_per_node 1) rendezvous on loopback: the
    planner sees one rank per node, and training gives the losses of one 2-rank node.
    torchrun's own start-up and rendezvous are the subject: real subprocesses (four new
    interpreters, what can take it over 20 s)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = TWO_NODE_RUN
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    nodes = [
        subprocess.Popen(
            [
                torchrun,
                "--nnodes",
                "2",
                "--nproc_per_node",
                "1",
                "--node_rank",
                str(n),
                "--rdzv_backend",
                "c10d",
                "--rdzv_endpoint",
                f"127.0.0.1:{port}",
                "--rdzv_id",
                "t",
                "-m",
                "hybridrec.train",
                *args,
                f"hydra.run.dir={tmp_path / 'nodes'}",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in (0, 1)
    ]
    for node in nodes:
        out, err = node.communicate(timeout=240)
        assert node.returncode == 0, err[-3000:]
    plan = json.load(open(tmp_path / "nodes" / "plan.json"))
    assert plan["topology"]["world_size"] == 2 and plan["topology"]["local_world_size"] == 1
    records = lambda d: [json.loads(line) for line in open(tmp_path / d / "metrics.jsonl")]
    losses = lambda d: [r["loss"] for r in records(d) if "loss" in r]
    assert losses("nodes") == pytest.approx(one_node_losses, rel=1e-5, abs=1e-6)
