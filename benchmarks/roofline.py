"""The dense roofline: FLOPs per sample of a model's dense part and the machine's sgemm rate.

- FLOPs: torch.utils.flop_counter.FlopCounterMode over one forward + backward of the
  unsharded model on a real batch. It counts matrix products (the MLPs, the interaction,
  the cross layers); embedding lookups are memory-bound and have no FLOPs to count.
- sgemm rate: a float32 GEMM at the MLPs' scale (rows = the per-rank batch, 512 x 512
  weights), median over repetitions, with every core of the machine in one process: the
  most dense arithmetic the machine does per second at that size, whatever the rank split.
- Fraction of the roofline = samples/s x FLOPs per sample / sgemm rate.

    python benchmarks/roofline.py +experiment=ctr     # prints both for a config
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import warnings

import torch
from torch.utils.flop_counter import FlopCounterMode


def sgemm_gflops(rows: int = 1024, width: int = 512, reps: int = 30, threads: int | None = None) -> float:
    """Median GFLOP/s of a (rows x width) @ (width x width) float32 product on ``threads``
    intra-op threads (default: every core)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads or os.cpu_count() or 1)
    try:
        a, b = torch.randn(rows, width), torch.randn(width, width)
        for _ in range(5):  # warm the caches and MKL's thread pool
            torch.mm(a, b)
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            torch.mm(a, b)
            times.append(time.perf_counter() - t)
        return 2 * rows * width * width / statistics.median(times) / 1e9
    finally:
        torch.set_num_threads(before)


def dense_flops_per_sample(overrides: list[str], rows: int = 256) -> float:
    """Forward + backward FLOPs per sample of the dense part of the model ``overrides`` composes."""
    from common import compose_config
    from hybridrec.data import build_source, loader
    from hybridrec.models import build_model

    warnings.simplefilter("ignore", FutureWarning)
    cfg = compose_config(list(overrides) + [f"data.batch_size={rows}"])
    source = build_source(cfg.data, cfg.seed)
    model = build_model(cfg, source.features, source.num_dense_features, source.list_size)
    # The tables are built on the meta device (the planner places them): give them storage.
    # The values do not matter to a FLOP count.
    sparse = model.sparse_module().to_empty(device="cpu")
    with torch.no_grad():
        for p in sparse.parameters():
            p.normal_(0, 0.01)
    batch = next(iter(loader.batches(source, "train", 0, 1, num_batches=1)))
    with FlopCounterMode(display=False) as counter:
        loss, _ = model(batch)
        loss.backward()
    return counter.get_total_flops() / rows


if __name__ == "__main__":
    flops = dense_flops_per_sample(sys.argv[1:])
    rate = sgemm_gflops()
    print(f"dense FLOPs per sample (forward + backward): {flops / 1e6:.2f} M")
    print(f"sgemm rate, {os.cpu_count()} threads: {rate:.1f} GFLOP/s -> roofline {rate * 1e9 / flops:,.0f} samples/s")
