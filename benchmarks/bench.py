"""The benchmark suite: hybridrec across sharding x dense x pipeline x world size, beside a
hand-written TorchRec loop (benchmarks/reference_torchrec.py), with report and charts.

What runs is what users run: each repetition is a Hydra multirun over the real entry point,

    python -m hybridrec.train -m +experiment=ctr sharding=auto,table_wise,... mesh=ddp,fsdp \\
        train.pipeline=sparse_dist,base launcher.nproc_per_node=2 ...

one per world size, each followed by the reference at that world size (torchrun). Repetitions
alternate (every configuration once per repetition, the sweep order reversed on every other
one), so slow phases of a shared machine hit every configuration alike.

- Weak scaling: the per-rank batch is fixed (``--per-rank-batch``, 1024 = ctr's global 2048
  over 2 ranks), so ``data.batch_size`` = per-rank batch x world size.
- Rate: steady state from metrics.jsonl, from the end of step ``warmup`` (the first log
  window: tracing, pipeline fill, lazy init) to the last step; the reference is timed over
  the same steps. Step time p50/p95 and peak RSS per rank come from summary.json.
- At 1 rank every sharding type puts every shard on the same rank: sharding is not varied
  there (sharding=auto), only dense mode and pipeline.
- Folded in: FSDP2 vs DDP dense-state bytes (dense_memory.py), the input pipeline's per-rank
  cost against world size and its rate beside training (input_scaling.py), and the
  comm/compute split of profiled runs (profile.enabled=true).

    python benchmarks/bench.py                 # full suite (make bench), ~30-35 min on 2 cores
    python benchmarks/bench.py --preset quick  # representative subset (make bench-quick), < 5 min
    python benchmarks/bench.py --preset smoke --out /tmp/b   # tiny: checks the outputs only
Writes <out>/results.json (every raw number), REPORT.md and PNG charts, and each run's own
directory under <out>/raw/. --out defaults to benchmarks/results for the full suite and to
outputs/bench-<preset> for the others.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

SHARDINGS = ["auto", "table_wise", "row_wise", "column_wise", "table_row_wise"]
TINY = ["data.num_embeddings_per_feature=[500,200,100]", "model.embedding_dim=16",
        "model.dense_arch_layer_sizes=[32,16]", "model.over_arch_layer_sizes=[32,1]"]
TINY_DENSE = ["model=dcn", "model.embedding_dim=8", "model.dense_arch_layer_sizes=[16,8]",
              "model.over_arch_layer_sizes=[64,1]", "model.dcn_num_layers=1", "model.dcn_low_rank_dim=8",
              "data.num_embeddings_per_feature=[100,100]", "data.batch_size=64", "sharding=table_wise"]


@dataclasses.dataclass
class Preset:
    reps: int
    steps: int
    warmup: int
    per_rank_batch: int
    world1: dict[str, list[str]]
    """Sweep of the 1-rank runs: override key -> values."""
    world2: dict[str, list[str]]
    profile: list[str]
    """Dense modes profiled once each (2 ranks, default sharding and pipeline); [] = none."""
    dense_memory_steps: int
    """0 = not run."""
    input: dict[str, Any]
    """input_scaling.measure's arguments ({} = not run)."""
    reference_worlds: tuple[int, ...] = (1, 2)
    """World sizes the reference runs at."""
    overrides: list[str] = dataclasses.field(default_factory=list)
    """Extra Hydra overrides for every run (the smoke preset's tiny model)."""
    dense_memory_model: list[str] | None = None


