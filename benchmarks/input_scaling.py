"""The input pipeline, measured: per-rank cost against world size, input rate against
training's consumption, and the converter.

1. Per-rank cost. Rank 0's ``hybridrec.data.loader.batches`` (inline, no training) is timed
   at world sizes 1, 2, 4 and 8 for each source: synthetic data in the ``ctr`` and
   ``dcnv2_criteo1tb`` shapes, Criteo TSV (data.shards=8), Criteo binary, and the same
   binary rows converted to Parquet (``data=parquet``, ``convert --format parquet``), read as
   contiguous global batches and with ``data.shards=8``. Weak scaling
   keeps the per-rank batch fixed (global = per-rank x world size): rank 0's time per step
   should stay flat. Strong scaling keeps the global batch fixed: it should fall as
   1/world size. Only rank 0 runs, so 8 "ranks" fit on any machine.
2. Input rate. Rows/s of each source into one rank's batches with 0 and 2 worker
   processes, and the ``ctr`` experiment's training samples/s with data.num_workers=0, 2,
   and with one pre-built batch fed again and again (no input cost at all): the input is
   not the bottleneck when num_workers=2 trains as fast as the pre-built batch.
3. The converter's rows/s (``python -m hybridrec.data.convert``, 1 and 2 workers).

Every figure is a median over alternating repetitions (each configuration once per
repetition, in reversed order every other one).

    python benchmarks/input_scaling.py [--reps 3] [--tsv-rows 200000]
Writes benchmarks/results/INPUT.md (and input.json); ``bench.py`` folds the same into REPORT.md.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import io
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import numpy as np

from common import ROOT, compose_config, machine

HERE = os.path.dirname(os.path.abspath(__file__))

WORLDS = (1, 2, 4, 8)


def write_tsv(path: str, rows: int, seed: int = 0) -> None:
    """Criteo-format rows: label, 13 integers (10% missing), 26 hex ids."""
    rng = np.random.default_rng(seed)
    with gzip.open(path, "wt") if path.endswith(".gz") else open(path, "w") as f:
        for start in range(0, rows, 50_000):
            n = min(50_000, rows - start)
            labels = rng.integers(0, 2, n)
            ints = rng.integers(-1, 1000, (n, 13)).astype(str)
            ints[rng.random((n, 13)) < 0.1] = ""
            cats = np.char.mod("%08x", rng.integers(0, 2**32, (n, 26)))
            f.write("\n".join("\t".join([str(label), *i, *c]) for label, i, c in zip(labels, ints, cats)) + "\n")


def sources(tmp: str, tsv_rows: int) -> dict[str, Callable[[int], Any]]:
    """Source builders by name: global batch size -> source."""
    from hybridrec.config import CRITEO_KAGGLE_CAPPED
    from hybridrec.data import build_source
    from hybridrec.data.convert import main as convert_main
    from hybridrec.data.criteo import CriteoBinary, CriteoTSV

    train, held = os.path.join(tmp, "tsv", "day_0.tsv"), os.path.join(tmp, "held", "day_1.tsv")
    for path, rows in ((train, tsv_rows), (held, 4096)):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if not os.path.exists(path):
            write_tsv(path, rows, seed=rows)
    npy, pq = os.path.join(tmp, "npy"), os.path.join(tmp, "pq")
    if not os.path.exists(npy):
        for src in (train, held):
            with contextlib.redirect_stdout(io.StringIO()):  # set-up, not measured: in this process
                convert_main([src, "--out", npy, "--workers", "1"])
    if not os.path.exists(pq):  # the binary layout's rows, as Parquet: the same rows for both readers
        with contextlib.redirect_stdout(io.StringIO()):
            convert_main([npy, "--out", pq, "--format", "parquet"])
    parquet = compose_config(
        [
            f"hydra.searchpath=[file://{os.path.join(pq, 'conf')}]",
            "data=criteo_parquet",
            f"data.train_path={os.path.join(pq, 'day_0.parquet')}",
            f"data.eval_path={os.path.join(pq, 'day_1.parquet')}",
        ]
    ).data
    common = dict(num_embeddings_per_feature=CRITEO_KAGGLE_CAPPED, id_mapping="modulo", eval_batches=None, seed=0)
    # Steady-state parsing is what is measured: the one-time collision estimate (rank 0, over
    # shard 0's first 100k rows) is cut to one block, and its warning (random ids into
    # Kaggle-capped tables collide, as expected) is silenced.
    import hybridrec.data.criteo.tsv as criteo  # the module that reads _COLLISION_SAMPLE

    criteo._COLLISION_SAMPLE = 1
    logging.getLogger("hybridrec.data.criteo").setLevel(logging.ERROR)
    ctr = compose_config(["+experiment=ctr"]).data
    dcn = compose_config(["+experiment=dcnv2_criteo1tb"]).data

    def synthetic(cfg):
        return lambda b: build_source(_with(cfg, batch_size=b), 0)

    return {
        "synthetic (ctr)": synthetic(ctr),
        "synthetic (dcnv2_criteo1tb)": synthetic(dcn),
        "Criteo TSV (8 shards)": lambda b: CriteoTSV(
            batch_size=b, train_path=train, eval_path=held, bad_rows="skip", block_size_mb=16, shards=8, **common
        ),
        "Criteo binary": lambda b: CriteoBinary(
            batch_size=b,
            train_path=os.path.join(npy, "day_0_dense.npy"),
            eval_path=os.path.join(npy, "day_1_dense.npy"),
            **common,
        ),
        "Parquet (the binary rows)": lambda b: build_source(_with(parquet, batch_size=b), 0),
        "Parquet, data.shards=8": lambda b: build_source(_with(parquet, batch_size=b, shards=8), 0),
    }


def _with(cfg, **values):
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(OmegaConf.to_container(cfg))
    for k, v in values.items():
        cfg[k] = v
    return cfg


def step_ms(make: Callable[[int], Any], global_batch: int, world: int, steps: int, workers: int = 0) -> float:
    """Rank 0's mean milliseconds per batch over ``steps`` batches, after a warm-up of one
    batch per worker (process start, file open). A mean, not a median: a stream reader's
    cost comes in lumps (one block parsed every few batches)."""
    from hybridrec.data import loader

    source = make(global_batch)
    warm = 1 + workers
    it = loader.batches(source, "train", 0, world, steps + warm, num_workers=workers)
    for _ in range(warm):
        next(it)
    tick = time.perf_counter()
    n = sum(1 for _ in it)
    return 1000 * (time.perf_counter() - tick) / n


def alternate(configs: list[tuple[str, Callable[[], float]]], reps: int) -> dict[str, list[float]]:
    """Every configuration once per repetition, the order reversed every other repetition."""
    out: dict[str, list[float]] = {name: [] for name, _ in configs}
    for rep in range(reps):
        for name, fn in configs if rep % 2 == 0 else configs[::-1]:
            out[name].append(fn())
    return out


def scaling(
    makers: dict[str, Callable[[int], Any]], reps: int, sizes: dict[str, tuple[int, int]], steps: int
) -> dict[str, Any]:
    """Weak and strong scaling of rank 0's time per step, per source."""
    configs = []
    for name, make in makers.items():
        per_rank, fixed = sizes[name]
        # A TSV shard parses a block of thousands of rows every few dozen steps, and the
        # warm-up batch parses one block per shard: enough steps that every world size parses
        # many blocks per shard, or the warm-up hides part of the parsing (most at 1 rank).
        n = steps * 12 if "TSV" in name else steps
        weak_n = n * 4 if "TSV" in name else n
        for world in WORLDS:
            configs.append(
                (f"{name}|weak|{world}", lambda m=make, w=world, rows=per_rank, k=weak_n: step_ms(m, rows * w, w, k))
            )
            configs.append((f"{name}|strong|{world}", lambda m=make, w=world, b=fixed, k=n: step_ms(m, b, w, k)))
    runs = alternate(configs, reps)
    out: dict[str, Any] = {}
    for key, values in runs.items():
        name, kind, world = key.split("|")
        out.setdefault(
            name, {"per_rank_batch": sizes[name][0], "global_batch": sizes[name][1], "weak": {}, "strong": {}}
        )
        out[name][kind][world] = statistics.median(values)
    return out


