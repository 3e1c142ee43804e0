"""Levers on the default mode (ctr, auto · fsdp · sparse_dist, at the suite's multi-rank world),
each measured beside the default and the hand-written TorchRec loop in the same repetition.

- bf16 dense compute with fp32 gradient reduction (FSDP2's MixedPrecisionPolicy);
- torch.compile of the dense blocks (``mesh.compile=true``);
- FSDP2 units per dense block (``mesh.units=arch``) instead of ``ctr``'s one root unit;
- the intra-op thread split: every core on every rank instead of cores / ranks (CPU ranks);
- the per-rank batch: half and twice the suite's.

Every repetition runs all of them once (plus the reference), the order reversed on every
other repetition. A lever's ratio is its samples/s over the default's in the same
repetition; median and range over repetitions. Called by bench.py (the "Levers" section of
REPORT.md); the batch levers change what is optimized, so they are throughput facts, not
candidates for a default.
"""

from __future__ import annotations

import os
import statistics
from typing import Any, Callable

LEVERS: dict[str, dict[str, Any]] = {
    "default": {"overrides": []},
    "bf16 dense compute, fp32 reduce": {"overrides": ["mesh.param_dtype=bfloat16", "mesh.reduce_dtype=float32"]},
    "torch.compile of the dense blocks": {"overrides": ["mesh.compile=true"]},
    "FSDP2 unit per dense block (ctr: one root unit)": {"overrides": ["mesh.units=arch"]},
    "every core on every rank": {"overrides": [f"launcher.threads_per_rank={os.cpu_count() or 1}"]},
    "per-rank batch x 1/2": {"overrides": [], "batch": 0.5},
    "per-rank batch x 2": {"overrides": [], "batch": 2.0},
}


def measure(p: Any, out: str, reps: int, single: Callable, reference: Callable, names: list[str] | None = None) -> dict:
    """Raw rates per lever and repetition, and the reference's, at the preset's multi-rank
    world (``p.worlds[-1]``); ``single`` and ``reference`` are bench.py's runners."""
    names = names or list(LEVERS)
    world = p.worlds[-1]
    rates: dict[str, list[float]] = {n: [] for n in names + ["reference"]}
    for rep in range(reps):
        order = names + ["reference"]
        for name in order[:: -1 if rep % 2 else 1]:
            if name == "reference":
                rates[name].append(reference(p, world, rep, out, tag="levers")["samples_per_second"])
                continue
            lever = LEVERS[name]
            batch = int(p.per_rank_batch * lever.get("batch", 1.0))
            tag = "lever_" + "".join(c if c.isalnum() else "_" for c in name)
            r = single(p, world, rep, out, tag, lever["overrides"], per_rank_batch=batch)
            rates[name].append(r["samples_per_second"])
            print(f"levers rep {rep + 1}/{reps}  {name:40s} {r['samples_per_second']:>9,.0f} samples/s", flush=True)
    return {
        "rates": rates,
        "per_rank_batch": {n: int(p.per_rank_batch * LEVERS[n].get("batch", 1.0)) for n in names},
        "overrides": {n: LEVERS[n]["overrides"] for n in names},
        "reps": reps,
        "world_size": world,
    }


def summarize(res: dict) -> list[dict]:
    """Per lever: median samples/s, its range, and the per-repetition ratios to the default
    and to the reference (median, min, max)."""
    rates = res["rates"]
    rows = []
    for name, rs in rates.items():
        if name == "reference":
            continue
        row = {
            "name": name,
            "median": statistics.median(rs),
            "min": min(rs),
            "max": max(rs),
            "per_rank_batch": res["per_rank_batch"][name],
            "overrides": res["overrides"][name],
        }
        for base in ("default", "reference"):
            ratios = [a / b for a, b in zip(rs, rates[base])]
            row[f"vs_{base}"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
        rows.append(row)
    return rows


def table(res: dict, machine: str, world: int) -> list[str]:
    ratio = lambda r: f"{r['median']:.3f} ({r['min']:.3f} - {r['max']:.3f})"
    lines = [
        "| lever | overrides | per-rank batch | samples/s (median) | min - max | vs default | vs reference |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in summarize(res):
        overrides = " ".join(f"`{o}`" for o in row["overrides"]) or "-"
        lines.append(
            f"| {row['name']} | {overrides} | {row['per_rank_batch']:,} | {row['median']:,.0f} | "
            f"{row['min']:,.0f} - {row['max']:,.0f} | {ratio(row['vs_default'])} | {ratio(row['vs_reference'])} |"
        )
    ref = res["rates"]["reference"]
    return lines + [
        "",
        f"Reference (hand-written TorchRec, per-rank batch {res['per_rank_batch']['default']:,}): "
        f"{statistics.median(ref):,.0f} samples/s ({min(ref):,.0f} - {max(ref):,.0f}); "
        f"{world} rank{'s' if world > 1 else ''}, {res['reps']} alternating repetitions, {machine}.",
    ]
