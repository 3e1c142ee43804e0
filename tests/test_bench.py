"""The benchmark suite (benchmarks/bench.py): a tiny run checks that it runs end to end and
that its outputs are well-formed. Benchmarks are not timed tests: no timing is asserted."""

import json
import os
import re
import subprocess
import sys

import pytest
from PIL import Image

import commands
from shared import benchmark_script

ROOT = os.path.join(os.path.dirname(__file__), "..")

# Each before the scripts that import it: bench imports the other four.
common, levers, roofline, bench_report, bench = map(
    benchmark_script, ("common", "levers", "roofline", "bench_report", "bench")
)


def _run(rep, world, kind, rate, dense="fsdp", sharding="auto", **extra):
    return {
        "kind": kind,
        "rep": rep,
        "world_size": world,
        "sharding": sharding,
        "dense": dense,
        "pipeline": "sparse_dist",
        "samples_per_second": rate,
        "step_time_p50_ms": 1.0,
        "step_time_p95_ms": 2.0,
        "peak_rss_mb": [100.0] * world,
        "plan": {"t": ["table_wise", 1]},
        "memory_per_rank": [{"est_host_mb": 10.0, "est_device_mb": 0.0}] * world,
        **extra,
    }


@pytest.mark.unit
def test_ratios_are_per_repetition_and_answers_follow():
    """The ratio to the reference pairs runs of the same repetition (so a slow phase of the
    machine cancels), then takes median and range; the answers read the medians."""
    runs = [
        _run(0, 2, "reference", 100.0),
        _run(1, 2, "reference", 50.0),
        _run(2, 2, "reference", 80.0),
        _run(0, 2, "hybridrec", 90.0),
        _run(1, 2, "hybridrec", 55.0),
        _run(2, 2, "hybridrec", 80.0),
        _run(0, 2, "hybridrec", 100.0, "ddp"),
        _run(1, 2, "hybridrec", 60.0, "ddp"),
        _run(2, 2, "hybridrec", 84.0, "ddp"),
        _run(0, 1, "hybridrec", 70.0),
        _run(1, 1, "hybridrec", 40.0),
        _run(2, 1, "hybridrec", 50.0),
        _run(0, 2, "pregenerated", 120.0),
        _run(1, 2, "pregenerated", 50.0),
        _run(2, 2, "pregenerated", 80.0),
    ]
    configs = {c["name"]: c for c in bench_report.summarize(runs)}
    fsdp = configs["2 ranks · auto · fsdp · sparse_dist"]
    assert fsdp["median_samples_per_second"] == 80.0 and fsdp["rates"] == [90.0, 55.0, 80.0]
    assert fsdp["ratio_vs_reference"]["per_rep"] == pytest.approx([0.9, 1.1, 1.0])
    assert fsdp["ratio_vs_reference"]["median"] == pytest.approx(1.0) and len(fsdp["est_host_mb"]) == 2
    assert (fsdp["ratio_vs_reference"]["min"], fsdp["ratio_vs_reference"]["max"]) == pytest.approx((0.9, 1.1))
    assert "ratio_vs_reference" not in configs["1 rank · auto · fsdp · sparse_dist"]  # no 1-rank reference
    # the second reference (pre-generated batches) pairs repetitions the same way
    assert fsdp["ratio_vs_pregenerated"]["per_rep"] == pytest.approx([0.75, 1.1, 1.0])
    pregen = configs["2 ranks · TorchRec reference, pre-generated batches (RandomRecDataset)"]
    assert pregen["ratio_vs_reference"]["per_rep"] == pytest.approx([1.2, 1.0, 1.0])  # what input costs the loop
    a = bench_report.answers(list(configs.values()))
    assert a["fastest"] == "2 ranks · auto · ddp · sparse_dist"  # median 84 > 80
    assert a["default_behind_fastest_pct"] == pytest.approx(100 * (1 - 80 / 84))
    assert a["target_default_within_5pct"] is True
    assert a["ddp_vs_reference"]["median"] == pytest.approx(1.05) and a["target_ddp_at_least_reference"]
    assert a["ddp_vs_pregenerated"]["median"] == pytest.approx(1.05)  # 100/120, 60/50, 84/80
    assert a["fastest_vs_pregenerated"]["2"]["median"] == pytest.approx(1.05)
    assert a["fastest_vs_pregenerated"]["2"]["target_met"] is True
    assert "1" not in a["fastest_vs_pregenerated"]
    sc = next(x for x in bench_report.scaling(list(configs.values())) if x["name"] == "auto · fsdp · sparse_dist")
    assert sc["speedup"] == pytest.approx(80 / 50) and sc["efficiency"] == pytest.approx(0.8)