def input_rates(makers: dict[str, Callable[[int], Any]], reps: int, batch: int, steps: int) -> dict[str, Any]:
    """Rows/s into one rank's batches, 0 and 2 workers."""
    configs = [
        (
            f"{name}|{w}",
            lambda m=make, w=w, k=steps * 12 if "TSV" in name else steps: (
                batch / step_ms(m, batch, 1, k, workers=w) * 1000
            ),
        )  # (TSV: parse many blocks, see scaling)
        for name, make in makers.items()
        for w in (0, 2)
    ]
    runs = alternate(configs, reps)
    out: dict[str, dict[str, float]] = {}
    for key, values in runs.items():
        name, workers = key.split("|")
        out.setdefault(name, {})[workers] = statistics.median(values)
    return out


def training_rates(reps: int, steps: int, overrides: tuple[str, ...] = ()) -> dict[str, float]:
    """The ``ctr`` experiment's steady-state samples/s (1 rank): num_workers 0 and 2, and a
    pre-built batch (benchmarks/fixed_batch.py: the input costs nothing). ``overrides``: on
    top of the experiment (the smoke preset's small tables)."""

    def run(*extra: str, fixed: bool = False) -> float:
        with tempfile.TemporaryDirectory() as d:
            entry = [os.path.join(HERE, "fixed_batch.py")] if fixed else ["-m", "hybridrec.train"]
            subprocess.run(
                [
                    sys.executable,
                    *entry,
                    "+experiment=ctr",
                    *overrides,
                    f"train.steps={steps}",
                    "train.log_every=10",
                    "train.eval_every=0",
                    "data.eval_batches=1",
                    "data.valid_batches=1",
                    f"hydra.run.dir={d}",
                    *extra,
                ],
                check=True,
                capture_output=True,
                cwd=ROOT,
            )
            rows = [json.loads(line) for line in open(os.path.join(d, "metrics.jsonl"))]
            rows = [r for r in rows if "elapsed_s" in r]
            first, last = rows[0], rows[-1]  # steady state: after the first log window
            return (last["step"] - first["step"]) * 2048 / (last["elapsed_s"] - first["elapsed_s"])

    runs = alternate(
        [
            ("num_workers=0", lambda: run("data.num_workers=0")),
            ("num_workers=2", lambda: run("data.num_workers=2")),
            ("pre-built batch", lambda: run(fixed=True)),
        ],
        reps,
    )
    return {k: statistics.median(v) for k, v in runs.items()}