BOTH = {"mesh": ["ddp", "fsdp"], "train.pipeline": ["sparse_dist", "base"]}
PRESETS = {
    # 3 x (20 + 4 hybridrec runs + 2 reference runs) + profiles, dense memory, input:
    # ~30-35 min on 2 CPU cores (the input section: ~7 min).
    "full": Preset(reps=3, steps=150, warmup=30, per_rank_batch=1024,
                   world1={"sharding": ["auto"], **BOTH}, world2={"sharding": SHARDINGS, **BOTH},
                   profile=["ddp", "fsdp"], dense_memory_steps=8,
                   input=dict(reps=3, tsv_rows=200_000, steps=12, train_steps=60)),
    # The default (fsdp) and ddp at both sizes beside the reference, every section of the
    # report: ~3 min on a quiet 2-core machine (6 min measured with the cores shared).
    "quick": Preset(reps=2, steps=80, warmup=20, per_rank_batch=1024,
                    world1={"sharding": ["auto"], "mesh": ["ddp", "fsdp"], "train.pipeline": ["sparse_dist"]},
                    world2={"sharding": ["auto"], "mesh": ["ddp", "fsdp"], "train.pipeline": ["sparse_dist"]},
                    profile=[], dense_memory_steps=2,
                    input=dict(reps=1, tsv_rows=50_000, steps=6, train_steps=40, quick=True, scale=4)),
    # A tiny model, to check the suite runs and its outputs are well-formed (CI): no timings.
    "smoke": Preset(reps=1, steps=6, warmup=2, per_rank_batch=64,
                    world1={"sharding": ["auto"], "mesh": ["fsdp"], "train.pipeline": ["sparse_dist"]},
                    world2={"sharding": ["auto"], "mesh": ["fsdp"], "train.pipeline": ["sparse_dist"]},
                    profile=[], dense_memory_steps=1, reference_worlds=(2,),
                    input=dict(reps=1, tsv_rows=4096, steps=2, train_steps=12, quick=True, scale=16),
                    overrides=TINY, dense_memory_model=TINY_DENSE),
}
REPORT_SECTIONS = ["## Machine and method", "## Answers", "## Throughput and ratio vs reference",
                   "## Memory per rank", "## Weak scaling", "## Communication share (profiled)",
                   "## Dense-state memory: DDP vs FSDP2", "## Input pipeline", "## Charts"]
CHARTS = ["throughput_by_strategy.png", "memory_per_rank.png", "reference_ratio.png", "scaling.png"]


