"""The benchmark suite: hybridrec across sharding x dense x pipeline x world size, beside two
hand-written TorchRec loops (benchmarks/reference_torchrec.py), with report and charts.

What runs is what users run: each repetition is a Hydra multirun over the real entry point,

    python -m hybridrec.train -m +experiment=ctr sharding=auto,table_wise,... mesh=ddp,fsdp \\
        train.pipeline=sparse_dist,base launcher.nproc_per_node=2 ...

one per world size (1 rank, then the preset's multi-rank world: 2, or every local GPU in the
gpu preset), each followed by the two references at that world size (torchrun): the loop
reading hybridrec's batches on its training thread ("the reference"), and the same loop on
batches TorchRec's RandomRecDataset generated up front (TorchRec's examples' way: no input
cost in the timed steps). Repetitions
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
    python benchmarks/bench.py --preset quick  # representative subset (make bench-quick), ~15 min on 2 cores
    python benchmarks/bench.py --preset smoke --out /tmp/b   # tiny, 1 rank: checks the outputs only
    python benchmarks/bench.py --preset gpu    # every local GPU, launcher.device=cuda (make bench-gpu)
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
import shutil
import signal
import statistics
import sys
import time
from typing import Any

from bench_report import answers, charts, report, scaling, summarize
from common import (
    REFERENCE_KINDS,
    ROOT,
    SHARDINGS,
    LoadAverage,
    config_key,
    config_name,
    machine,
    run_logged,
    steady_rate,
)
from levers import LEVERS
from roofline import dense_flops_per_sample, sgemm_gflops

HERE = os.path.dirname(os.path.abspath(__file__))

TINY = [
    "data.num_embeddings_per_feature=[500,200,100]",
    "model.embedding_dim=16",
    "model.dense_arch_layer_sizes=[32,16]",
    "model.over_arch_layer_sizes=[32,1]",
]
TINY_DENSE = [
    "model=dcn",
    "model.embedding_dim=8",
    "model.dense_arch_layer_sizes=[16,8]",
    "model.over_arch_layer_sizes=[64,1]",
    "model.dcn_num_layers=1",
    "model.dcn_low_rank_dim=8",
    "data.num_embeddings_per_feature=[100,100]",
    "data.batch_size=64",
    "sharding=table_wise",
]


@dataclasses.dataclass
class Preset:
    reps: int
    steps: int
    warmup: int
    per_rank_batch: int
    world1: dict[str, list[str]]
    """Sweep of the 1-rank runs: override key -> values."""
    world_n: dict[str, list[str]]
    """Sweep of the runs at the multi-rank world (``worlds[-1]``)."""
    profile: list[str]
    """Dense modes profiled once each (multi-rank world, default sharding and pipeline); [] = none."""
    dense_memory_steps: int
    """0 = not run."""
    input: dict[str, Any]
    """input_scaling.measure's arguments ({} = not run)."""
    levers: list[str] = dataclasses.field(default_factory=list)
    """levers.LEVERS measured at the multi-rank world beside the default and the reference ([] = none)."""
    levers_reps: int = 3
    worlds: tuple[int, ...] = (1, 2)
    """World sizes, in order: 1 rank, then the multi-rank world; (1,) = the 1-rank runs only."""
    reference_worlds: tuple[int, ...] = (1, 2)
    """World sizes the reference runs at."""
    overrides: list[str] = dataclasses.field(default_factory=list)
    """Extra Hydra overrides for every run (the smoke preset's tiny model)."""
    dense_memory_model: list[str] | None = None
    device: str | None = None
    """launcher.device of hybridrec's runs and --device of the reference; None = their auto
    (cuda when torch sees a GPU). "cuda" also makes ``worlds`` = (1, every local GPU)."""
    roofline: bool = True
    """Probe the CPU's sgemm rate and report each mode's share of it (the dense roofline)."""
    notes: tuple[str, ...] = ()
    """Method notes the report prints: what the preset leaves out and why."""