def converter_rates(tmp: str, reps: int) -> dict[str, float]:
    """Rows/s of the converter on four files of the TSV's rows (one file per worker task)."""
    src = os.path.join(tmp, "tsv", "day_0.tsv")
    parts = os.path.join(tmp, "parts")
    if not os.path.exists(parts):
        os.makedirs(parts)
        lines = open(src).read().splitlines(keepends=True)
        for i in range(4):
            with open(os.path.join(parts, f"day_{i}.tsv"), "w") as f:
                f.writelines(lines[i::4])
    rows = sum(1 for _ in open(src))

    def run(workers: int) -> float:
        with tempfile.TemporaryDirectory() as out:
            tick = time.perf_counter()
            subprocess.run(
                [
                    sys.executable,
                    "-c",
                    "import sys; from hybridrec.data.convert import main; "
                    "import time; t = time.perf_counter(); main(sys.argv[1:]); "
                    "print('SECONDS', time.perf_counter() - t)",
                    parts,
                    "--out",
                    out,
                    "--overwrite",
                    "--workers",
                    str(workers),
                ],
                check=True,
                capture_output=True,
                cwd=ROOT,
                text=True,
            )
            return time.perf_counter() - tick

    runs = alternate([(f"{w} worker{'s' * (w > 1)}", lambda w=w: rows / run(w)) for w in (1, 2)], reps)
    return {k: statistics.median(v) for k, v in runs.items()}


