"""The benchmark suite (benchmarks/bench.py): a tiny run checks that it runs end to end and
that its outputs are well-formed. Benchmarks are not timed tests: no timing is asserted."""

import json
import os
import subprocess
import sys

import pytest
from PIL import Image

ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench  # noqa: E402
import bench_report  # noqa: E402


def _run(rep, world, kind, rate, dense="fsdp", sharding="auto"):
    return {"kind": kind, "rep": rep, "world_size": world, "sharding": sharding, "dense": dense,
            "pipeline": "sparse_dist", "samples_per_second": rate, "step_time_p50_ms": 1.0,
            "step_time_p95_ms": 2.0, "peak_rss_mb": [100.0] * world, "plan": {"t": ["table_wise", 1]},
            "memory_per_rank": [{"est_host_mb": 10.0, "est_device_mb": 0.0}] * world}


@pytest.mark.unit
def test_ratios_are_per_repetition_and_answers_follow():
    """The ratio to the reference pairs runs of the same repetition (so a slow phase of the
    machine cancels), then takes median and range; the answers read the medians."""
    runs = [_run(0, 2, "reference", 100.0), _run(1, 2, "reference", 50.0), _run(2, 2, "reference", 80.0),
            _run(0, 2, "hybridrec", 90.0), _run(1, 2, "hybridrec", 55.0), _run(2, 2, "hybridrec", 80.0),
            _run(0, 2, "hybridrec", 100.0, "ddp"), _run(1, 2, "hybridrec", 60.0, "ddp"),
            _run(2, 2, "hybridrec", 84.0, "ddp"),
            _run(0, 1, "hybridrec", 70.0), _run(1, 1, "hybridrec", 40.0), _run(2, 1, "hybridrec", 50.0)]
    configs = {c["name"]: c for c in bench_report.summarize(runs)}
    fsdp = configs["2 ranks · auto · fsdp · sparse_dist"]
    assert fsdp["median_samples_per_second"] == 80.0 and fsdp["rates"] == [90.0, 55.0, 80.0]
    assert fsdp["ratio_vs_reference"]["per_rep"] == pytest.approx([0.9, 1.1, 1.0])
    assert fsdp["ratio_vs_reference"]["median"] == pytest.approx(1.0)
    assert (fsdp["ratio_vs_reference"]["min"], fsdp["ratio_vs_reference"]["max"]) == pytest.approx((0.9, 1.1))
    assert "ratio_vs_reference" not in configs["1 rank · auto · fsdp · sparse_dist"]  # no 1-rank reference
    a = bench_report.answers(list(configs.values()))
    assert a["fastest"] == "2 ranks · auto · ddp · sparse_dist"  # median 84 > 80
    assert a["default_behind_fastest_pct"] == pytest.approx(100 * (1 - 80 / 84))
    assert a["target_default_within_5pct"] is True
    assert a["ddp_vs_reference"]["median"] == pytest.approx(1.05) and a["target_ddp_at_least_reference"]
    (sc,) = bench_report.scaling(list(configs.values()))
    assert sc["speedup"] == pytest.approx(80 / 50) and sc["efficiency"] == pytest.approx(0.8)


@pytest.mark.dist
def test_smoke_suite_writes_well_formed_outputs(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench.py"), "--preset", "smoke",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    res = json.load(open(out / "results.json"))
    p = bench.PRESETS["smoke"]

    # every result carries the method, the machine and its complete resolved config
    assert res["suite"]["preset"] == "smoke" and res["suite"]["reps"] == p.reps
    assert res["suite"]["warmup_steps"] == p.warmup and res["suite"]["steps"] == p.steps and res["suite"]["date"]
    assert {"cpu", "cores", "gpu", "python", "torch", "torchrec", "fbgemm_gpu"} <= set(res["machine"])
    assert res["machine"]["torch"] and res["machine"]["cores"] >= 1
    assert len(res["runs"]) == 4  # 1-rank hybridrec, 2-rank hybridrec, 2-rank reference, profiled run
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
    assert kinds == {("hybridrec", 1), ("hybridrec", 2), ("reference", 2)}
    for c in res["configs"]:
        assert len(c["rates"]) == p.reps
        assert c["min_samples_per_second"] <= c["median_samples_per_second"] <= c["max_samples_per_second"]
    two = next(c for c in res["configs"] if c["kind"] == "hybridrec" and c["world_size"] == 2)
    assert len(two["ratio_vs_reference"]["per_rep"]) == p.reps and len(two["est_host_mb"]) == 2
    assert [s["name"] for s in res["scaling"]] == ["auto · fsdp · sparse_dist"]
    assert res["answers"]["default"] == "2 ranks · auto · fsdp · sparse_dist"
    assert set(res["dense_memory"]["ranks"]) == {"ddp", "fsdp", "fsdp bf16"}
    # the roofline: a FLOP count and a GEMM rate, and a fraction for every configuration
    assert res["roofline"]["flops_per_sample"] > 0 and len(res["roofline"]["sgemm_gflops"]) == 2
    assert all(0 < c["dense_roofline"] < 1 for c in res["configs"])
    # the profiled breakdown adds up to the step, per rank
    (prof,) = res["profile"]
    for rank in prof["profile"]:
        b = rank["breakdown_ms"]
        assert sum(b.values()) * rank["profiled_steps"] == pytest.approx(rank["profiled_ms"], rel=1e-3)
    # levers: every lever and the reference once per repetition
    assert set(res["levers"]["rates"]) == set(p.levers) | {"reference"}
    assert all(len(v) == p.levers_reps and min(v) > 0 for v in res["levers"]["rates"].values())
    assert all(len(v) == 2 for v in res["dense_memory"]["ranks"].values())
    sources = {"synthetic (ctr)", "Criteo TSV (8 shards)", "Criteo binary"}  # the smoke preset's (quick)
    assert set(res["input"]["scaling"]) == set(res["input"]["rates"]) == sources
    for s in res["input"]["scaling"].values():
        assert set(s["weak"]) == set(s["strong"]) == {"1", "2", "4", "8"} and min(s["weak"].values()) > 0
    assert set(res["input"]["training"]) == {"num_workers=0", "num_workers=2", "pre-built batch"}
    assert all(v > 0 for v in res["input"]["converter"].values())

    # the report: every section, in order, and a table row per configuration
    text = open(out / "REPORT.md").read()
    positions = [text.index(section) for section in bench_report.REPORT_SECTIONS]
    assert positions == sorted(positions)
    for c in res["configs"]:
        assert f"| {c['name']} |" in text
    # the charts are real PNG images with content
    for chart in bench_report.CHARTS:
        with Image.open(out / chart) as im:
            assert im.format == "PNG" and im.size[0] > 100 and im.size[1] > 100
            im.verify()
        assert f"]({chart})" in text