@pytest.mark.dist
def test_smoke_suite_writes_well_formed_outputs(tmp_path, monkeypatch):
    """The harness end to end on one tiny configuration (1 rank): hybridrec, both TorchRec
    references, a profiled run and the roofline, then results.json, REPORT.md and the charts.
    The commands it starts are forked from the suite's preloaded server (tests/commands.py):
    the same commands, without paying the imports for each."""
    out = tmp_path / "bench"
    monkeypatch.setattr(common.subprocess, "run", commands.subprocess_run)
    monkeypatch.setattr(sys, "argv", ["bench.py", "--preset", "smoke", "--out", str(out)])
    bench.main()
    res = json.load(open(out / "results.json"))
    p = bench.PRESETS["smoke"]

    # every result carries the method, the machine and its complete resolved config
    assert res["suite"]["preset"] == "smoke" and res["suite"]["reps"] == p.reps
    assert res["suite"]["warmup_steps"] == p.warmup and res["suite"]["steps"] == p.steps and res["suite"]["date"]
    assert {"cpu", "cores", "gpu", "python", "torch", "torchrec", "fbgemm_gpu"} <= set(res["machine"])
    assert res["machine"]["torch"] and res["machine"]["cores"] >= 1
    assert len(res["runs"]) == 4  # hybridrec, the two references, the profiled run
    for r in res["runs"]:
        cfg = r["config"]
        assert {"model", "data", "sharding", "optimizer", "mesh", "train"} <= set(cfg)
        assert cfg["data"]["batch_size"] == p.per_rank_batch * r["world_size"]  # weak scaling
        assert cfg["data"]["num_embeddings_per_feature"] == [500, 200, 100]  # the preset's overrides
        assert len(r["peak_rss_mb"]) == r["world_size"] and all(m > 0 for m in r["peak_rss_mb"])
        assert r["samples_per_second"] > 0
        assert 0 < r["step_time_p50_ms"] <= r["step_time_p95_ms"]
        if r["kind"] == "hybridrec":
            assert r["config"]["train"]["steps"] == p.steps and r["config"]["train"]["log_every"] == p.warmup
            assert (out / r["run_dir"] / "summary.json").exists()
    kinds = {(c["kind"], c["world_size"]) for c in res["configs"]}
    assert kinds == {("hybridrec", 1), ("reference", 1), ("pregenerated", 1)}
    for c in res["configs"]:
        assert len(c["rates"]) == p.reps
        assert c["min_samples_per_second"] <= c["median_samples_per_second"] <= c["max_samples_per_second"]
    one = next(c for c in res["configs"] if c["kind"] == "hybridrec")
    assert len(one["ratio_vs_reference"]["per_rep"]) == p.reps and len(one["est_host_mb"]) == 1
    assert len(one["ratio_vs_pregenerated"]["per_rep"]) == p.reps
    assert res["scaling"] == []  # one world size: nothing to scale against
    assert res["answers"]["default"] == "1 rank · auto · fsdp · sparse_dist"
    # the roofline: a FLOP count and a GEMM rate, and a fraction for every configuration
    assert res["roofline"]["flops_per_sample"] > 0 and len(res["roofline"]["sgemm_gflops"]) == 2
    assert all(0 < c["dense_roofline"] < 1 for c in res["configs"])
    # the profiled breakdown adds up to the step, per rank
    (prof,) = res["profile"]
    for rank in prof["profile"]:
        b = rank["breakdown_ms"]
        assert sum(b.values()) * rank["profiled_steps"] == pytest.approx(rank["profiled_ms"], rel=1e-3)

    # the report: every section, in order, and a table row per configuration
    text = open(out / "REPORT.md").read()
    positions = [text.index(section) for section in bench_report.REPORT_SECTIONS]
    assert positions == sorted(positions)
    for c in res["configs"]:
        assert f"| {c['name']} |" in text
    assert "On 1 rank, `mesh=fsdp` and `mesh=ddp` both run the dense part unwrapped" in text
    # the charts are real PNG images with content
    for chart in bench_report.CHARTS:
        with Image.open(out / chart) as im:
            assert im.format == "PNG" and im.size[0] > 100 and im.size[1] > 100
            im.verify()
        assert f"]({chart})" in text


