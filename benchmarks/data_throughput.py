"""Reader throughput beside training throughput, measured in one run on this machine.

Writes a Criteo-format TSV (plain and gzip) and the same rows in TorchRec's binary layout,
times how fast each reader turns them into global batches (rows/s, one rank; with the TSV
reader every rank parses every row, so this is also the per-rank rate), and times the
`ctr` experiment's training through the real entry point. The readers must sustain at
least 3x what training consumes.

    python benchmarks/data_throughput.py [--rows 300000]
Writes benchmarks/results/DATA_THROUGHPUT.md.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

from hybridrec.config import CRITEO_KAGGLE_CAPPED  # noqa: E402
from hybridrec.data.criteo import CriteoBinary, CriteoTSV  # noqa: E402


def write_tsv(path: str, rows: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    with (gzip.open(path, "wt") if path.endswith(".gz") else open(path, "w")) as f:
        for start in range(0, rows, 50_000):
            n = min(50_000, rows - start)
            labels = rng.integers(0, 2, n)
            ints = rng.integers(-1, 1000, (n, 13)).astype(str)
            ints[rng.random((n, 13)) < 0.1] = ""  # missing values, as in the real logs
            cats = np.char.mod("%08x", rng.integers(0, 2**32, (n, 26)))
            lines = ["\t".join([str(l), *i, *c]) for l, i, c in zip(labels, ints, cats)]
            f.write("\n".join(lines) + "\n")


def rate(source, split: str) -> float:
    start, rows = time.perf_counter(), 0
    for batch in source.batches(split, 0, 1):
        rows += len(batch.labels)
    return rows / (time.perf_counter() - start)


def training_rate(steps: int = 120) -> float:
    with tempfile.TemporaryDirectory() as run:
        subprocess.run([sys.executable, "-m", "hybridrec.train", "+experiment=ctr", f"train.steps={steps}",
                        "train.log_every=20", "data.eval_batches=1", f"hydra.run.dir={run}"],
                       check=True, capture_output=True)
        rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
        rows = [r for r in rows if "elapsed_s" in r]  # step records (eval records have none)
        first, last = rows[0], rows[-1]
        return (last["step"] - first["step"]) * 2048 / (last["elapsed_s"] - first["elapsed_s"])


def reader_rates(rows: int) -> dict[str, float]:
    """Rows/s of each Criteo reader on ``rows`` generated rows, into global batches of 2048."""
    with tempfile.TemporaryDirectory() as tmp:
        plain, gz = os.path.join(tmp, "day_0.tsv"), os.path.join(tmp, "gz", "day_0.tsv.gz")
        os.makedirs(os.path.dirname(gz))
        write_tsv(plain, rows)
        write_tsv(gz, rows)
        # Only the eval split is timed; a train file of one batch satisfies the source (train
        # and eval may not share a file).
        small = os.path.join(tmp, "train", "day_1.tsv")
        os.makedirs(os.path.dirname(small))
        write_tsv(small, 2048)
        common = dict(batch_size=2048, num_embeddings_per_feature=CRITEO_KAGGLE_CAPPED, id_mapping="modulo",
                      eval_batches=None, seed=0)
        tsv = CriteoTSV(train_path=small, eval_path=plain, bad_rows="skip", block_size_mb=16, **common)
        tsv_gz = CriteoTSV(train_path=small, eval_path=gz, bad_rows="skip", block_size_mb=16, **common)
        # the same rows in TorchRec's binary layout (dense already log-transformed there)
        npy = {}
        for name, path in (("day_0", plain), ("train/day_1", small)):
            parsed = list(tsv._read_file(path, count=False))
            np.save(os.path.join(tmp, f"{name}_dense.npy"), np.concatenate([p[0] for p in parsed]))
            np.save(os.path.join(tmp, f"{name}_sparse.npy"), np.concatenate([p[1] for p in parsed]).astype(np.int64))
            np.save(os.path.join(tmp, f"{name}_labels.npy"),
                    np.concatenate([p[2] for p in parsed]).astype(np.int32).reshape(-1, 1))
            npy[name] = os.path.join(tmp, f"{name}_dense.npy")
        binary = CriteoBinary(train_path=npy["train/day_1"], eval_path=npy["day_0"], **common)
        return {"TSV": rate(tsv, "eval"), "TSV gzip": rate(tsv_gz, "eval"), "binary (npy)": rate(binary, "eval")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=300_000)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    readers = reader_rates(args.rows)
    train = training_rate()
    lines = [
        "# Data reader throughput",
        "",
        f"`python benchmarks/data_throughput.py --rows {args.rows}` on {os.cpu_count()} cores: rows/s into "
        f"global batches of 2048 (one process), beside the `ctr` experiment's training samples/s (1 rank) "
        f"measured in the same run.",
        "",
        "| reader | rows/s | x training |",
        "|---|---:|---:|",
    ]
    lines += [f"| {name} | {r:,.0f} | {r / train:.1f}x |" for name, r in readers.items()]
    lines += ["", f"Training (`ctr`, 1 rank, steady state): {train:,.0f} samples/s."]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "DATA_THROUGHPUT.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    slow = [name for name, r in readers.items() if r < 3 * train]
    if slow:
        sys.exit(f"readers below 3x training: {', '.join(slow)}")


if __name__ == "__main__":
    main()