BOTH = {"mesh": ["ddp", "fsdp"], "train.pipeline": ["sparse_dist", "base"]}
PRESETS = {
    # 3 x (20 + 4 hybridrec runs + 2 reference runs) + profiles, dense memory, input:
    # ~30-35 min on 2 CPU cores (the input section: ~7 min).
    "full": Preset(
        reps=3,
        steps=150,
        warmup=30,
        per_rank_batch=1024,
        world1={"sharding": ["auto"], **BOTH},
        world_n={"sharding": SHARDINGS, **BOTH},
        profile=["ddp", "fsdp"],
        dense_memory_steps=8,
        input=dict(reps=3, tsv_rows=200_000, steps=12, train_steps=60),
        levers=list(LEVERS),
    ),
    # The default (fsdp) and ddp at both sizes beside the reference, every section of the
    # report: ~3 min on a quiet 2-core machine (6 min measured with the cores shared).
    "quick": Preset(
        reps=2,
        steps=80,
        warmup=20,
        per_rank_batch=1024,
        world1={"sharding": ["auto"], "mesh": ["ddp", "fsdp"], "train.pipeline": ["sparse_dist"]},
        world_n={"sharding": ["auto"], "mesh": ["ddp", "fsdp"], "train.pipeline": ["sparse_dist"]},
        profile=[],
        dense_memory_steps=2,
        input=dict(reps=1, tsv_rows=50_000, steps=6, train_steps=40, quick=True, scale=4),
    ),
    # One tiny configuration at 1 rank, to check the harness end to end and that its outputs
    # are well-formed (the test suite runs it): hybridrec, both references, a profiled run and
    # the roofline; no timings. The levers, dense-memory and input sections are checked on
    # their own by the test suite with the same tiny settings (SMOKE_SECTIONS).
    "smoke": Preset(
        reps=1,
        steps=6,
        warmup=2,
        per_rank_batch=64,
        worlds=(1,),
        reference_worlds=(1,),
        world1={"sharding": ["auto"], "mesh": ["fsdp"], "train.pipeline": ["sparse_dist"]},
        world_n={"sharding": ["auto"], "mesh": ["fsdp"], "train.pipeline": ["sparse_dist"]},
        profile=["fsdp"],
        dense_memory_steps=0,
        input={},
        overrides=TINY,
    ),
    # hybridrec and the reference on every local GPU (worlds = (1, GPUs), set at start),
    # per-rank batch 8192: ctr's dense part is small, so a GPU needs large batches to have
    # work. 3 x (4 + 10 hybridrec runs + 2 reference runs) + 2 x 7 lever runs.
    "gpu": Preset(
        reps=3,
        steps=400,
        warmup=50,
        per_rank_batch=8192,
        device="cuda",
        roofline=False,
        world1={"sharding": ["auto"], **BOTH},
        world_n={"sharding": SHARDINGS, "mesh": ["ddp", "fsdp"], "train.pipeline": ["sparse_dist"]},
        profile=[],
        dense_memory_steps=0,
        input={},
        levers_reps=2,
        levers=[n for n in LEVERS if n != "every core on every rank"],  # a CPU thread split
        notes=(
            "Not run on GPUs: the profiled breakdown (it attributes host wall time, and on a GPU the "
            "host waits where the device falls behind, not where the work is), the dense roofline and "
            "the dense-heavy case (their probes measure the CPU), the input pipeline (host-side; "
            "`make bench-quick` measures it). The levers leave out the CPU thread split.",
            "Both tools build the synthetic batches on each rank's host thread "
            "(`data.num_workers=0`): at this batch the host's input cost can bound both alike.",
        ),
    ),
}


# The other sections at the smoke preset's size, for their own tests.
SMOKE_SECTIONS = dict(
    levers=["default", "every core on every rank"],
    levers_reps=1,
    dense_memory_steps=1,
    dense_memory_model=TINY_DENSE,
    input=dict(reps=1, tsv_rows=4096, steps=2, train_steps=12, quick=True, scale=16, train_overrides=tuple(TINY)),
)


def cuda_problem() -> str | None:
    """Why a CUDA preset cannot run here, or None: hybridrec's own reason for refusing
    launcher.device=cuda (a CPU-only torch build, or no usable GPU)."""
    from hybridrec.parallel.devices import Cuda

    return Cuda.probe().unusable()


def on_local_gpus(p: Preset, gpus: int) -> Preset:
    """``p`` on ``gpus`` GPUs, one rank each: 1 rank, then all of them (with one GPU, the
    1-rank comparison only), the reference at every world size."""
    worlds = (1, gpus) if gpus > 1 else (1,)
    one = () if gpus > 1 else ("One GPU: the 1-rank comparison only (no multi-rank world, no scaling).",)
    return dataclasses.replace(p, worlds=worlds, reference_worlds=worlds, notes=p.notes + one)


# ------------------------------------------------------------------------------ running
def _load_yaml(path: str) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(path), resolve=True)


