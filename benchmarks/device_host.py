"""What a GPU rank's host still does per batch when a source converts its rows on the device
(``data.device_input``): the CPU reader's ``read`` (decode and convert) against the device
path's host part (decode and hand over: ``ParquetOnDevice.host_part``, ``CriteoBinary.stored``)
plus its one copy into a reused staging buffer (pinned, on a GPU), for each file source with a
device path, at 32,768 rows per batch, on one thread.

Each repetition reads a whole pass of the training batches per mode, the modes alternating (in
reversed order every other repetition), so both decode each row group once per pass; reported:
the median time per batch over every batch of every repetition, and the host part's share.

    python benchmarks/device_host.py [--reps 5] [--batch 32768]

Writes benchmarks/results/DEVICE_HOST.md and device_host.json (``--out``). Uses the input
benchmark's files (Criteo-shaped rows written once, as the binary layout and as Parquet) and the
example feature log when ``make data-example`` has written it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any, Callable

import numpy as np
import torch

from common import machine, write_markdown
from input_rates import _makers

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = ("Criteo binary", "Parquet (the binary rows)", "example feature log (Parquet, multi-hot)")


def _host_part(source: Any, batch: int) -> Callable[[int], None]:
    """The device path's host work for batch ``i``: what it hands over, copied once into a
    reused buffer (the staging copy)."""
    buffer = np.empty(0, np.uint8)

    def stage(arrays: list[np.ndarray]) -> None:
        nonlocal buffer
        size = sum(a.nbytes for a in arrays)
        if buffer.nbytes < size:
            buffer = np.empty(size, np.uint8)
        at = 0
        for a in arrays:
            buffer[at : at + a.nbytes].view(a.dtype).reshape(a.shape)[...] = a
            at += a.nbytes

    if hasattr(source, "stored"):  # Criteo's binary layout: the rows as the files store them
        return lambda i: stage(list(source.stored("train", i, 0, batch)[1:]))
    reader = source.device_rows(torch.device("cpu"))

    def parquet(i: int) -> None:
        handed = reader.host_part("train", i, 0, batch)
        assert handed is not None, "a bad row: this batch is read by read()"
        stage(list(handed[0].values()))

    return parquet


def measure(reps: int, batch: int, data: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    makers = _makers(data)
    out: dict[str, Any] = {}
    for name in SOURCES:
        if name not in makers:
            print(f"{name}: its files are not there, skipped", flush=True)
            continue
        source = makers[name](batch)
        source.begin_pass("train", 0)
        n = source.num_batches("train")
        modes = {"read": lambda i, s=source: s.read("train", 0, i, 0, batch), "host part": _host_part(source, batch)}
        times: dict[str, list[float]] = {m: [] for m in modes}
        for rep in range(reps):
            for mode in list(modes)[:: 1 if rep % 2 == 0 else -1]:
                for i in range(n):
                    t = time.perf_counter()
                    modes[mode](i)
                    times[mode].append(time.perf_counter() - t)
        read, host = (statistics.median(times[m]) * 1e3 for m in ("read", "host part"))
        out[name] = {"batches": n, "read_ms": read, "host_part_ms": host, "share": host / read}
        print(f"{name:45s} read {read:7.1f} ms  host part {host:7.1f} ms  share {host / read:.2f}", flush=True)
    return out


def table(res: dict[str, Any]) -> list[str]:
    m = res["machine"]
    lines = [
        "# The host's part of a batch converted on the device",
        "",
        f"`python benchmarks/device_host.py --reps {res['reps']} --batch {res['batch']}` on {m.get('cpu', 'this CPU')}, "
        f"torch {m.get('torch', '')}, one thread. Per training batch of {res['batch']:,} rows: the CPU reader's `read` "
        "(decode and convert) against the device path's host part (decode, hand over the stored values, one copy "
        "into a reused buffer); the rest of the conversion runs on the device. Median ms per batch over every batch "
        "of every repetition.",
        "",
        "| source | batches per pass | read ms | host part ms | host part / read |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in res["sources"].items():
        lines.append(f"| {name} | {r['batches']} | {r['read_ms']:.1f} | {r['host_part_ms']:.1f} | {r['share']:.2f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=32768)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as data:
        res = {"machine": machine(), "reps": a.reps, "batch": a.batch, "sources": measure(a.reps, a.batch, data)}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "device_host.json"), "w") as f:
        json.dump(res, f, indent=1)
    write_markdown(os.path.join(a.out, "DEVICE_HOST.md"), table(res), "device host part")


if __name__ == "__main__":
    main()
