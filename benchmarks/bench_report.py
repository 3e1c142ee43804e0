"""The benchmark report: per-configuration medians, spreads and ratios from the raw runs of
benchmarks/bench.py, the answers to its questions, REPORT.md and the charts.

    python benchmarks/bench_report.py benchmarks/results   # rewrite REPORT.md + charts from results.json
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from typing import Any

from common import REFERENCE_KINDS, SHARDINGS, config_key, config_name, ranks_label

REPORT_SECTIONS = [
    "## Machine and method",
    "## Answers",
    "## Throughput and ratio vs reference",
    "## Memory per rank",
    "## Weak scaling",
    "## Where the time goes (profiled)",
    "## Communication share (profiled)",
    "## Levers",
    "## Dense-heavy case: DDP vs FSDP2",
    "## Input pipeline",
    "## Charts",
]
CHARTS = ["throughput_by_strategy.png", "memory_per_rank.png", "reference_ratio.png", "scaling.png"]


# ------------------------------------------------------------------------------ summarizing
def top_world(configs: list[dict]) -> int:
    """The suite's multi-rank world (bench.py's ``Preset.worlds[-1]``, 1 when a run had one
    world only), read from the data: the sweeps, the answers, the profile and the levers run
    there."""
    return max(c["world_size"] for c in configs)


def summarize(runs: list[dict], roofline: dict | None = None) -> list[dict]:
    """One entry per configuration: medians and spreads over the repetitions, the ratio to the
    reference at the same world size (computed per repetition, then median/min/max), and with
    ``roofline`` the fraction of the machine's dense arithmetic rate the median reaches."""
    by_key: dict[tuple, list[dict]] = {}
    for r in runs:
        if not r.get("profiled"):
            by_key.setdefault(config_key(r), []).append(r)
    # (kind, world) -> rep -> rate, for both references
    refs = {
        (k[0], k[1]): {r["rep"]: r["samples_per_second"] for r in v}
        for k, v in by_key.items()
        if k[0] in REFERENCE_KINDS
    }
    configs = []
    for key, rs in by_key.items():
        rates = [r["samples_per_second"] for r in rs]
        ranks = len(rs[0]["peak_rss_mb"])
        c = {
            "name": config_name(key),
            "kind": key[0],
            "world_size": key[1],
            "sharding": key[2],
            "dense": key[3],
            "pipeline": key[4],
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
        if rs[0].get("compute_kernels"):  # (recorded since the gpu preset; table -> kernel)
            c["compute_kernels"] = sorted(set(rs[0]["compute_kernels"].values()))
        if rs[0].get("peak_device_allocated_mb"):  # GPU runs that record it
            c["peak_device_allocated_mb"] = [
                statistics.median(r["peak_device_allocated_mb"][i] for r in rs) for i in range(ranks)
            ]
        for kind in REFERENCE_KINDS:
            ref = refs.get((kind, key[1]), {})
            ratios = [r["samples_per_second"] / ref[r["rep"]] for r in rs if r["rep"] in ref]
            if ratios:
                c[f"ratio_vs_{kind}"] = {
                    "per_rep": ratios,
                    "median": statistics.median(ratios),
                    "min": min(ratios),
                    "max": max(ratios),
                }
        if roofline:
            c["dense_roofline"] = roofline_fraction(c["median_samples_per_second"], roofline)
        configs.append(c)
    configs.sort(key=lambda c: (c["world_size"], c["kind"] == "hybridrec", -c["median_samples_per_second"]))
    return configs


def roofline_fraction(samples_per_second: float, roofline: dict) -> float:
    """Dense FLOPs done per second over the machine's sgemm rate (all cores)."""
    return samples_per_second * roofline["flops_per_sample"] / (roofline["sgemm_gflops_median"] * 1e9)


def scaling(configs: list[dict]) -> list[dict]:
    """Weak scaling 1 -> N ranks (N = top_world) for every configuration measured at both."""
    n = top_world(configs)
    one = {(c["kind"], c["dense"], c["pipeline"]): c for c in configs if c["world_size"] == 1}
    out = []
    for c in configs:
        base = one.get((c["kind"], c["dense"], c["pipeline"]))
        if n > 1 and c["world_size"] == n and base and c["sharding"] in ("auto", "torchrec planner"):
            sn, s1 = c["median_samples_per_second"], base["median_samples_per_second"]
            out.append(
                {
                    "name": c["name"].split(" · ", 1)[1],
                    "world_size": n,
                    "samples_per_second_1": s1,
                    "samples_per_second_n": sn,
                    "speedup": sn / s1,
                    "efficiency": sn / (n * s1),
                }
            )
    return out


def answers(configs: list[dict]) -> dict[str, Any]:
    """At the top world: the fastest mode, the default's distance to it, memory, the ratios to
    the reference; and the fastest mode against the reference at every world size."""
    top = [c for c in configs if c["world_size"] == top_world(configs)]
    hyb = [c for c in top if c["kind"] == "hybridrec"]
    if not hyb:
        return {}
    best = max(hyb, key=lambda c: c["median_samples_per_second"])
    default = next(
        (c for c in hyb if (c["sharding"], c["dense"], c["pipeline"]) == ("auto", "fsdp", "sparse_dist")), None
    )
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
    a["memory"] = {
        "default": default["peak_rss_mb"] if default else None,
        "default_estimate": [h + d for h, d in zip(default["est_host_mb"], default["est_device_mb"])]
        if default
        else None,
        "most_even": balanced["name"],
        "most_even_peak_rss_mb": balanced["peak_rss_mb"],
    }
    if ddp_auto:
        r = ddp_auto["ratio_vs_reference"]
        a["ddp_vs_reference"] = {"config": ddp_auto["name"], **{k: r[k] for k in ("median", "min", "max")}}
        a["target_ddp_at_least_reference"] = r["median"] >= 1.0
    if default and "ratio_vs_reference" in default:
        r = default["ratio_vs_reference"]
        a["default_vs_reference"] = {k: r[k] for k in ("median", "min", "max")}
        a["target_default_at_least_reference"] = r["median"] >= 1.0
    if ddp_auto and "ratio_vs_pregenerated" in ddp_auto:
        r = ddp_auto["ratio_vs_pregenerated"]
        a["ddp_vs_pregenerated"] = {"config": ddp_auto["name"], **{k: r[k] for k in ("median", "min", "max")}}
    if default and "ratio_vs_pregenerated" in default:
        r = default["ratio_vs_pregenerated"]
        a["default_vs_pregenerated"] = {k: r[k] for k in ("median", "min", "max")}
    # The fastest hybridrec mode at each world size against each reference beside it.
    for kind in REFERENCE_KINDS:
        key = f"ratio_vs_{kind}"
        a[f"fastest_vs_{kind}"] = {}
        for world in sorted({c["world_size"] for c in configs}):
            rated = [c for c in configs if c["world_size"] == world and c["kind"] == "hybridrec" and key in c]
            if rated:
                top = max(rated, key=lambda c: c["median_samples_per_second"])
                a[f"fastest_vs_{kind}"][str(world)] = {
                    "config": top["name"],
                    "reps": len(top[key]["per_rep"]),
                    **{k: top[key][k] for k in ("median", "min", "max")},
                    "target_met": top[key]["median"] >= 1.05,
                }
    return a


# ------------------------------------------------------------------------------ report
def _rank_list(values: list[float], fmt: str = "{:,.0f}") -> str:
    return ", ".join(fmt.format(v) for v in values)


def report(res: dict[str, Any]) -> str:
    s, m, configs = res["suite"], res["machine"], res["configs"]
    n = top_world(configs)
    # scaling and answers re-derived from the configs: results.json files written before the
    # world size was a preset field keep rendering (their scaling keys named 2 ranks)
    res = {**res, "scaling": scaling(configs)}
    gpu = f"{m['gpu_count']} x {m['gpu']}" if m["gpu"] and m.get("gpu_count") else m["gpu"] or "no GPU"
    if m["gpu"] and m.get("cuda"):
        gpu += f" (CUDA {m['cuda']})"
    # the ranks' device: the runs' own record (older results: cuda whenever torch saw a GPU,
    # as hybridrec's launcher.device=auto and the reference pick)
    devices = sorted({r["device"].split(":")[0] for r in res["runs"] if r.get("device")}) or [
        "cuda" if m["gpu"] else "cpu"
    ]
    L = [
        "# Benchmark report",
        "",
        f"`{s['command']}` ({s['preset']} preset), {s['date']}, {s['duration_s'] / 60:.1f} min.",
        "",
        *(
            [
                f"**Partial: {s['interrupted']}.** The sections below hold what finished; a configuration or "
                "section that did not is missing, and a repetition cut short leaves fewer repetitions.",
                "",
            ]
            if s.get("interrupted")
            else []
        ),
        "## Machine and method",
        "",
        f"- Machine: {m['cpu']}, {m['cores']} cores, {gpu}; Python {m['python']}, torch {m['torch']}, "
        f"torchrec {m['torchrec']}, fbgemm-gpu {m['fbgemm_gpu']}, Hydra {m['hydra']}."
        + (
            f" The 1-minute load average while it ran: median {m['load_average']['median']:.1f}, max "
            f"{m['load_average']['max']:.1f} ({m['load_average']['cores']} cores: more than one training process's "
            "worth means other work shared them)."
            if m.get("load_average")
            else ""
        ),
        f"- `ctr` experiment (DLRM, 64-dim tables, Adagrad), per-rank batch {s['per_rank_batch']} (global = "
        f"per-rank x ranks: weak scaling). {s['steps']} steps per run; the first {s['warmup_steps']} (tracing, "
        f"pipeline fill, lazy init) are excluded from the rate; {s['reps']} repetitions, alternating: every "
        f"configuration once per repetition, sweep order reversed every other repetition.",
        "- hybridrec: Hydra multirun over `python -m hybridrec.train`; references: "
        "`benchmarks/reference_torchrec.py` under torchrun (TorchRec planner defaults, DMP's DDP, fused "
        "sparse optimizer, TrainPipelineSparseDist), same model, data, batch and optimizers, fed two ways: "
        "*the reference* builds hybridrec's batches on its training thread each step (the input cost "
        "hybridrec pays); *pre-generated* cycles batches TorchRec's `RandomRecDataset` made before the clock "
        "started, as TorchRec's examples do (no input cost in the timed steps).",
        "- samples/s: median over repetitions, min - max beside it. Ratio: hybridrec / a reference in the "
        "same repetition at the same world size, median (min - max). Step time p50/p95: host wall time "
        "per step over all steps (summary.json). Memory: peak RSS per rank.",
        "- Every run's resolved config, overrides and raw numbers are in `results.json`.",
    ]
    if "cuda" in devices:
        kernels = {
            kind: sorted({k for c in configs if c["kind"] == kind for k in c.get("compute_kernels", [])})
            for kind in ("hybridrec", "reference")
        }
        L.append(
            f"- Ranks on {', '.join(devices)}: one GPU per rank, NCCL. Embedding kernels the planners chose: "
            f"hybridrec {', '.join(kernels['hybridrec']) or 'not recorded'}; reference "
            f"{', '.join(kernels['reference']) or 'not recorded'}. Step times are host wall time: on a GPU "
            "the host runs ahead of the device; samples/s are timed between synchronizing collectives."
        )
    if any(r.get("dense_ran") == "single" != r["dense"] for r in res["runs"]):
        L.append(
            "- On 1 rank, `mesh=fsdp` and `mesh=ddp` both run the dense part unwrapped (no peer to shard or "
            "reduce with: `parallelize.dense_mode`); their 1-rank rows measure the same program twice."
        )
    L += [f"- {note}" for note in s.get("notes", [])]
    if devices == ["cpu"] and m["cores"] and m["cores"] <= n:
        L.append(
            f"- On {m['cores']} cores, {n} ranks share the cores one rank uses: {n} ranks add communication, "
            f"not compute. Read the {n}-rank numbers as distributed overhead."
        )
    a = res["answers"]
    L += ["", "## Answers", ""]
    if a:
        L.append(
            f"- Fastest at {ranks_label(n)}: **{a['fastest']}** ({a['fastest_samples_per_second']:,.0f} samples/s)."
        )
        if "default" in a:
            verdict = "meets" if a["target_default_within_5pct"] else "misses"
            L.append(
                f"- Default (`{a['default']}`) is {a['default_behind_fastest_pct']:.1f}% behind the fastest: "
                f"{verdict} the target (<= 5%)."
            )
        if "ddp_vs_reference" in a:
            d = a["ddp_vs_reference"]
            verdict = "meets" if a["target_ddp_at_least_reference"] else "misses"
            L.append(
                f"- hybridrec `ddp` vs the hand-written TorchRec loop: {d['median']:.3f}x "
                f"({d['min']:.3f} - {d['max']:.3f} over repetitions): {verdict} the target (>= 1.0x)."
            )
        if "default_vs_reference" in a:
            d = a["default_vs_reference"]
            verdict = "meets" if a["target_default_at_least_reference"] else "misses"
            L.append(
                f"- Default vs the hand-written TorchRec loop at {ranks_label(n)}: {d['median']:.3f}x "
                f"({d['min']:.3f} - {d['max']:.3f}): {verdict} the target (>= 1.0x)."
            )
        for kind, label in (("reference", "the reference"), ("pregenerated", "the pre-generated-batch reference")):
            for world, d in a.get(f"fastest_vs_{kind}", {}).items():
                verdict = "meets" if d["target_met"] else "misses"
                L.append(
                    f"- Fastest at {ranks_label(int(world))} vs {label}: `{d['config']}` "
                    f"{d['median']:.3f}x ({d['min']:.3f} - {d['max']:.3f}, {d['reps']} repetitions): {verdict} "
                    "the target (>= 1.05x)."
                )
        for name, key in (("hybridrec `ddp`", "ddp_vs_pregenerated"), ("Default", "default_vs_pregenerated")):
            if key in a:
                d = a[key]
                L.append(
                    f"- {name} vs the pre-generated-batch reference at {ranks_label(n)}: {d['median']:.3f}x "
                    f"({d['min']:.3f} - {d['max']:.3f})."
                )
    if "memory" in a:
        mem = a["memory"]
        if mem["default"]:
            L.append(
                f"- Memory per rank, default: peak RSS {_rank_list(mem['default'])} MB (planner estimate for "
                f"the tables {_rank_list(mem['default_estimate'])} MB); most even split: {mem['most_even']} "
                f"({_rank_list(mem['most_even_peak_rss_mb'])} MB)."
            )
    if res["scaling"]:  # the default mode's scaling when measured
        sc = next((x for x in res["scaling"] if x["name"] == "auto · fsdp · sparse_dist"), res["scaling"][0])
        L.append(
            f"- Scaling 1 -> {n} ranks ({sc['name']}): {sc['speedup']:.2f}x throughput "
            f"(efficiency {sc['efficiency']:.0%} of ideal {n}x); see Weak scaling."
        )
    rf = res.get("roofline")
    L += ["", "## Throughput and ratio vs reference", ""]
    if rf:
        L += [
            f"Dense roofline: the dense part does {rf['flops_per_sample'] / 1e6:.2f} MFLOP per sample (forward + "
            f"backward, torch's FlopCounterMode); the machine's sgemm rate ({rf['gemm']}) was "
            f"{_rank_list(rf['sgemm_gflops'], '{:.1f}')} GFLOP/s at the start and end of the run. Dense roofline = "
            "samples/s x FLOPs per sample / the median rate: the share of the machine's dense arithmetic "
            "the mode turns into training.",
            "",
        ]
    else:
        L += ["Dense roofline: not measured in this preset.", ""]
    L += [
        "| configuration | samples/s (median) | min - max | step p50 / p95 ms | vs reference | "
        "vs pre-generated | dense roofline |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for c in configs:
        ratios = []
        for kind in REFERENCE_KINDS:
            r = c.get(f"ratio_vs_{kind}")
            ratios.append(f"{r['median']:.3f} ({r['min']:.3f} - {r['max']:.3f})" if r else "-")
        roof = f"{roofline_fraction(c['median_samples_per_second'], rf):.0%}" if rf else "-"
        L.append(
            f"| {c['name']} | {c['median_samples_per_second']:,.0f} | {c['min_samples_per_second']:,.0f} - "
            f"{c['max_samples_per_second']:,.0f} | {c['step_time_p50_ms']:.1f} / {c['step_time_p95_ms']:.1f} | "
            f"{' | '.join(ratios)} | {roof} |"
        )
    # GPU runs: torch's peak allocated device memory per rank, when the runs recorded it
    device_mem = any("peak_device_allocated_mb" in c for c in configs)
    L += [
        "",
        "## Memory per rank",
        "",
        "Peak RSS per rank (median over repetitions) beside the planner's estimate for the tables it "
        "placed (host MB on CPU; the rest of RSS is the runtime, dense model, buffers and batches)."
        + (
            " On GPU: the estimate is device memory, beside torch's peak allocated device memory." if device_mem else ""
        ),
        "",
        "| configuration | sharding chosen (x shards per table) | peak RSS MB per rank | planner estimate MB per rank |"
        + (" peak device allocated MB per rank |" if device_mem else ""),
        "|---|---|---|---|" + ("---|" if device_mem else ""),
    ]
    for c in configs:
        est = [h + d for h, d in zip(c.get("est_host_mb", []), c.get("est_device_mb", []))]
        L.append(
            f"| {c['name']} | {', '.join(c['plan_types'])} | {_rank_list(c['peak_rss_mb'])} | "
            f"{_rank_list(est) if est else '-'} |"
            + (
                f" {_rank_list(c['peak_device_allocated_mb']) if 'peak_device_allocated_mb' in c else '-'} |"
                if device_mem
                else ""
            )
        )
    L += ["", "## Weak scaling", ""]
    if n > 1:
        L += [
            f"Per-rank batch fixed at {s['per_rank_batch']}: 1 rank runs global batch {s['per_rank_batch']}, "
            f"{n} ranks {n * s['per_rank_batch']}. Efficiency = samples/s at {n} ranks / ({n} x samples/s at 1 rank).",
            "",
            f"| configuration | 1 rank samples/s | {n} ranks samples/s | speed-up | efficiency |",
            "|---|---:|---:|---:|---:|",
        ]
        for sc in res["scaling"]:
            L.append(
                f"| {sc['name']} | {sc['samples_per_second_1']:,.0f} | {sc['samples_per_second_n']:,.0f} | "
                f"{sc['speedup']:.2f}x | {sc['efficiency']:.0%} |"
            )
    else:
        L.append("One world size in this run (1 rank): no scaling to report.")
    L += ["", "## Where the time goes (profiled)", ""]
    if res["profile"]:
        from hybridrec.reports.profiling import BREAKDOWN_PHASES

        L += [
            "Host wall time per step on each rank's training thread, from torch.profiler traces of real runs "
            f"(`profile.enabled=true`, {n} ranks, sharding auto, sparse_dist; separate runs, as the profiler slows "
            "what it records). Each instant goes to the innermost labelled phase around it "
            "(`hybridrec.reports.profiling.step_breakdown`); the sparse optimizer is fused into the embedding backward "
            "and counts there; waiting while a collective runs counts as that collective.",
            "",
            "| dense | rank | " + " | ".join(BREAKDOWN_PHASES) + " | step ms |",
            "|---|---:|" + "---:|" * (len(BREAKDOWN_PHASES) + 1),
        ]
        for pr in res["profile"]:
            for rank, prof in enumerate(pr["profile"]):
                b = prof["breakdown_ms"]
                L.append(
                    f"| {pr['dense']} | {rank} | "
                    + " | ".join(f"{b[k]:.1f}" for k in BREAKDOWN_PHASES)
                    + f" | {sum(b.values()):.1f} |"
                )
    else:
        L.append("Not run in this preset.")
    L += ["", "## Communication share (profiled)", ""]
    if res["profile"]:
        L += [
            "Share of the profiled steps during which a collective ran (torch.profiler, `profile.enabled=true`, "
            f"{n} ranks, sharding auto, sparse_dist). Overlapped comm counts as comm: an upper bound.",
            "",
            "| dense | rank | comm share | comm ms | compute ms | comm ms by kind |",
            "|---|---:|---:|---:|---:|---|",
        ]
        for pr in res["profile"]:
            for rank, prof in enumerate(pr["profile"]):
                kinds = ", ".join(f"{k} {v:.1f}" for k, v in prof["comm_ms_by_kind"].items())
                L.append(
                    f"| {pr['dense']} | {rank} | {prof['comm_share']:.0%} | {prof['comm_ms']:.1f} | "
                    f"{prof['compute_ms']:.1f} | {kinds} |"
                )
    else:
        L.append("Not run in this preset.")
    L += ["", "## Levers", ""]
    if res.get("levers"):
        import levers

        lw = res["levers"].get("world_size", n)  # (recorded since the world size is a preset field)
        where = f"{gpu}" if "cuda" in devices else f"{m['cpu']}, {m['cores']} cores"
        L += [
            f"Each lever on top of the default (`ctr`, {ranks_label(lw)}, auto · fsdp · sparse_dist), measured beside "
            "the default and the reference in every repetition (`benchmarks/levers.py`).",
            "",
            *levers.table(res["levers"], where, lw),
        ]
    else:
        L.append("Not run in this preset.")
    L += ["", "## Dense-heavy case: DDP vs FSDP2", ""]
    dm = res.get("dense_memory")
    if dm:
        import dense_memory

        L += [
            f"`benchmarks/dense_memory.py` ({dm['steps']} steps per window, {dm['reps']} alternating windows): "
            f"{dm['numel'] / 1e6:.1f} M dense parameters, {dm['flops_per_sample'] / 1e6:.1f} MFLOP per sample, "
            f"dense Adagrad, {ranks_label(len(dm['ranks']['ddp']))}; bytes each rank holds after a step.",
            "",
            *dense_memory.table(dm["ranks"], dm["flops_per_sample"], rf["sgemm_gflops_median"] if rf else None),
        ]
    else:
        L.append("Not run in this preset.")
    L += ["", "## Input pipeline", ""]
    if res.get("input"):
        import input_scaling

        L += ["`benchmarks/input_scaling.py` (in this run):", "", *input_scaling.table(res["input"])]
    else:
        L.append("Not run in this preset.")
    L += ["", "## Charts", ""] + [f"![{c}]({c})" for c in CHARTS]
    return "\n".join(L) + "\n"


def _save(fig: Any, ax: Any, out: str, name: str) -> None:
    """Legend, grid and layout of a chart, written to ``out/name`` and closed."""
    import matplotlib.pyplot as plt

    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out, name), dpi=100)
    plt.close(fig)