@pytest.mark.unit
def test_the_levers_run_every_lever_and_the_reference_once_per_repetition(tmp_path):
    """levers.measure with stand-in runners (the runs themselves are the harness's, checked
    above): each lever and the reference once per repetition, at the multi-rank world."""
    p = bench.dataclasses.replace(bench.PRESETS["quick"], **bench.SMOKE_SECTIONS)
    calls = []

    def single(p, world, rep, out, tag, overrides, per_rank_batch=None):
        calls.append((rep, tag))
        return {"samples_per_second": 100.0 + rep}

    res = levers.measure(p, str(tmp_path), 2, single, lambda *a, **k: {"samples_per_second": 90.0}, names=p.levers)
    assert set(res["rates"]) == set(p.levers) | {"reference"}
    assert all(len(v) == 2 and min(v) > 0 for v in res["rates"].values())
    assert [rep for rep, _ in calls] == [0, 0, 1, 1] and res["world_size"] == p.worlds[-1] == 2
    rows = levers.summarize(res)
    assert {r["name"] for r in rows} == set(p.levers)


@pytest.mark.dist
def test_the_dense_memory_section_measures_every_mode_on_each_rank(cfg_factory):
    """benchmarks/dense_memory.py's per-rank measurement, at the smoke size, on the suite's
    pool of 2 ranks: each mode (DDP, FSDP2, FSDP2 with bf16) on both ranks, its bytes split as
    the report's table reads them."""
    from dist_helpers import spawn

    dense_memory = benchmark_script("dense_memory")
    sections = bench.SMOKE_SECTIONS
    cfgs = [cfg_factory(sections["dense_memory_model"] + overrides) for overrides in dense_memory.MODES.values()]
    ranks = dict(zip(dense_memory.MODES, spawn(dense_memory.measure, 2, cfgs, sections["dense_memory_steps"], 1)))
    assert set(ranks) == {"ddp", "fsdp", "fsdp bf16"}
    assert all(len(v) == 2 for v in ranks.values())
    for mode, per_rank in ranks.items():
        for m in per_rank:
            assert m["params"] > 0 and m["grads"] > 0 and m["samples_per_second"] > 0, (mode, m)
    totals = dense_memory.totals(ranks)
    assert max(totals["fsdp"]) < max(totals["ddp"])  # FSDP2 shards what DDP replicates
    assert any(line.startswith("| fsdp bf16 | 1 |") for line in dense_memory.table(ranks))


@pytest.mark.slow
def test_the_input_section_measures_every_source_and_world_size(monkeypatch):
    """benchmarks/input_scaling.py at the smoke size: per-rank cost at 1, 2, 4 and 8 ranks for
    every source, input rates with 0 and 2 workers, the converter and training's consumption
    (its commands forked from the suite's preloaded server), and the report's table. About
    40 s: it writes and converts a TSV, and trains three short runs."""
    input_scaling = benchmark_script("input_scaling")
    monkeypatch.setattr(input_scaling.subprocess, "run", commands.subprocess_run)
    res = input_scaling.measure(**bench.SMOKE_SECTIONS["input"])
    sources = {
        "synthetic (ctr)",
        "Criteo TSV (8 shards)",
        "Criteo binary",
        "Parquet (the binary rows)",
        "Parquet, data.shards=8",
    }  # quick=True: without the dcnv2 shape
    assert set(res["scaling"]) == set(res["rates"]) == sources
    for s in res["scaling"].values():
        assert set(s["weak"]) == set(s["strong"]) == {"1", "2", "4", "8"} and min(s["weak"].values()) > 0
    assert set(res["training"]) == {"num_workers=0", "num_workers=2", "pre-built batch"}
    assert all(v > 0 for v in res["converter"].values())
    assert any(line.startswith("| Criteo binary | weak |") for line in input_scaling.table(res))


# ------------------------------------------------------------------------------ the gpu preset
GPU_REFUSAL = "bench: the gpu preset needs CUDA: "