def sweep(p: Preset, world: int, rep: int, out: str, extra: list[str] = (), sweep_values=None) -> list[dict]:
    """One Hydra multirun of hybridrec at ``world`` ranks; one record per job."""
    values = sweep_values or (p.world1 if world == 1 else p.world_n)
    # Every other repetition runs the sweep backwards: drift over the run cancels out.
    order = (lambda v: v[::-1]) if rep % 2 else (lambda v: v)
    swept = [f"{k}={','.join(order(v))}" for k, v in values.items()]
    tag = f"rep{rep}_world{world}{'_profile' if extra else ''}"
    sweep_dir = os.path.join(out, "raw", tag)
    if os.path.exists(sweep_dir):  # a previous suite's runs: Hydra would add to them
        shutil.rmtree(sweep_dir)
    cmd = [
        sys.executable,
        "-m",
        "hybridrec.train",
        "-m",
        "+experiment=ctr",
        *swept,
        f"launcher.nproc_per_node={world}",
        f"data.batch_size={p.per_rank_batch * world}",
        f"train.steps={p.steps}",
        f"train.log_every={p.warmup}",
        "data.eval_batches=1",
        *_device(p),
        *p.overrides,
        *extra,
        f"hydra.sweep.dir={sweep_dir}",
        "hydra.sweep.subdir=${hydra.job.num}",
    ]
    os.makedirs(os.path.join(out, "raw"), exist_ok=True)
    run_logged(cmd, os.path.join(out, "raw", f"{tag}.log"))
    records = []
    for job in sorted(os.listdir(sweep_dir), key=lambda d: int(d) if d.isdigit() else -1):
        job_dir = os.path.join(sweep_dir, job)
        if os.path.exists(os.path.join(job_dir, "summary.json")):  # (not multirun.yaml)
            records.append(_record(job_dir, rep, out, p.warmup))
    expected = 1
    for v in values.values():
        expected *= len(v)
    if len(records) != expected:
        raise RuntimeError(f"{sweep_dir}: {len(records)} finished jobs, expected {expected}")
    return records


def single(
    p: Preset, world: int, rep: int, out: str, tag: str, overrides: list[str], per_rank_batch: int | None = None
) -> dict:
    """One run of hybridrec at ``world`` ranks with ``overrides`` on top of the suite's."""
    run_dir = os.path.join(out, "raw", f"rep{rep}_world{world}_{tag}")
    if os.path.exists(run_dir):
        shutil.rmtree(run_dir)
    cmd = [
        sys.executable,
        "-m",
        "hybridrec.train",
        "+experiment=ctr",
        f"launcher.nproc_per_node={world}",
        f"data.batch_size={(per_rank_batch or p.per_rank_batch) * world}",
        f"train.steps={p.steps}",
        f"train.log_every={p.warmup}",
        "data.eval_batches=1",
        *_device(p),
        *p.overrides,
        *overrides,
        f"hydra.run.dir={run_dir}",
    ]
    os.makedirs(os.path.join(out, "raw"), exist_ok=True)
    run_logged(cmd, f"{run_dir}.log")
    return _record(run_dir, rep, out, p.warmup)


def _device(p: Preset) -> list[str]:
    return [f"launcher.device={p.device}"] if p.device else []


def _record(job_dir: str, rep: int, out: str, warmup: int) -> dict:
    """A finished run's numbers and resolved config."""
    s = json.load(open(os.path.join(job_dir, "summary.json")))
    cfg = _load_yaml(os.path.join(job_dir, ".hydra", "config.yaml"))
    device_mb = [m.get("peak_device_allocated_mb") for m in s["memory_per_rank"]]  # GPU runs
    return {
        "kind": "hybridrec",
        "rep": rep,
        "world_size": s["world_size"],
        "device": s["device"],
        "sharding": _sharding_name(cfg),
        "dense": cfg["mesh"]["dense"],
        "dense_ran": s["dense_parallel"],  # the wrapper that ran (one rank: none, parallelize.dense_mode)
        "pipeline": cfg["train"]["pipeline"],
        "samples_per_second": steady_rate(job_dir, s["global_batch_size"], warmup),
        "samples_per_second_incl_warmup": s["train"]["samples_per_second"],
        "step_time_p50_ms": s["train"]["step_time_p50_ms"],
        "step_time_p95_ms": s["train"]["step_time_p95_ms"],
        "peak_rss_mb": s["peak_rss_mb"],
        "memory_per_rank": s["memory_per_rank"],
        **({"peak_device_allocated_mb": device_mb} if None not in device_mb else {}),
        "plan": {t: [v["sharding_type"], len(v["ranks"])] for t, v in s["plan"].items()},
        "compute_kernels": {t: v["compute_kernel"] for t, v in s["plan"].items()},
        "train_loss": s["train_loss"],
        "profile": s.get("profile"),
        "overrides": _load_yaml(os.path.join(job_dir, ".hydra", "overrides.yaml")),
        "config": cfg,
        "run_dir": os.path.relpath(job_dir, out),
    }