# ------------------------------------------------------------------------------ running
def _run(cmd: list[str], log: str) -> None:
    """Run a command, its output to ``log``; a failure raises with the log's tail."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    if proc.returncode:
        tail = open(log).read()[-4000:]
        raise RuntimeError(f"failed ({proc.returncode}): {' '.join(cmd)}\n--- {log}\n{tail}")


def _load_yaml(path: str) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(path), resolve=True)


def steady_rate(run_dir: str, global_batch: int, warmup: int) -> float:
    """samples/s from the end of step ``warmup`` to the last step (metrics.jsonl)."""
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    rows = [r for r in rows if "elapsed_s" in r]  # step records (eval records have none)
    first, last = rows[0], rows[-1]
    if first["step"] != warmup:
        raise RuntimeError(f"{run_dir}: first log record at step {first['step']}, expected {warmup}")
    return (last["step"] - first["step"]) * global_batch / (last["elapsed_s"] - first["elapsed_s"])


def sweep(p: Preset, world: int, rep: int, out: str, extra: list[str] = (), sweep_values=None) -> list[dict]:
    """One Hydra multirun of hybridrec at ``world`` ranks; one record per job."""
    values = sweep_values or (p.world1 if world == 1 else p.world2)
    # Every other repetition runs the sweep backwards: drift over the run cancels out.
    order = (lambda v: v[::-1]) if rep % 2 else (lambda v: v)
    swept = [f"{k}={','.join(order(v))}" for k, v in values.items()]
    tag = f"rep{rep}_world{world}{'_profile' if extra else ''}"
    sweep_dir = os.path.join(out, "raw", tag)
    if os.path.exists(sweep_dir):  # a previous suite's runs: Hydra would add to them
        shutil.rmtree(sweep_dir)
    cmd = [sys.executable, "-m", "hybridrec.train", "-m", "+experiment=ctr", *swept,
           f"launcher.nproc_per_node={world}", f"data.batch_size={p.per_rank_batch * world}",
           f"train.steps={p.steps}", f"train.log_every={p.warmup}", "data.eval_batches=1",
           *p.overrides, *extra, f"hydra.sweep.dir={sweep_dir}", "hydra.sweep.subdir=${hydra.job.num}"]
    os.makedirs(os.path.join(out, "raw"), exist_ok=True)
    _run(cmd, os.path.join(out, "raw", f"{tag}.log"))
    records = []
    for job in sorted(os.listdir(sweep_dir), key=lambda d: int(d) if d.isdigit() else -1):
        job_dir = os.path.join(sweep_dir, job)
        if not os.path.exists(os.path.join(job_dir, "summary.json")):
            continue  # multirun.yaml
        s = json.load(open(os.path.join(job_dir, "summary.json")))
        cfg = _load_yaml(os.path.join(job_dir, ".hydra", "config.yaml"))
        records.append({
            "kind": "hybridrec",
            "rep": rep,
            "world_size": s["world_size"],
            "sharding": _sharding_name(cfg),
            "dense": cfg["mesh"]["dense"],
            "pipeline": cfg["train"]["pipeline"],
            "samples_per_second": steady_rate(job_dir, s["global_batch_size"], p.warmup),
            "samples_per_second_incl_warmup": s["train"]["samples_per_second"],
            "step_time_p50_ms": s["train"]["step_time_p50_ms"],
            "step_time_p95_ms": s["train"]["step_time_p95_ms"],
            "peak_rss_mb": s["peak_rss_mb"],
            "memory_per_rank": s["memory_per_rank"],
            "plan": {t: [v["sharding_type"], len(v["ranks"])] for t, v in s["plan"].items()},
            "train_loss": s["train_loss"],
            "profile": s.get("profile"),
            "overrides": _load_yaml(os.path.join(job_dir, ".hydra", "overrides.yaml")),
            "config": cfg,
            "run_dir": os.path.relpath(job_dir, out),
        })
    expected = 1
    for v in values.values():
        expected *= len(v)
    if len(records) != expected:
        raise RuntimeError(f"{sweep_dir}: {len(records)} finished jobs, expected {expected}")
    return records


def _sharding_name(cfg: dict) -> str:
    types = cfg["sharding"]["types"]
    return "auto" if not types else "+".join(types)


def reference(p: Preset, world: int, rep: int, out: str) -> dict:
    """The hand-written TorchRec loop at ``world`` ranks, started by torchrun."""
    path = os.path.join(out, "raw", f"rep{rep}_world{world}_reference.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           os.path.join(HERE, "reference_torchrec.py"), f"--steps={p.steps}", f"--warmup={p.warmup}",
           f"--out={path}", f"data.batch_size={p.per_rank_batch * world}", *p.overrides]
    _run(cmd, path.replace(".json", ".log"))
    r = json.load(open(path))
    return {"kind": "reference", "rep": rep, "sharding": "torchrec planner", "dense": "ddp",
            "pipeline": "sparse_dist", **r, "run_dir": os.path.relpath(path, out)}


# ------------------------------------------------------------------------------ machine
def machine() -> dict[str, Any]:
    import fbgemm_gpu
    import hydra
    import torch
    import torchrec

    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), cpu)
    except OSError:
        pass  # not Linux: platform.processor() stays
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "hostname": platform.node(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchrec": getattr(torchrec, "__version__", None) or _dist_version("torchrec"),
        "fbgemm_gpu": getattr(fbgemm_gpu, "__version__", None) or _dist_version("fbgemm-gpu-cpu"),
        "hydra": hydra.__version__,
    }


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


# ------------------------------------------------------------------------------ summarizing
def _key(r: dict) -> tuple:
    return (r["kind"], r["world_size"], r["sharding"], r["dense"], r["pipeline"])


def _name(key: tuple) -> str:
    kind, world, sharding, dense, pipeline = key
    if kind == "reference":
        return f"{world} rank{'s' if world > 1 else ''} · TorchRec reference (planner, DDP, sparse_dist)"
    return f"{world} rank{'s' if world > 1 else ''} · {sharding} · {dense} · {pipeline}"


def summarize(runs: list[dict]) -> list[dict]:
    """One entry per configuration: medians and spreads over the repetitions, and the ratio
    to the reference at the same world size (computed per repetition, then median/min/max)."""
    by_key: dict[tuple, list[dict]] = {}
    for r in runs:
        if not r.get("profiled"):
            by_key.setdefault(_key(r), []).append(r)
    refs = {k[1]: {r["rep"]: r["samples_per_second"] for r in v} for k, v in by_key.items() if k[0] == "reference"}
    configs = []
    for key, rs in by_key.items():
        rates = [r["samples_per_second"] for r in rs]
        ranks = len(rs[0]["peak_rss_mb"])
        c = {
            "name": _name(key),
            "kind": key[0], "world_size": key[1], "sharding": key[2], "dense": key[3], "pipeline": key[4],
            "reps": len(rs),
            "rates": rates,
            "median_samples_per_second": statistics.median(rates),
            "min_samples_per_second": min(rates),
            "max_samples_per_second": max(rates),
            "spread_pct": 100 * (max(rates) - min(rates)) / statistics.median(rates),
            "step_time_p50_ms": statistics.median(r["step_time_p50_ms"] for r in rs),
            "step_time_p95_ms": statistics.median(r["step_time_p95_ms"] for r in rs),
            "peak_rss_mb": [statistics.median(r["peak_rss_mb"][i] for r in rs) for i in range(ranks)],
            # e.g. "column_wise x1": the type, and over how many ranks each table is split
            "plan_types": sorted({f"{t} x{n}" for t, n in rs[0]["plan"].values()}),
        }
        if key[0] == "hybridrec":
            c["est_host_mb"] = [m["est_host_mb"] for m in rs[0]["memory_per_rank"]]
            c["est_device_mb"] = [m["est_device_mb"] for m in rs[0]["memory_per_rank"]]
        ref = refs.get(key[1], {})
        ratios = [r["samples_per_second"] / ref[r["rep"]] for r in rs if r["rep"] in ref]
        if ratios:
            c["ratio_vs_reference"] = {"per_rep": ratios, "median": statistics.median(ratios),
                                       "min": min(ratios), "max": max(ratios)}
        configs.append(c)
    configs.sort(key=lambda c: (c["world_size"], c["kind"] != "reference", -c["median_samples_per_second"]))
    return configs


def scaling(configs: list[dict]) -> list[dict]:
    """Weak scaling 1 -> 2 ranks for every configuration measured at both sizes."""
    one = {(c["kind"], c["dense"], c["pipeline"]): c for c in configs if c["world_size"] == 1}
    out = []
    for c in configs:
        base = one.get((c["kind"], c["dense"], c["pipeline"]))
        if c["world_size"] == 2 and base and c["sharding"] in ("auto", "torchrec planner"):
            s2, s1 = c["median_samples_per_second"], base["median_samples_per_second"]
            out.append({"name": c["name"].split(" · ", 1)[1], "samples_per_second_1": s1, "samples_per_second_2": s2,
                        "speedup": s2 / s1, "efficiency": s2 / (2 * s1)})
    return out


def answers(configs: list[dict]) -> dict[str, Any]:
    two = [c for c in configs if c["world_size"] == 2]
    hyb = [c for c in two if c["kind"] == "hybridrec"]
    if not hyb:
        return {}
    best = max(hyb, key=lambda c: c["median_samples_per_second"])
    default = next((c for c in hyb if (c["sharding"], c["dense"], c["pipeline"]) == ("auto", "fsdp", "sparse_dist")), None)
    ddp = [c for c in hyb if c["dense"] == "ddp" and c["pipeline"] == "sparse_dist" and "ratio_vs_reference" in c]
    ddp_auto = next((c for c in ddp if c["sharding"] == "auto"), None)
    a: dict[str, Any] = {"fastest": best["name"], "fastest_samples_per_second": best["median_samples_per_second"]}
    if default:
        behind = 1 - default["median_samples_per_second"] / best["median_samples_per_second"]
        a["default"] = default["name"]
        a["default_behind_fastest_pct"] = 100 * behind
        a["target_default_within_5pct"] = behind <= 0.05
    # memory split: the default's peak per rank, and the configuration with the most even split
    balanced = min(hyb, key=lambda c: max(c["peak_rss_mb"]) / min(c["peak_rss_mb"]))
    a["memory"] = {"default": default["peak_rss_mb"] if default else None,
                   "default_estimate": [h + d for h, d in zip(default["est_host_mb"], default["est_device_mb"])]
                   if default else None,
                   "most_even": balanced["name"], "most_even_peak_rss_mb": balanced["peak_rss_mb"]}
    if ddp_auto:
        r = ddp_auto["ratio_vs_reference"]
        a["ddp_vs_reference"] = {"config": ddp_auto["name"], **{k: r[k] for k in ("median", "min", "max")}}
        a["target_ddp_at_least_reference"] = r["median"] >= 1.0
    return a


# ------------------------------------------------------------------------------ report
def _rank_list(values: list[float], fmt: str = "{:,.0f}") -> str:
    return ", ".join(fmt.format(v) for v in values)


def report(res: dict[str, Any]) -> str:
    s, m, configs = res["suite"], res["machine"], res["configs"]
    gpu = m["gpu"] or "no GPU"
    L = [
        "# Benchmark report",
        "",
        f"`{s['command']}` ({s['preset']} preset), {s['date']}, {s['duration_s'] / 60:.1f} min.",
        "",
        "## Machine and method",
        "",
        f"- Machine: {m['cpu']}, {m['cores']} cores, {gpu}; Python {m['python']}, torch {m['torch']}, "
        f"torchrec {m['torchrec']}, fbgemm-gpu {m['fbgemm_gpu']}, Hydra {m['hydra']}.",
        f"- `ctr` experiment (DLRM, 64-dim tables, Adagrad), per-rank batch {s['per_rank_batch']} (global = "
        f"per-rank x ranks: weak scaling). {s['steps']} steps per run; the first {s['warmup_steps']} (tracing, "
        f"pipeline fill, lazy init) are excluded from the rate; {s['reps']} repetitions, alternating: every "
        f"configuration once per repetition, sweep order reversed every other repetition.",
        "- hybridrec: Hydra multirun over `python -m hybridrec.train`; reference: "
        "`benchmarks/reference_torchrec.py` under torchrun (TorchRec planner defaults, DMP's DDP, fused "
        "sparse optimizer, TrainPipelineSparseDist), same model, data, batch and optimizers.",
        "- samples/s: median over repetitions, min - max beside it. Ratio: hybridrec / reference in the "
        "same repetition at the same world size, median (min - max). Step time p50/p95: host wall time "
        "per step over all steps (summary.json). Memory: peak RSS per rank.",
        "- Every run's resolved config, overrides and raw numbers are in `results.json`.",
    ]
    if m["cores"] and m["cores"] <= 2:
        L.append(f"- On {m['cores']} cores, 2 ranks share the cores one rank uses: 2 ranks add communication, "
                 "not compute. Read the 2-rank numbers as distributed overhead.")
    a = res["answers"]
    L += ["", "## Answers", ""]
    if a:
        L.append(f"- Fastest at 2 ranks: **{a['fastest']}** ({a['fastest_samples_per_second']:,.0f} samples/s).")
        if "default" in a:
            verdict = "meets" if a["target_default_within_5pct"] else "misses"
            L.append(f"- Default (`{a['default']}`) is {a['default_behind_fastest_pct']:.1f}% behind the fastest: "
                     f"{verdict} the target (<= 5%).")
        if "ddp_vs_reference" in a:
            d = a["ddp_vs_reference"]
            verdict = "meets" if a["target_ddp_at_least_reference"] else "misses"
            L.append(f"- hybridrec `ddp` vs the hand-written TorchRec loop: {d['median']:.3f}x "
                     f"({d['min']:.3f} - {d['max']:.3f} over repetitions): {verdict} the target (>= 1.0x).")
    if "memory" in a:
        mem = a["memory"]
        if mem["default"]:
            L.append(f"- Memory per rank, default: peak RSS {_rank_list(mem['default'])} MB (planner estimate for "
                     f"the tables {_rank_list(mem['default_estimate'])} MB); most even split: {mem['most_even']} "
                     f"({_rank_list(mem['most_even_peak_rss_mb'])} MB).")
    if res["scaling"]:  # the default mode's scaling when measured
        sc = next((x for x in res["scaling"] if x["name"] == "auto · fsdp · sparse_dist"), res["scaling"][0])
        L.append(f"- Scaling 1 -> 2 ranks ({sc['name']}): {sc['speedup']:.2f}x throughput "
                 f"(efficiency {sc['efficiency']:.0%} of ideal 2x); see Weak scaling.")
    L += ["", "## Throughput and ratio vs reference", "",
          "| configuration | samples/s (median) | min - max | step p50 / p95 ms | vs reference |",
          "|---|---:|---:|---:|---:|"]
    for c in configs:
        r = c.get("ratio_vs_reference")
        ratio = f"{r['median']:.3f} ({r['min']:.3f} - {r['max']:.3f})" if r else "-"
        L.append(f"| {c['name']} | {c['median_samples_per_second']:,.0f} | {c['min_samples_per_second']:,.0f} - "
                 f"{c['max_samples_per_second']:,.0f} | {c['step_time_p50_ms']:.1f} / {c['step_time_p95_ms']:.1f} | {ratio} |")
    L += ["", "## Memory per rank", "",
          "Peak RSS per rank (median over repetitions) beside the planner's estimate for the tables it "
          "placed (host MB on CPU; the rest of RSS is the runtime, dense model, buffers and batches).", "",
          "| configuration | sharding chosen (x shards per table) | peak RSS MB per rank | planner estimate MB per rank |",
          "|---|---|---|---|"]
    for c in configs:
        est = [h + d for h, d in zip(c.get("est_host_mb", []), c.get("est_device_mb", []))]
        L.append(f"| {c['name']} | {', '.join(c['plan_types'])} | {_rank_list(c['peak_rss_mb'])} | "
                 f"{_rank_list(est) if est else '-'} |")
    L += ["", "## Weak scaling", "",
          f"Per-rank batch fixed at {s['per_rank_batch']}: 1 rank runs global batch {s['per_rank_batch']}, "
          f"2 ranks {2 * s['per_rank_batch']}. Efficiency = samples/s at 2 ranks / (2 x samples/s at 1 rank).", "",
          "| configuration | 1 rank samples/s | 2 ranks samples/s | speed-up | efficiency |", "|---|---:|---:|---:|---:|"]
    for sc in res["scaling"]:
        L.append(f"| {sc['name']} | {sc['samples_per_second_1']:,.0f} | {sc['samples_per_second_2']:,.0f} | "
                 f"{sc['speedup']:.2f}x | {sc['efficiency']:.0%} |")
    L += ["", "## Communication share (profiled)", ""]
    if res["profile"]:
        L += ["Share of the profiled steps during which a collective ran (torch.profiler, `profile.enabled=true`, "
              "2 ranks, sharding auto, sparse_dist). Overlapped comm counts as comm: an upper bound.", "",
              "| dense | rank | comm share | comm ms | compute ms | comm ms by kind |", "|---|---:|---:|---:|---:|---|"]
        for pr in res["profile"]:
            for rank, prof in enumerate(pr["profile"]):
                kinds = ", ".join(f"{k} {v:.1f}" for k, v in prof["comm_ms_by_kind"].items())
                L.append(f"| {pr['dense']} | {rank} | {prof['comm_share']:.0%} | {prof['comm_ms']:.1f} | "
                         f"{prof['compute_ms']:.1f} | {kinds} |")
    else:
        L.append("Not run in this preset.")
    L += ["", "## Dense-state memory: DDP vs FSDP2", ""]
    dm = res.get("dense_memory")
    if dm:
        import dense_memory

        L += [f"`benchmarks/dense_memory.py` ({dm['steps']} steps): {dm['numel'] / 1e6:.1f} M dense parameters, "
              "dense Adagrad, 2 ranks; bytes each rank holds after a step.", "",
              *dense_memory.table(dm["ranks"])]
    else:
        L.append("Not run in this preset.")
    L += ["", "## Input pipeline", ""]
    if res.get("input"):
        import input_scaling

        L += [f"`benchmarks/input_scaling.py` (in this run):", "", *input_scaling.table(res["input"])]
    else:
        L.append("Not run in this preset.")
    L += ["", "## Charts", ""] + [f"![{c}]({c})" for c in CHARTS]
    return "\n".join(L) + "\n"


def charts(res: dict[str, Any], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    configs = res["configs"]
    two = [c for c in configs if c["world_size"] == 2 and c["kind"] == "hybridrec"]
    ref2 = next((c for c in configs if c["world_size"] == 2 and c["kind"] == "reference"), None)

    # Throughput by strategy: sharding on x, one bar per dense x pipeline, min-max whiskers.
    shardings = [s for s in SHARDINGS if any(c["sharding"] == s for c in two)]
    modes = sorted({(c["dense"], c["pipeline"]) for c in two})
    fig, ax = plt.subplots(figsize=(max(6, 2 + 1.6 * len(shardings)), 4.5))
    width = 0.8 / max(1, len(modes))
    for i, (dense, pipeline) in enumerate(modes):
        xs, ys, lo, hi = [], [], [], []
        for j, s in enumerate(shardings):
            c = next((c for c in two if (c["sharding"], c["dense"], c["pipeline"]) == (s, dense, pipeline)), None)
            if c:
                med = c["median_samples_per_second"]
                xs.append(j + (i - (len(modes) - 1) / 2) * width)
                ys.append(med)
                lo.append(med - c["min_samples_per_second"])
                hi.append(c["max_samples_per_second"] - med)
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=f"{dense} · {pipeline}")
    if ref2:
        ax.axhline(ref2["median_samples_per_second"], color="black", ls="--", label="TorchRec reference")
    ax.set_xticks(range(len(shardings)), shardings)
    ax.set(title="2 ranks: throughput by strategy (median, min-max)", ylabel="samples/s")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out, CHARTS[0]), dpi=100)
    plt.close(fig)

    # Memory per rank: peak RSS per rank, planner estimate as markers.
    mem = [c for c in configs if c["world_size"] == 2 and (c["kind"] == "reference" or c["pipeline"] == "sparse_dist")]
    fig, ax = plt.subplots(figsize=(max(6, 1 + 0.9 * len(mem)), 4.5))
    for rank in range(2):
        xs = [i + (rank - 0.5) * 0.38 for i in range(len(mem))]
        ax.bar(xs, [c["peak_rss_mb"][rank] for c in mem], 0.38, label=f"rank {rank} peak RSS")
        est = [(x, c["est_host_mb"][rank] + c["est_device_mb"][rank]) for x, c in zip(xs, mem) if "est_host_mb" in c]
        if est:
            ax.plot(*zip(*est), "k_", ms=14, mew=2, label="planner estimate (tables)" if rank == 0 else None)
    ax.set_xticks(range(len(mem)), [c["name"].split(" · ", 1)[1].replace(" · ", "\n") for c in mem], fontsize=7)
    ax.set(title="2 ranks: memory per rank", ylabel="MB")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out, CHARTS[1]), dpi=100)
    plt.close(fig)

    # Ratio to the reference, per configuration, with its spread over repetitions.
    rat = [c for c in configs if c["kind"] == "hybridrec" and "ratio_vs_reference" in c]
    fig, ax = plt.subplots(figsize=(7, max(3, 0.3 * len(rat) + 1.5)))
    for i, c in enumerate(rat):
        r = c["ratio_vs_reference"]
        ax.errorbar(r["median"], i, xerr=[[r["median"] - r["min"]], [r["max"] - r["median"]]], fmt="o",
                    color="tab:blue" if c["dense"] == "ddp" else "tab:orange", capsize=3)
    ax.axvline(1.0, color="black", ls="--")
    ax.set_yticks(range(len(rat)), [c["name"] for c in rat], fontsize=7)
    ax.set(title="hybridrec / TorchRec reference (same world size; blue ddp, orange fsdp)", xlabel="ratio")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out, CHARTS[2]), dpi=100)
    plt.close(fig)

    # Weak scaling.
    sc = res["scaling"]
    fig, ax = plt.subplots(figsize=(max(6, 1.5 * len(sc) + 1), 4))
    xs = range(len(sc))
    ax.bar([x - 0.2 for x in xs], [s["samples_per_second_1"] for s in sc], 0.4, label="1 rank")
    ax.bar([x + 0.2 for x in xs], [s["samples_per_second_2"] for s in sc], 0.4, label="2 ranks")
    ax.set_xticks(list(xs), [s["name"].replace(" · ", "\n") for s in sc], fontsize=7)
    ax.set(title=f"weak scaling (per-rank batch {res['suite']['per_rank_batch']})", ylabel="samples/s")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out, CHARTS[3]), dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------------ main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="full")
    parser.add_argument("--reps", type=int, help="repetitions (default: the preset's)")
    parser.add_argument("--steps", type=int, help="steps per run (default: the preset's)")
    parser.add_argument("--out", help="default: benchmarks/results for the full suite, "
                                          "outputs/bench-<preset> for the others")
    args = parser.parse_args()
    if args.out is None:  # a quick or smoke run never overwrites the committed full report
        args.out = os.path.join(HERE, "results") if args.preset == "full" else os.path.join(ROOT, "outputs", f"bench-{args.preset}")
    p = dataclasses.replace(PRESETS[args.preset], **{k: v for k, v in (("reps", args.reps), ("steps", args.steps)) if v})
    if not 1 <= p.warmup < p.steps:
        parser.error(f"steps ({p.steps}) must exceed the warm-up ({p.warmup})")
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    started = time.time()
    runs: list[dict] = []
    for rep in range(p.reps):
        for world in (1, 2):
            # hybridrec and the reference back to back, the order swapped every other repetition
            steps = [lambda: sweep(p, world, rep, out)]
            if world in p.reference_worlds:
                steps.append(lambda: [reference(p, world, rep, out)])
            for step in steps[:: -1 if rep % 2 else 1]:
                for r in step():
                    runs.append(r)
                    print(f"rep {rep + 1}/{p.reps}  {_name(_key(r)):60s} {r['samples_per_second']:>9,.0f} samples/s",
                          flush=True)
    profile = []
    if p.profile:  # separate runs, not timed: the profiler slows the steps it records
        window = ["profile.enabled=true", f"profile.start_step={p.warmup}", f"profile.steps={min(10, p.steps - p.warmup)}"]
        for r in sweep(p, 2, 0, out, extra=window,
                       sweep_values={"sharding": ["auto"], "mesh": p.profile, "train.pipeline": ["sparse_dist"]}):
            r["profiled"] = True
            runs.append(r)
            profile.append({"dense": r["dense"], "profile": r["profile"], "run_dir": r["run_dir"]})
    configs = summarize(runs)
    res: dict[str, Any] = {
        "schema_version": 1,
        "suite": {"preset": args.preset, **{k: v for k, v in dataclasses.asdict(p).items()},
                  "warmup_steps": p.warmup,
                  "command": " ".join(["python", "benchmarks/bench.py", *sys.argv[1:]]),
                  "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")},
        "machine": machine(),
        "configs": configs,
        "scaling": scaling(configs),
        "answers": answers(configs),
        "profile": profile,
        "runs": runs,
    }
    if p.dense_memory_steps:
        import dense_memory

        ranks = dense_memory.run(p.dense_memory_steps, p.dense_memory_model or dense_memory.MODEL)
        res["dense_memory"] = {"steps": p.dense_memory_steps, "numel": ranks["ddp"][0]["numel"], "ranks": ranks,
                               "fsdp_over_ddp": max(dense_memory.totals(ranks)["fsdp"]) / max(dense_memory.totals(ranks)["ddp"])}
    if p.input:
        import input_scaling

        res["input"] = input_scaling.measure(**p.input)
    res["suite"]["duration_s"] = time.time() - started
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(res, f, indent=1)
    charts(res, out)
    text = report(res)
    with open(os.path.join(out, "REPORT.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