@pytest.mark.unit
@pytest.mark.parametrize(
    "build, available, reason",
    [
        (None, False, "torch {torch} is a CPU-only build"),
        ("12.8", False, "torch has CUDA 12.8 but sees no usable GPU"),
    ],
)
def test_gpu_preset_refuses_without_cuda_in_one_line(monkeypatch, tmp_path, build, available, reason):
    """Each reason a machine cannot run the gpu preset stops it before anything runs (no
    output directory), in one line naming the reason."""
    import torch

    monkeypatch.setattr(torch.version, "cuda", build)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: int(available))
    out = tmp_path / "bench-gpu"
    monkeypatch.setattr(sys, "argv", ["bench.py", "--preset", "gpu", "--out", str(out)])
    with pytest.raises(SystemExit) as e:
        bench.main()
    assert isinstance(e.value.code, str) and "\n" not in e.value.code
    assert e.value.code.startswith(GPU_REFUSAL + reason.format(torch=torch.__version__))
    assert not out.exists()


@pytest.mark.dist
def test_gpu_preset_without_a_visible_gpu_prints_one_line_and_no_traceback(tmp_path):
    """The real command with every GPU hidden (on a CPU-only build: that build is the reason)."""
    out = tmp_path / "bench-gpu"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench.py"), "--preset", "gpu", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert proc.returncode == 1 and proc.stdout == ""
    (line,) = proc.stderr.splitlines()
    assert line.startswith(GPU_REFUSAL) and not out.exists()


@pytest.mark.unit
def test_gpu_preset_runs_every_gpu_on_cuda(monkeypatch, tmp_path):
    """On 4 GPUs: 1 and 4 ranks, hybridrec with launcher.device=cuda and the reference with
    --device cuda on as many ranks, both at 8192 rows per rank; the levers at 4 ranks
    without the CPU thread split. One GPU: the 1-rank comparison only, and the report says so."""
    p = bench.on_local_gpus(bench.PRESETS["gpu"], 4)
    assert p.worlds == p.reference_worlds == (1, 4) and p.device == "cuda" and p.per_rank_batch == 8192
    assert not (p.roofline or p.profile or p.dense_memory_steps or p.input)
    assert "every core on every rank" not in p.levers and "bf16 dense compute, fp32 reduce" in p.levers
    one = bench.on_local_gpus(bench.PRESETS["gpu"], 1)
    assert one.worlds == one.reference_worlds == (1,) and "1-rank comparison only" in one.notes[-1]

    commands = []

    def record(cmd, log):  # the command each runner would start
        commands.append(cmd)
        raise StopIteration

    monkeypatch.setattr(bench, "run_logged", record)
    for runner in (
        lambda: bench.sweep(p, 4, 0, str(tmp_path)),
        lambda: bench.reference(p, 4, 0, str(tmp_path)),
        lambda: bench.single(p, 4, 0, str(tmp_path), "x", []),
    ):
        with pytest.raises(StopIteration):
            runner()
    sweep, ref, single = commands
    for cmd in (sweep, single):
        assert {"launcher.device=cuda", "launcher.nproc_per_node=4", "data.batch_size=32768"} <= set(cmd)
    assert "sharding=auto,table_wise,row_wise,column_wise,table_row_wise" in sweep and "mesh=ddp,fsdp" in sweep
    assert {"--nproc_per_node=4", "--device=cuda", "data.batch_size=32768", "--steps=400", "--warmup=50"} <= set(ref)

    worlds = []
    fake = lambda *a, **k: worlds.append(a[1]) or {"samples_per_second": 1.0}
    res = levers.measure(p, str(tmp_path), 1, fake, fake, names=p.levers)
    assert set(worlds) == {4} and res["world_size"] == 4


@pytest.mark.slow  # two planners' searches over 26 tables for 4 ranks: seconds
def test_both_planners_choose_the_fused_cuda_kernels_for_the_gpu_preset(cfg_factory):
    """What the gpu preset runs, planned for 4 GPUs without any GPU: the reference's planner
    (its own Topology) and hybridrec's put every ctr table in device memory with FBGEMM's
    fused kernel, not a UVM or host-memory kernel."""
    import torch
    from torchrec.distributed.sharding_plan import get_default_sharders

    from hybridrec.data.synthetic import SyntheticClickLog
    from hybridrec.parallel.parallel_dims import planning_dims
    from hybridrec.run.preflight import dry_plan

    ref = benchmark_script("reference_torchrec")
    batch = bench.PRESETS["gpu"].per_rank_batch
    cfg = cfg_factory(["+experiment=ctr", f"data.batch_size={4 * batch}"])  # ref.experiment_config's
    model = ref.build_model(cfg, SyntheticClickLog(seed=cfg.seed, **ref.kwargs(cfg.data)), torch.device("cpu"))
    planner = ref.build_planner(4, 4, "cuda", batch)
    plan = planner.plan(model, get_default_sharders())
    kernels = {t: p.compute_kernel for m in plan.plan.values() for t, p in m.items()}
    assert len(kernels) == 26 and set(kernels.values()) == {"fused"}
    assert sorted({r for m in plan.plan.values() for p in m.values() for r in p.ranks}) == [0, 1, 2, 3]

    ours = cfg_factory(
        ["+experiment=ctr", f"data.batch_size={4 * batch}", "launcher.device=cuda", "launcher.nproc_per_node=4"]
    )
    tables = dry_plan(ours, planning_dims(ours), detect=False)["tables"]
    assert len(tables) == 26 and {t["compute_kernel"] for t in tables.values()} == {"fused"}