def measure(
    reps: int,
    tsv_rows: int,
    steps: int,
    train_steps: int,
    quick: bool = False,
    scale: int = 1,
    train_overrides: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Every section; ``quick`` leaves out the dcnv2 shape, ``scale`` divides the batches and
    ``train_overrides`` change the trained model (the smoke preset's check that the outputs
    are well-formed)."""
    with tempfile.TemporaryDirectory() as tmp:
        makers = sources(tmp, tsv_rows)
        sizes = {  # (per-rank batch for weak scaling, global batch for strong scaling)
            "synthetic (ctr)": (2048 // scale, 8192 // scale),
            "synthetic (dcnv2_criteo1tb)": (8192 // scale, 65536 // scale),
            "Criteo TSV (8 shards)": (1024 // scale, 8192 // scale),
            "Criteo binary": (1024 // scale, 8192 // scale),
            "Parquet (the binary rows)": (1024 // scale, 8192 // scale),
            "Parquet, data.shards=8": (1024 // scale, 8192 // scale),
        }
        if quick:
            makers.pop("synthetic (dcnv2_criteo1tb)")
        res = {"scaling": scaling(makers, reps, sizes, steps)}
        res["rates"] = input_rates(makers, reps, 2048 // scale, steps)
        res["converter"] = converter_rates(tmp, reps)
        res["converter_rows"] = tsv_rows
    res["training"] = training_rates(reps, train_steps, train_overrides)
    res["rate_batch"] = 2048 // scale
    res["settings"] = {
        "reps": reps,
        "tsv_rows": tsv_rows,
        "steps": steps,
        "train_steps": train_steps,
        "train_overrides": list(train_overrides),
    }
    return res


def table(res: dict[str, Any]) -> list[str]:
    """The report's lines."""
    L = [
        "Rank 0's milliseconds per step (mean over the steps, median over repetitions), "
        "`hybridrec.data.loader.batches` inline, no training.",
        "Weak: per-rank batch fixed; strong: global batch fixed.",
        "",
        "| source | scaling | batch | " + " | ".join(f"{w} rank{'s' * (w > 1)}" for w in WORLDS) + " | ratio 8 / 1 |",
        "|---|---|---:|" + "---:|" * (len(WORLDS) + 1),
    ]
    for name, s in res["scaling"].items():
        for kind, batch in (("weak", f"{s['per_rank_batch']:,} per rank"), ("strong", f"{s['global_batch']:,} global")):
            ms = s[kind]
            L.append(
                f"| {name} | {kind} | {batch} | "
                + " | ".join(f"{ms[str(w)]:.1f}" for w in WORLDS)
                + f" | {ms['8'] / ms['1']:.2f} |"
            )
    npy = res["scaling"].get("Criteo binary")
    for name in ("Parquet (the binary rows)", "Parquet, data.shards=8"):
        if (pq := res["scaling"].get(name)) and npy:
            L += [
                "",
                f"{name} against the binary reader on the same rows, per step (weak scaling): "
                + ", ".join(f"{w} rank{'s' * (w > 1)} {pq['weak'][str(w)] / npy['weak'][str(w)]:.2f}x" for w in WORLDS)
                + f"; its own weak-scaling ratio 8 / 1: {pq['weak']['8'] / pq['weak']['1']:.2f}.",
            ]
    train = res["training"]
    overrides = res["settings"].get("train_overrides")  # absent from results written before it
    trained = "`ctr` experiment" + (f" (with `{' '.join(overrides)}`)" if overrides else "")
    L += [
        "",
        f"Input rows/s into one rank's batches of {res['rate_batch']:,} (0 and 2 worker processes), beside the "
        f"{trained}'s training consumption: {train['num_workers=0']:,.0f} samples/s with `data.num_workers=0`, "
        f"{train['num_workers=2']:,.0f} with 2 workers, {train['pre-built batch']:,.0f} with one pre-built batch "
        f"fed again and again (no input cost; ratio 2 workers / pre-built = "
        f"{train['num_workers=2'] / train['pre-built batch']:.2f}).",
        "",
        "| source | rows/s, inline | rows/s, 2 workers | inline / training |",
        "|---|---:|---:|---:|",
    ]
    for name, r in res["rates"].items():
        L.append(f"| {name} | {r['0']:,.0f} | {r['2']:,.0f} | {r['0'] / train['num_workers=0']:.1f}x |")
    conv = res["converter"]
    L += [
        "",
        f"`python -m hybridrec.data.convert` on {res['converter_rows']:,} rows in 4 files: "
        + ", ".join(f"{k}: {v:,.0f} rows/s" for k, v in conv.items())
        + " (process start included).",
    ]
    return L


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tsv-rows", type=int, default=200_000)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--train-steps", type=int, default=60)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    res = measure(args.reps, args.tsv_rows, args.steps, args.train_steps)
    res["machine"] = machine()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "input.json"), "w") as f:
        json.dump(res, f, indent=1)
    text = (
        "\n".join(
            [
                f"# Input pipeline\n\n`python benchmarks/input_scaling.py --reps {args.reps}` on "
                f"{res['machine'].get('cpu', '?')}.\n",
                *table(res),
            ]
        )
        + "\n"
    )
    with open(os.path.join(args.out, "INPUT.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