def _sharding_name(cfg: dict) -> str:
    types = cfg["sharding"]["types"]
    return "auto" if not types else "+".join(types)


def reference(p: Preset, world: int, rep: int, out: str, tag: str = "", kind: str = "reference") -> dict:
    """A hand-written TorchRec loop at ``world`` ranks, started by torchrun: ``kind`` is one of
    common.REFERENCE_KINDS (its input: hybridrec's batches, or pre-generated ones)."""
    name = kind + (f"_{tag}" if tag else "")
    path = os.path.join(out, "raw", f"rep{rep}_world{world}_{name}.json")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={world}",
        os.path.join(HERE, "reference_torchrec.py"),
        f"--steps={p.steps}",
        f"--warmup={p.warmup}",
        f"--out={path}",
        f"--device={p.device or 'auto'}",
        f"--input={REFERENCE_KINDS[kind]}",
        f"data.batch_size={p.per_rank_batch * world}",
        *p.overrides,
    ]
    run_logged(cmd, path.replace(".json", ".log"))
    r = json.load(open(path))
    return {
        "kind": kind,
        "rep": rep,
        "sharding": "torchrec planner",
        "dense": "ddp",
        "pipeline": "sparse_dist",
        **r,
        "run_dir": os.path.relpath(path, out),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="full")
    parser.add_argument("--reps", type=int, help="repetitions (default: the preset's)")
    parser.add_argument("--steps", type=int, help="steps per run (default: the preset's)")
    parser.add_argument(
        "--out", help="default: benchmarks/results for the full suite, outputs/bench-<preset> for the others"
    )
    args = parser.parse_args()
    if args.out is None:  # a quick or smoke run never overwrites the committed full report
        args.out = (
            os.path.join(HERE, "results")
            if args.preset == "full"
            else os.path.join(ROOT, "outputs", f"bench-{args.preset}")
        )
    p = dataclasses.replace(
        PRESETS[args.preset], **{k: v for k, v in (("reps", args.reps), ("steps", args.steps)) if v}
    )
    if not 1 <= p.warmup < p.steps:
        parser.error(f"steps ({p.steps}) must exceed the warm-up ({p.warmup})")
    if p.device == "cuda":  # before anything runs: one line, no traceback
        if reason := cuda_problem():
            sys.exit(f"bench: the {args.preset} preset needs CUDA: {reason}")
        import torch

        p = on_local_gpus(p, torch.cuda.device_count())
        print(
            f"bench: {torch.cuda.device_count()} x {torch.cuda.get_device_name()}, world sizes {p.worlds}"
            + ("" if len(p.worlds) > 1 else " (one GPU: the 1-rank comparison only)"),
            flush=True,
        )
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    res: dict[str, Any] = {
        "schema_version": 1,
        "suite": {
            "preset": args.preset,
            **{k: v for k, v in dataclasses.asdict(p).items()},
            "warmup_steps": p.warmup,
            "command": " ".join(["python", "benchmarks/bench.py", *sys.argv[1:]]),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        },
        "machine": machine(),
        "runs": [],
    }
    sections = [
        f"{p.reps} repetition(s) of hybridrec and the references at {' and '.join(map(str, p.worlds))} rank(s)"
    ] + [
        name
        for name, on in (
            ("profiled runs", p.profile),
            ("levers", p.levers),
            ("dense memory", p.dense_memory_steps),
            ("input pipeline", p.input),
        )
        if on
    ]
    print(
        f"bench: {args.preset} preset: {'; '.join(sections)}; each run's log under {out}/raw; "
        f"Ctrl-C writes a partial report",
        flush=True,
    )
    started = time.time()
    # The machine's load while the suite runs: other work on the cores slows every number.
    with LoadAverage() as load:
        try:
            measure(p, out, res, started)
        except KeyboardInterrupt:  # what ran is reported, marked partial (a full run takes half an hour)
            res["suite"]["interrupted"] = f"stopped by the user after {(time.time() - started) / 60:.1f} min"
            print(f"\nbench: {res['suite']['interrupted']}: writing a partial report", flush=True)
    samples = load.samples or [os.getloadavg()[0]]
    res["machine"]["load_average"] = {
        "median": statistics.median(samples),
        "max": max(samples),
        "cores": os.cpu_count(),
    }
    res["suite"]["duration_s"] = time.time() - started
    write_results(res, out)
    if res["suite"].get("interrupted"):
        sys.exit(128 + signal.SIGINT)  # the shell's status for a command stopped by Ctrl-C