def _gpu_results(tmp_path):
    """A results.json as the gpu preset writes it on 4 GPUs, from hand-made runs."""
    runs = []
    for rep in range(2):
        for world, ref_rate in ((1, 100_000.0), (4, 300_000.0)):
            gpu = dict(device="cuda:0", compute_kernels={"t": "fused"}, peak_device_allocated_mb=[500.0] * world)
            runs.append(_run(rep, world, "reference", ref_rate, dense="ddp", **gpu))
            runs.append(_run(rep, world, "hybridrec", ref_rate * 1.1, **gpu))
            runs.append(_run(rep, world, "hybridrec", ref_rate * 1.2, dense="ddp", **gpu))
    for r in runs:
        if r["kind"] == "reference":
            r["sharding"] = "torchrec planner"
    configs = bench_report.summarize(runs)
    p = bench.on_local_gpus(bench.PRESETS["gpu"], 4)
    lever_rates = {n: [1000.0, 1100.0] for n in p.levers + ["reference"]}
    return {
        "suite": {
            "preset": "gpu",
            **bench.dataclasses.asdict(p),
            "warmup_steps": p.warmup,
            "command": "python benchmarks/bench.py --preset gpu",
            "date": "2026-01-01T00:00:00+00:00",
            "duration_s": 600.0,
        },
        "machine": {
            "cpu": "Some CPU",
            "cores": 64,
            "gpu": "NVIDIA H100 80GB HBM3",
            "gpu_count": 4,
            "cuda": "12.6",
            "python": "3.11",
            "torch": "2.13.0",
            "torchrec": "1.8.0",
            "fbgemm_gpu": "1.8.0",
            "hydra": "1.3.2",
        },
        "configs": configs,
        "scaling": bench_report.scaling(configs),
        "answers": bench_report.answers(configs),
        "profile": [],
        "roofline": None,
        "runs": runs,
        "levers": {
            "rates": lever_rates,
            "per_rank_batch": {n: 8192 for n in p.levers},
            "overrides": {n: levers.LEVERS[n]["overrides"] for n in p.levers},
            "reps": 2,
            "world_size": 4,
        },
    }


@pytest.mark.unit
def test_report_of_four_gpus_names_four_ranks_and_the_gpus(tmp_path):
    res = _gpu_results(tmp_path)
    (sc,) = [s for s in res["scaling"] if s["name"] == "auto · fsdp · sparse_dist"]
    assert sc["world_size"] == 4 and sc["efficiency"] == pytest.approx(3 / 4)  # 330k / (4 x 110k)
    assert res["answers"]["default"] == "4 ranks · auto · fsdp · sparse_dist"
    text = bench_report.report(res)
    assert "2 ranks" not in text and "2-rank" not in text
    assert "Fastest at 4 ranks: **4 ranks · auto · ddp · sparse_dist**" in text
    assert "Scaling 1 -> 4 ranks (auto · fsdp · sparse_dist): 3.00x throughput (efficiency 75% of ideal 4x)" in text
    assert "| configuration | 1 rank samples/s | 4 ranks samples/s | speed-up | efficiency |" in text
    assert "4 x NVIDIA H100 80GB HBM3" in text.split("## Answers")[0]
    assert "Embedding kernels the planners chose: hybridrec fused; reference fused" in text
    assert "Not run on GPUs: the profiled breakdown" in text and "Dense roofline: not measured" in text
    assert (
        "| 4 ranks · auto · fsdp · sparse_dist | table_wise x1 | 100, 100, 100, 100 | 10, 10, 10, 10 | "
        "500, 500, 500, 500 |" in text
    )
    assert "4 ranks, 2 alternating repetitions, 4 x NVIDIA H100 80GB HBM3 (CUDA 12.6)." in text  # the levers
    positions = [text.index(section) for section in bench_report.REPORT_SECTIONS]
    assert positions == sorted(positions)
    bench_report.charts(res, str(tmp_path))
    for chart in bench_report.CHARTS:
        with Image.open(tmp_path / chart) as im:
            assert im.format == "PNG" and im.size[0] > 100 and im.size[1] > 100


