"""The default dense mode (mesh=fsdp) against mesh=ddp on a short run: the whole run's rate
(what a sweep job sees), the rate after the first steps, and the time of those first steps
(summary.json ``train``: samples_per_second, steady_samples_per_second, first_steps_s); then
where the first step's time goes in each mode (one run each profiling step 1 alone,
profile.start_step=0: summary.json's per-phase breakdown, rank 0).

    python benchmarks/first_steps.py [--reps 3] [--steps 150] [overrides ...]

Writes benchmarks/results/FIRST_STEPS.md (medians over alternating repetitions, 2 ranks).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import tempfile

from common import machine, measure_alternating, train_summary, write_markdown

HERE = os.path.dirname(os.path.abspath(__file__))

SETTINGS = {"fsdp": "mesh=fsdp", "ddp": "mesh=ddp"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "FIRST_STEPS.md"))
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    base = [
        "+experiment=ctr",
        "launcher.nproc_per_node=2",
        f"train.steps={args.steps}",
        "train.eval_every=0",
        *args.overrides,
    ]
    results = measure_alternating(base, args.reps, busy=False, settings=SETTINGS)
    med = {
        name: {
            key: statistics.median(r[key] for r in runs)
            for key in ("samples_per_second", "steady_samples_per_second", "first_steps_s", "step_time_p50_ms")
        }
        for name, runs in results.items()
    }
    m = machine()
    lines = [
        "# The first steps: fsdp against ddp",
        "",
        f"`python benchmarks/first_steps.py` ({datetime.date.today().isoformat()}; {m['cpu']}, {m['cores']} cores; "
        f"torch {m['torch']}): `python -m hybridrec.train {' '.join(base)}` with `mesh=fsdp` (the default) and "
        f"`mesh=ddp`, {args.reps} alternating repetitions, medians. Whole run: summary.json "
        "`samples_per_second`; after step 10: `steady_samples_per_second`; first 10 steps: `first_steps_s`.",
        "",
        "| dense mode | samples/s, whole run | samples/s, after step 10 | first 10 steps, s | step p50 ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in SETTINGS:
        r = med[name]
        lines.append(
            f"| `{SETTINGS[name]}` | {r['samples_per_second']:,.0f} | {r['steady_samples_per_second']:,.0f} "
            f"| {r['first_steps_s']:.2f} | {r['step_time_p50_ms']:.1f} |"
        )
    f, d = med["fsdp"], med["ddp"]
    lines.append(
        f"| fsdp / ddp | {f['samples_per_second'] / d['samples_per_second']:.3f} "
        f"| {f['steady_samples_per_second'] / d['steady_samples_per_second']:.3f} "
        f"| {f['first_steps_s'] / d['first_steps_s']:.2f} | {f['step_time_p50_ms'] / d['step_time_p50_ms']:.3f} |"
    )
    # Step 1 alone, profiled in each mode (not timed: the profiler slows the step it records).
    first = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, override in SETTINGS.items():
            s = train_summary(
                [*base, override, "profile.enabled=true", "profile.start_step=0", "profile.steps=1"],
                os.path.join(tmp, name),
            )
            first[name] = s["profile"][0]["breakdown_ms"]
    phases = list(first["fsdp"])
    lines += [
        "",
        "## Step 1",
        "",
        "Profiled alone (one run per mode, rank 0, ms by phase; `profile.start_step=0 profile.steps=1`):",
        "",
        "| dense mode | " + " | ".join(phases) + " | step |",
        "|---|" + "---:|" * (len(phases) + 1),
    ]
    for name in SETTINGS:
        b = first[name]
        lines.append(
            f"| `{SETTINGS[name]}` | " + " | ".join(f"{b[k]:.1f}" for k in phases) + f" | {sum(b.values()):.1f} |"
        )
    write_markdown(args.out, lines, "first_steps")


if __name__ == "__main__":
    main()