def progress(started: float, what: str) -> None:
    print(f"bench: [{(time.time() - started) / 60:4.1f} min] {what}", flush=True)


def measure(p: Preset, out: str, res: dict[str, Any], started: float) -> None:
    """Every section of the preset, in turn, each result stored in ``res`` as it comes (so an
    interrupted suite still reports what finished)."""
    # The machine's dense arithmetic rate, probed at the start and the end (a shared machine
    # drifts): the roofline the report measures every mode against.
    sgemm = [sgemm_gflops(rows=p.per_rank_batch)] if p.roofline else []
    runs = res["runs"]
    for rep in range(p.reps):
        for world in p.worlds:
            # hybridrec and the reference back to back, the order swapped every other repetition
            steps = [("hybridrec", lambda: sweep(p, world, rep, out))]
            if world in p.reference_worlds:
                steps += [
                    (kind, lambda kind=kind: [reference(p, world, rep, out, kind=kind)]) for kind in REFERENCE_KINDS
                ]
            for name, step in steps[:: -1 if rep % 2 else 1]:
                progress(started, f"rep {rep + 1}/{p.reps}, {world} rank(s): {name}")
                for r in step():
                    runs.append(r)
                    label = config_name(config_key(r))
                    print(f"rep {rep + 1}/{p.reps}  {label:60s} {r['samples_per_second']:>9,.0f} samples/s", flush=True)
    res["profile"] = []
    if p.profile:  # separate runs, not timed: the profiler slows the steps it records
        progress(started, "profiled runs")
        window = [
            "profile.enabled=true",
            f"profile.start_step={p.warmup}",
            f"profile.steps={min(10, p.steps - p.warmup)}",
        ]
        for r in sweep(
            p,
            p.worlds[-1],
            0,
            out,
            extra=window,
            sweep_values={"sharding": ["auto"], "mesh": p.profile, "train.pipeline": ["sparse_dist"]},
        ):
            r["profiled"] = True
            runs.append(r)
            res["profile"].append({"dense": r["dense"], "profile": r["profile"], "run_dir": r["run_dir"]})
    if p.levers:
        import levers

        progress(started, f"levers: {', '.join(p.levers)}")
        res["levers"] = levers.measure(p, out, p.levers_reps, single, reference, names=p.levers)
    if p.roofline:
        sgemm.append(sgemm_gflops(rows=p.per_rank_batch))
        res["roofline"] = {
            "sgemm_gflops": sgemm,
            "sgemm_gflops_median": statistics.median(sgemm),
            "gemm": f"float32 {p.per_rank_batch} x 512 @ 512 x 512, {os.cpu_count()} threads",
            "flops_per_sample": dense_flops_per_sample(["+experiment=ctr", *p.overrides]),
        }
    if p.dense_memory_steps:
        import dense_memory

        progress(started, "dense memory: DDP against FSDP2 on the dense-heavy model")
        model = p.dense_memory_model or dense_memory.MODEL
        ranks = dense_memory.run(p.dense_memory_steps, p.reps, model)
        res["dense_memory"] = {
            "steps": p.dense_memory_steps,
            "reps": p.reps,
            "numel": ranks["ddp"][0]["numel"],
            "ranks": ranks,
            "flops_per_sample": dense_flops_per_sample(model),
            "fsdp_over_ddp": max(dense_memory.totals(ranks)["fsdp"]) / max(dense_memory.totals(ranks)["ddp"]),
        }
    if p.input:
        import input_scaling

        progress(started, "input pipeline: per-rank cost against world size")
        res["input"] = input_scaling.measure(**p.input)


def write_results(res: dict[str, Any], out: str) -> None:
    """results.json, the charts and REPORT.md from what ``measure`` stored."""
    res.setdefault("profile", [])
    res.setdefault("roofline", None)
    res.setdefault("levers", None)
    if not res["runs"]:
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump(res, f, indent=1)
        sys.exit(
            f"bench: {res['suite'].get('interrupted', 'stopped')}: no run finished, no report (results.json in {out})"
        )
    configs = summarize(res["runs"], res["roofline"])
    res.update(configs=configs, scaling=scaling(configs), answers=answers(configs))
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(res, f, indent=1)
    charts(res, out)
    text = report(res)
    with open(os.path.join(out, "REPORT.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