def charts(res: dict[str, Any], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    configs = res["configs"]
    n = top_world(configs)
    top = [c for c in configs if c["world_size"] == n and c["kind"] == "hybridrec"]
    ref = next((c for c in configs if c["world_size"] == n and c["kind"] == "reference"), None)
    pregen = next((c for c in configs if c["world_size"] == n and c["kind"] == "pregenerated"), None)

    # Throughput by strategy: sharding on x, one bar per dense x pipeline, min-max whiskers.
    shardings = [s for s in SHARDINGS if any(c["sharding"] == s for c in top)]
    modes = sorted({(c["dense"], c["pipeline"]) for c in top})
    fig, ax = plt.subplots(figsize=(max(6, 2 + 1.6 * len(shardings)), 4.5))
    width = 0.8 / max(1, len(modes))
    for i, (dense, pipeline) in enumerate(modes):
        xs, ys, lo, hi = [], [], [], []
        for j, s in enumerate(shardings):
            c = next((c for c in top if (c["sharding"], c["dense"], c["pipeline"]) == (s, dense, pipeline)), None)
            if c:
                med = c["median_samples_per_second"]
                xs.append(j + (i - (len(modes) - 1) / 2) * width)
                ys.append(med)
                lo.append(med - c["min_samples_per_second"])
                hi.append(c["max_samples_per_second"] - med)
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=f"{dense} · {pipeline}")
    if ref:
        ax.axhline(ref["median_samples_per_second"], color="black", ls="--", label="TorchRec reference")
    if pregen:
        ax.axhline(
            pregen["median_samples_per_second"], color="gray", ls=":", label="TorchRec reference, pre-generated batches"
        )
    ax.set_xticks(range(len(shardings)), shardings)
    ax.set(title=f"{ranks_label(n)}: throughput by strategy (median, min-max)", ylabel="samples/s")
    _save(fig, ax, out, CHARTS[0])

    # Memory per rank: peak RSS per rank, planner estimate as markers.
    mem = [c for c in configs if c["world_size"] == n and (c["kind"] == "reference" or c["pipeline"] == "sparse_dist")]
    fig, ax = plt.subplots(figsize=(max(6, 1 + 0.45 * n * len(mem)), 4.5))
    width = 0.76 / n  # the n ranks' bars side by side in one slot per configuration
    for rank in range(n):
        xs = [i + (rank - (n - 1) / 2) * width for i in range(len(mem))]
        ax.bar(xs, [c["peak_rss_mb"][rank] for c in mem], width, label=f"rank {rank} peak RSS")
        est = [(x, c["est_host_mb"][rank] + c["est_device_mb"][rank]) for x, c in zip(xs, mem) if "est_host_mb" in c]
        if est:
            ax.plot(
                *zip(*est), "k_", ms=28 / max(n, 2), mew=2, label="planner estimate (tables)" if rank == 0 else None
            )
    ax.set_xticks(range(len(mem)), [c["name"].split(" · ", 1)[1].replace(" · ", "\n") for c in mem], fontsize=7)
    ax.set(title=f"{ranks_label(n)}: memory per rank", ylabel="MB")
    _save(fig, ax, out, CHARTS[1])

    # Ratio to the reference, per configuration, with its spread over repetitions.
    rat = [c for c in configs if c["kind"] == "hybridrec" and "ratio_vs_reference" in c]
    fig, ax = plt.subplots(figsize=(7, max(3, 0.3 * len(rat) + 1.5)))
    for i, c in enumerate(rat):
        r = c["ratio_vs_reference"]
        ax.errorbar(
            r["median"],
            i,
            xerr=[[r["median"] - r["min"]], [r["max"] - r["median"]]],
            fmt="o",
            color="tab:blue" if c["dense"] == "ddp" else "tab:orange",
            capsize=3,
        )
    ax.axvline(1.0, color="black", ls="--")
    ax.set_yticks(range(len(rat)), [c["name"] for c in rat], fontsize=7)
    ax.set(title="hybridrec / TorchRec reference (same world size; blue ddp, orange fsdp)", xlabel="ratio")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out, CHARTS[2]), dpi=100)
    plt.close(fig)

    # Weak scaling.
    sc = scaling(configs)  # (from the configs, as the report: older results.json named 2 ranks in its keys)
    fig, ax = plt.subplots(figsize=(max(6, 1.5 * len(sc) + 1), 4))
    xs = range(len(sc))
    ax.bar([x - 0.2 for x in xs], [s["samples_per_second_1"] for s in sc], 0.4, label="1 rank")
    ax.bar([x + 0.2 for x in xs], [s["samples_per_second_n"] for s in sc], 0.4, label=ranks_label(n))
    ax.set_xticks(list(xs), [s["name"].replace(" · ", "\n") for s in sc], fontsize=7)
    ax.set(title=f"weak scaling (per-rank batch {res['suite']['per_rank_batch']})", ylabel="samples/s")
    _save(fig, ax, out, CHARTS[3])


# ------------------------------------------------------------------------------ main
def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    res = json.load(open(os.path.join(out, "results.json")))
    charts(res, out)
    with open(os.path.join(out, "REPORT.md"), "w") as f:
        f.write(report(res))


if __name__ == "__main__":
    main()
