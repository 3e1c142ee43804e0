"""``make bench-gpu``: how well hybridrec feeds one GPU, and the experiments that run there.

    python benchmarks/bench_gpu.py [--out outputs/bench-gpu] [--budget 540] [--steps 120] [--warmup 30]
    python benchmarks/bench_gpu.py --report RESULTS.json [--to BENCH_GPU.md]   # the report of a stored run

Sections, in this order (each run is a fresh ``python -m hybridrec.train``; a section that no
longer fits in ``--budget`` seconds is skipped and named in the report):

1. ``bytes``: the synthetic log drawn on the GPU is the CPU's NumPy rows, byte for byte.
2. ``input`` at 32,768 rows per step, ``+experiment=ctr``, fp32: end to end with the batches
   drawn on the GPU (the default there, ``data.device_input``), end to end with them built on
   the host (``data.device_input=false``: an input thread and a pinned copy), the same step with
   its input taken out (``fixed_batch.py``: one batch, already on the GPU, every step) and
   TorchRec's own loop on pre-generated batches (``reference_torchrec.py``), and the draw
   replayed from a CUDA graph (``data.device_graph``); then bf16
   (``mesh.param_dtype=bfloat16``) end to end and fixed; then the same at 2,048 rows.
3. ``sources``: the same at 32,768 rows on Criteo-shaped files (``--source-rows``, written
   once into ``--out``/files): the binary layout converted on the GPU, built on the host and
   taken out; Parquet converted on the GPU, on the input thread, with 4 workers and taken out.
4. ``syncs``: host synchronizations per training step, counted in a torch.profiler trace of
   steps 21-30 (``profile.enabled``): the CUDA runtime's synchronizing calls inside each
   ``ProfilerStep``, with the operator that made each.
5. ``sequences`` (SASRec, HSTU) and ``continuous``: the experiments as they are, on the GPU:
   samples/s and their metrics (to compare with a CPU run of the same command). They read
   data/ml-100k and data/example_days (``make data-movielens data-example``): a GPU host
   without network needs them copied from a machine that made them.

Rates are steady samples/s (from step ``--warmup``); one repetition each unless ``--reps``
(repetitions alternate the settings). ``bench.py --preset gpu`` is the other GPU benchmark:
hybridrec against TorchRec's hand-written loop at 1 and at every local GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter
from typing import Any, Callable, Optional

from common import ROOT, steady_rate

HERE = os.path.dirname(os.path.abspath(__file__))
# The CUDA runtime's calls that make the host wait for the device.
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
# --device cpu: a dry run of the script on a machine without a GPU (rates mean nothing there)
DEVICE = "cuda"
CTR = ["+experiment=ctr", "data.eval_batches=1", "train.eval_every=0"]
# 300 steps, no early stopping: the same work on every card, inside the device budget
SEQUENCES = ["+experiment=sequences", "train.steps=300", "train.early_stop_patience=0"]
BF16 = ["mesh.param_dtype=bfloat16", "mesh.reduce_dtype=float32"]
GRAPH = "data.device_graph=true"  # the draw replayed from a CUDA graph


class Bench:
    def __init__(self, out: str, budget: float, steps: int, warmup: int) -> None:
        self.out, self.steps, self.warmup = out, steps, warmup
        self.deadline = time.time() + budget
        self.results: dict[str, Any] = {"runs": {}, "skipped": [], "failed": {}}
        os.makedirs(os.path.join(out, "raw"), exist_ok=True)

    def left(self) -> float:
        return self.deadline - time.time()

    def _run(self, name: str, cmd: list[str], need: float) -> Optional[str]:
        """Run ``cmd`` (its output to raw/<name>.log) if ``need`` seconds are left; the log's
        path, or None when skipped or failed (recorded)."""
        if self.left() < need:
            self.results["skipped"].append(name)
            print(f"{name:28s} SKIPPED ({self.left():.0f} s left)", flush=True)
            return None
        log = os.path.join(self.out, "raw", f"{name}.log")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
        t0 = time.time()
        try:
            with open(log, "w") as f:
                proc = subprocess.run(
                    cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT, timeout=max(10.0, self.left())
                )
            rc: Any = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        if rc != 0:
            tail = open(log).read()[-1500:]
            self.results["failed"][name] = f"rc {rc}: {tail}"
            print(f"{name:28s} FAILED ({rc}) after {time.time() - t0:.0f} s\n{tail}", flush=True)
            return None
        print(f"{name:28s} done in {time.time() - t0:.0f} s", flush=True)
        return log

    def train(self, name: str, overrides: list[str], need: float = 45, script: Optional[str] = None) -> Optional[dict]:
        run_dir = os.path.join(self.out, "raw", name)
        shutil.rmtree(run_dir, ignore_errors=True)
        head = [sys.executable, os.path.join(HERE, script)] if script else [sys.executable, "-m", "hybridrec.train"]
        if self._run(name, [*head, *overrides, f"hydra.run.dir={run_dir}"], need) is None:
            return None
        s = json.load(open(os.path.join(run_dir, "summary.json")))
        record = {
            "samples_per_second": s["train"]["samples_per_second"],
            "steady_samples_per_second": s["train"].get("steady_samples_per_second"),
            "step_time_p50_ms": s["train"]["step_time_p50_ms"],
            "eval": s.get("eval"),
            "objective": s.get("objective"),
            "peak_device_mb": [m.get("peak_device_allocated_mb") for m in s.get("memory_per_rank", [])],
            "run_dir": run_dir,
        }
        self.results["runs"][name] = record
        return record

    def rate(self, name: str, rows: int, overrides: list[str], script: Optional[str] = None) -> None:
        steps = [f"data.batch_size={rows}", f"train.steps={self.steps}", f"train.log_every={self.warmup}"]
        r = self.train(name, [*CTR, f"launcher.device={DEVICE}", *steps, *overrides], script=script)
        if r is not None:
            r["steady"] = steady_rate(r["run_dir"], rows, self.warmup)
            print(f"{'':28s} {r['steady']:>12,.0f} samples/s (steady)", flush=True)

    def torchrec(self, name: str, rows: int) -> None:
        path = os.path.join(self.out, "raw", f"{name}.json")
        cmd = [
            *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"),
            os.path.join(HERE, "reference_torchrec.py"),
            *(f"--steps={self.steps}", f"--warmup={self.warmup}", f"--out={path}", f"--device={DEVICE}"),
            "--input=pregenerated",
            f"data.batch_size={rows}",
        ]
        if self._run(name, cmd, 45) is not None:
            r = json.load(open(path))
            self.results["runs"][name] = {"steady": r["samples_per_second"], **r}
            print(f"{'':28s} {r['samples_per_second']:>12,.0f} samples/s (steady)", flush=True)


def source_overrides(folder: str, rows: int) -> tuple[list[str], list[str]]:
    """The overrides that train ``ctr``'s model on Criteo-shaped files of ``rows`` rows (random
    ids and labels: a rate, not a model) in the binary layout and as Parquet, written into
    ``folder`` once (input_scaling.py's files: a TSV day converted by hybridrec.data.convert)."""
    from input_scaling import sources

    sources(folder, rows)
    npy, pq = os.path.join(folder, "npy"), os.path.join(folder, "pq")
    binary = ["data=criteo_binary", f"data.train_path={npy}/day_0_dense.npy", f"data.eval_path={npy}/day_1_dense.npy"]
    parquet = [
        f"hydra.searchpath=[file://{os.path.abspath(pq)}/conf]",
        "data=criteo_parquet",
        f"data.train_path={pq}/day_0.parquet",
        f"data.eval_path={pq}/day_1.parquet",
    ]
    return binary, parquet


def commit() -> str:
    """The checkout's commit; the GPU kit unpacks an archive of it and names it in
    ``HYBRIDREC_COMMIT`` (no .git there)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        if out.returncode == 0:
            return out.stdout.strip()
    except OSError:
        pass
    return os.environ.get("HYBRIDREC_COMMIT", "(commit not recorded)")


def check_bytes() -> dict:
    """The ctr log's first training batch and a test batch, drawn on the GPU and by NumPy."""
    import torch

    from hybridrec.data.synthetic import SyntheticClickLog

    log = SyntheticClickLog(32768, 13, [10**6] + [10**5] * 25, 1, [], 1.05, 2, 0)
    draw = log.device_rows(torch.device(DEVICE))
    out = {}
    for split, index in (("train", 0), ("train", 7), ("eval", 1)):
        a, b = log.rows(split, index, 0, 32768), draw(split, index, 0, 32768)
        out[f"{split}/{index}"] = {
            name: bool(torch.equal(getattr(a, name), getattr(b, name).cpu())) for name in ("dense", "values", "labels")
        }
    out["draw_ms"] = draw_time(draw)
    return out


def draw_time(draw: Callable[..., Any], n: int = 20) -> dict:
    """One 32,768-row training batch drawn on the device: the host's time to issue its
    kernels and the time until the device has run them (medians of ``n``), in ms."""
    import torch

    issue, done = [], []
    for i in range(n + 3):  # the first 3: warm-up (allocator, lazy module loading)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        draw("train", 100 + i, 0, 32768)
        t1 = time.perf_counter()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        if i >= 3:
            issue.append((t1 - t0) * 1e3)
            done.append((time.perf_counter() - t0) * 1e3)
    return {"issue": statistics.median(issue), "done": statistics.median(done)}


def count_syncs(trace: str) -> dict:
    """Synchronizing CUDA runtime calls per ProfilerStep of a chrome trace, and the operators
    they came from (the innermost enclosing CPU operator on the same thread)."""
    events = json.load(open(trace))["traceEvents"]
    steps = [e for e in events if e.get("name", "").startswith("ProfilerStep#") and e.get("ph") == "X"]
    ops = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation") and e.get("ph") == "X"]
    per_step, where = [], Counter()
    for s in steps:
        lo, hi = s["ts"], s["ts"] + s["dur"]
        calls = [
            e
            for e in events
            if e.get("cat") == "cuda_runtime"
            and e.get("name") in SYNCS
            and lo <= e["ts"] <= hi
            and e["tid"] == s["tid"]
        ]
        per_step.append(len(calls))
        for c in calls:
            around = [o for o in ops if o["tid"] == c["tid"] and o["ts"] <= c["ts"] <= o["ts"] + o["dur"]]
            around.sort(key=lambda o: o["dur"])
            names = [o["name"] for o in around if not o["name"].startswith("ProfilerStep")]
            # the innermost operator, then the innermost named regions around it (TorchRec's
            # and hybridrec's record_function annotations say which part of the step it is)
            regions = [n for n in names[1:] if not n.startswith("aten::")][:3]
            where[f"{c['name']} in {' < '.join(names[:1] + regions) or '?'}"] += 1
    return {"per_step": per_step, "median": statistics.median(per_step) if per_step else None, "where": dict(where)}


def _rate(runs: dict, name: str) -> Optional[float]:
    r = runs.get(name)
    return r.get("steady") if r else None


def report(results: dict) -> str:
    """The markdown report of a run's ``bench_gpu.json``: the input table (steady samples/s,
    the step's median time, the ratios the targets name), the byte check, the synchronizations
    per step and what did not run, with the reason each run's log gave."""
    runs = results["runs"]

    def named(prefix: str) -> str:  # a repeated run's first repetition (name_r0)
        return next((k for k in runs if k.startswith(prefix)), prefix)

    lines = [
        "# hybridrec's input on one GPU (`make bench-gpu`)",
        "",
        f"{results['device']}, {results['date']}, torch {results['versions']['torch']}, Python "
        f"{results['versions']['python']}, hybridrec {results.get('commit', '(commit not recorded)')}; "
        "`+experiment=ctr`, one rank, steady samples/s from the warm-up step on (one repetition each).",
        "",
        "| rows per step | run | samples/s | step p50 ms | vs fixed batch | vs TorchRec pre-generated |",
        "|---|---|---|---|---|---|",
    ]
    settings = [
        (32768, "drawn on the GPU (`data.device_input`), fp32", "device_fp32_32768", "fixed_fp32_32768"),
        (
            32768,
            "drawn on the GPU, replayed from a CUDA graph (`data.device_graph`), fp32",
            "graph_fp32_32768",
            "fixed_fp32_32768",
        ),
        (32768, "built on the host (`data.device_input=false`), fp32", "host_fp32_32768", "fixed_fp32_32768"),
        (32768, "input taken out (`fixed_batch.py`), fp32", "fixed_fp32_32768", None),
        (32768, "TorchRec's loop on pre-generated batches, fp32", "torchrec_32768", None),
        (
            32768,
            "Criteo binary, converted on the GPU (`data.device_input`)",
            "binary_device_32768",
            "binary_fixed_32768",
        ),
        (32768, "Criteo binary, built on the host", "binary_host_32768", "binary_fixed_32768"),
        (32768, "Criteo binary, input taken out", "binary_fixed_32768", None),
        (32768, "Parquet, converted on the GPU (`data.device_input`)", "parquet_device_32768", "parquet_fixed_32768"),
        (32768, "Parquet, built on the host (input thread)", "parquet_thread_32768", "parquet_fixed_32768"),
        (32768, "Parquet, 4 workers", "parquet_workers_32768", "parquet_fixed_32768"),
        (32768, "Parquet, input taken out", "parquet_fixed_32768", None),
        (32768, "drawn on the GPU, bf16", "device_bf16_32768", "fixed_bf16_32768"),
        (32768, "input taken out, bf16", "fixed_bf16_32768", None),
        (2048, "drawn on the GPU, fp32", "device_fp32_2048", "fixed_fp32_2048"),
        (2048, "drawn on the GPU, replayed from a CUDA graph, fp32", "graph_fp32_2048", "fixed_fp32_2048"),
        (2048, "input taken out, fp32", "fixed_fp32_2048", None),
        (2048, "TorchRec's loop on pre-generated batches, fp32", "torchrec_2048", None),
    ]
    for rows, what, name, fixed in settings:
        name = named(name)
        rate = _rate(runs, name)
        if rate is None:
            continue
        ref = _rate(runs, named(f"torchrec_{rows}"))
        base = _rate(runs, named(fixed)) if fixed else None
        p50 = runs[name].get("step_time_p50_ms")
        vs_fixed = f"{rate / base:.2f}x" if base else ""
        vs_torchrec = f"{rate / ref:.2f}x" if ref and name.startswith(("device_", "graph_", "host_", "fixed_")) else ""
        if p50 is None:  # a run that reports no step time: the rate alone
            p50_cell, vs_fixed, vs_torchrec = "  ", "", ""
        else:
            p50_cell = f" {p50:.1f} "
        lines.append(f"| {rows:,} | {what} | {rate:,.0f} |{p50_cell}| {vs_fixed} | {vs_torchrec} |")
    lines.append("")
    if "bytes" in results:
        checks = {k: v for k, v in results["bytes"].items() if k != "draw_ms"}
        same = all(all(v.values()) for v in checks.values())
        lines.append(
            f"- The synthetic log drawn on the GPU against NumPy's rows ({', '.join(checks)}): dense, "
            f"ids and labels {'byte for byte the same' if same else 'DIFFERENT'}."
        )
        if "draw_ms" in results["bytes"]:
            d = results["bytes"]["draw_ms"]
            lines.append(
                f"- One 32,768-row batch drawn on the GPU: {d['issue']:.2f} ms to issue its kernels, "
                f"{d['done']:.2f} ms until they have run (medians)."
            )
    if "syncs" in results:
        sy = results["syncs"]
        where = "; ".join(f"{n} x {w}" for w, n in sy["where"].items()) or "none"
        lines.append(
            f"- Host synchronizations per training step (torch.profiler, steps 21-30, training thread): "
            f"{max(sy['per_step'] or [0])} ({where})."
        )
    for name, command in (
        ("sasrec", "sequences model=sasrec"),
        ("hstu", "sequences model=hstu"),
        ("continuous", "continuous"),
    ):
        if (r := runs.get(name)) is not None:
            metrics = r.get("eval") or {}
            shown = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if isinstance(v, float))
            lines.append(
                f"- `+experiment={command}`: {r['samples_per_second']:,.0f} samples/s; {shown or r.get('objective')}."
            )
    for name, why in results.get("failed", {}).items():
        said = [line for line in why.splitlines() if line.startswith("hybridrec:")]
        lines.append(f"- Not run: `{name}`: {said[-1] if said else why.splitlines()[-1]}")
    for name in results.get("skipped", []):
        lines.append(f"- Skipped (out of time): `{name}`.")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "outputs", "bench-gpu"))
    ap.add_argument("--budget", type=float, default=540.0, help="seconds for all sections")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--sections", default="bytes,input,sources,syncs,bf16,sequences,continuous,small")
    ap.add_argument("--source-rows", type=int, default=300_000, help="rows of the Criteo-shaped files (sources)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a dry run of the script")
    ap.add_argument("--report", help="write the markdown report of this stored bench_gpu.json, and stop")
    ap.add_argument("--to", help="with --report: the markdown file (default: beside the JSON)")
    a = ap.parse_args()
    if a.report:
        to = a.to or os.path.join(os.path.dirname(a.report), "BENCH_GPU.md")
        with open(a.report) as f, open(to, "w") as g:
            g.write(report(json.load(f)))
        print(f"bench-gpu: wrote {to}")
        return 0
    import torch

    global DEVICE
    DEVICE = a.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("bench-gpu: no CUDA device here (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    b = Bench(a.out, a.budget, a.steps, a.warmup)
    sections = a.sections.split(",")
    b.results["device"] = torch.cuda.get_device_name() if DEVICE == "cuda" else platform.processor() or "cpu"
    b.results["versions"] = {"torch": torch.__version__, "python": platform.python_version()}
    b.results["date"] = time.strftime("%Y-%m-%d")
    b.results["commit"] = commit()
    big = 32768
    plan: list[tuple[str, Callable[[], Any]]] = []
    if "bytes" in sections:
        plan.append(("bytes", lambda: b.results.__setitem__("bytes", check_bytes())))
    for rep in range(a.reps):
        if "input" in sections:
            plan += [
                (f"device_fp32_{big}_r{rep}", lambda rep=rep: b.rate(f"device_fp32_{big}_r{rep}", big, [])),
                (
                    f"graph_fp32_{big}_r{rep}",
                    lambda rep=rep: b.rate(f"graph_fp32_{big}_r{rep}", big, [GRAPH]),
                ),
                (
                    f"fixed_fp32_{big}_r{rep}",
                    lambda rep=rep: b.rate(f"fixed_fp32_{big}_r{rep}", big, [], script="fixed_batch.py"),
                ),
                (f"torchrec_{big}_r{rep}", lambda rep=rep: b.torchrec(f"torchrec_{big}_r{rep}", big)),
                (
                    f"host_fp32_{big}_r{rep}",
                    lambda rep=rep: b.rate(f"host_fp32_{big}_r{rep}", big, ["data.device_input=false"]),
                ),
            ]
    if "sources" in sections:  # Criteo's binary layout and Parquet, files written here once
        binary, parquet = source_overrides(os.path.join(a.out, "files"), a.source_rows)
        for name, over, script in (
            (f"binary_device_{big}", [*binary, "data.device_input=true"], None),
            (f"binary_host_{big}", [*binary, "data.device_input=false"], None),
            (f"binary_fixed_{big}", binary, "fixed_batch.py"),
            (f"parquet_device_{big}", [*parquet, "data.device_input=true"], None),
            (f"parquet_thread_{big}", [*parquet, "data.device_input=false"], None),
            (f"parquet_workers_{big}", [*parquet, "data.num_workers=4"], None),
            (f"parquet_fixed_{big}", parquet, "fixed_batch.py"),
        ):
            plan.append((name, lambda n=name, o=over, sc=script: b.rate(n, big, o, script=sc)))
    if "syncs" in sections:

        def syncs() -> None:
            over = ["profile.enabled=true", "profile.start_step=20", "profile.steps=10", "train.log_every=1000"]
            r = b.train("syncs", [*CTR, f"launcher.device={DEVICE}", f"data.batch_size={big}", "train.steps=40", *over])
            if r is not None:
                b.results["syncs"] = count_syncs(os.path.join(r["run_dir"], "profile", "trace_rank0.json"))
                print(f"{'':28s} syncs per step {b.results['syncs']['per_step']}", flush=True)

        plan.append(("syncs", syncs))
    if "bf16" in sections:
        plan += [
            ("device_bf16", lambda: b.rate(f"device_bf16_{big}", big, BF16)),
            ("fixed_bf16", lambda: b.rate(f"fixed_bf16_{big}", big, BF16, script="fixed_batch.py")),
        ]
    if "sequences" in sections:
        for model in ("sasrec", "hstu"):
            plan.append(
                (
                    model,
                    lambda m=model: b.train(m, [*SEQUENCES, f"model={m}", f"launcher.device={DEVICE}"]),
                )
            )
    if "continuous" in sections:
        plan.append(
            ("continuous", lambda: b.train("continuous", ["+experiment=continuous", f"launcher.device={DEVICE}"]))
        )
    if "small" in sections:
        plan += [
            ("device_fp32_2048", lambda: b.rate("device_fp32_2048", 2048, [])),
            ("graph_fp32_2048", lambda: b.rate("graph_fp32_2048", 2048, [GRAPH])),
            ("fixed_fp32_2048", lambda: b.rate("fixed_fp32_2048", 2048, [], script="fixed_batch.py")),
            ("torchrec_2048", lambda: b.torchrec("torchrec_2048", 2048)),
        ]
    if DEVICE == "cpu":  # a CUDA graph of the draw needs a GPU (refused on CPU ranks)
        plan = [(name, job) for name, job in plan if not name.startswith("graph_")]
    for name, job in plan:
        try:
            job()
        except Exception as e:  # one broken section must not hide the others' numbers
            b.results["failed"][name] = repr(e)[-1500:]
            print(f"{name:28s} FAILED: {e!r}", flush=True)
        with open(os.path.join(a.out, "bench_gpu.json"), "w") as f:
            json.dump(b.results, f, indent=1, default=str)
        with open(os.path.join(a.out, "BENCH_GPU.md"), "w") as f:
            f.write(report(b.results))
    print(json.dumps({k: v for k, v in b.results.items() if k != "runs"}, indent=1, default=str))
    for name, r in b.results["runs"].items():
        print(f"{name:28s} steady {r.get('steady') or 0:>12,.0f}  all {r.get('samples_per_second') or 0:>12,.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