@pytest.mark.unit
def test_report_of_one_gpu_is_the_one_rank_comparison():
    res = _gpu_results(None)
    res["runs"] = [r for r in res["runs"] if r["world_size"] == 1]
    res["configs"] = bench_report.summarize(res["runs"])
    res["scaling"], res["answers"] = bench_report.scaling(res["configs"]), bench_report.answers(res["configs"])
    res["suite"]["notes"] = list(bench.on_local_gpus(bench.PRESETS["gpu"], 1).notes)
    res["levers"]["world_size"] = 1  # (measured at the one world)
    text = bench_report.report(res)
    assert not re.search(r"\d+ ranks", text)
    assert "Fastest at 1 rank: **1 rank · auto · ddp · sparse_dist**" in text
    assert "One GPU: the 1-rank comparison only" in text and "no scaling to report" in text


@pytest.mark.dist
def test_the_pregenerated_reference_feeds_the_experiments_shapes(tmp_path):
    """reference_torchrec.py --input pregenerated: TorchRec's RandomRecDataset with the
    synthetic log's shapes (rows per rank, ids per feature, dense width) trains and reports."""
    out = tmp_path / "ref.json"
    proc = commands.run(
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        os.path.join(os.path.dirname(__file__), "..", "benchmarks", "reference_torchrec.py"),
        "--steps",
        "6",
        "--warmup",
        "2",
        "--out",
        str(out),
        "--input",
        "pregenerated",
        "--device",
        "cpu",
        "data.batch_size=128",
        "data.num_embeddings_per_feature=[500,200,100]",
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.load(open(out))
    assert result["input"] == "pregenerated" and result["world_size"] == 2 and result["samples_per_second"] > 0
    assert 0.3 < result["train_loss"] < 1.5  # BCE on random labels: near log 2


@pytest.mark.unit
def test_an_interrupted_suite_reports_what_finished_with_the_machines_load(tmp_path, capsys):
    """Ctrl-C during the first repetition at 2 ranks: the 1-rank runs finished, the rest did
    not; the report says it is partial and names the load the numbers were measured under."""
    res = _gpu_results(None)
    res["runs"] = [r for r in res["runs"] if r["world_size"] == 1 and r["rep"] == 0]
    for key in ("configs", "scaling", "answers", "levers", "profile", "roofline"):
        del res[key]  # measure() had not reached them
    res["suite"]["interrupted"] = "stopped by the user after 1.5 min"
    res["machine"]["load_average"] = {"median": 2.4, "max": 3.1, "cores": 64}
    bench.write_results(res, str(tmp_path))
    text = (tmp_path / "REPORT.md").read_text()
    assert "**Partial: stopped by the user after 1.5 min.**" in text
    assert "load average while it ran: median 2.4, max 3.1 (64 cores" in text
    assert "1 rank · auto · ddp · sparse_dist" in text
    assert json.load(open(tmp_path / "results.json"))["suite"]["interrupted"]
    capsys.readouterr()
    res["runs"] = []  # stopped before any run finished: no report, one line
    with pytest.raises(SystemExit, match="no run finished"):
        bench.write_results(res, str(tmp_path))


@pytest.mark.unit
def test_bench_gpu_report_is_the_stored_runs():
    """BENCH_GPU.md is what bench_gpu.py renders from the stored bench_gpu.json (no number typed
    by hand), and names every run that did not finish with its reason."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_gpu

    results = os.path.join(ROOT, "benchmarks", "results")
    with open(os.path.join(results, "bench_gpu.json")) as f:
        stored = json.load(f)
    with open(os.path.join(results, "BENCH_GPU.md")) as f:
        assert f.read() == bench_gpu.report(stored)
    for name in stored["failed"]:
        assert f"`{name}`" in bench_gpu.report(stored)
