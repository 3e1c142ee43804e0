"""What several benchmark scripts share: the machine description their results files name,
writing a results file, running a command with its output to a log, hybridrec's steady-state
rate, alternating repetitions of two or more settings, a composed config, and the names the
suite gives its configurations.

Scripts import it by name (``from common import machine``): ``python benchmarks/<script>.py``
puts benchmarks/ first on the import path, and ``hybridrec`` comes from the environment
(``pip install -e .``). torch and Hydra are imported inside the functions that need them:
importing common costs a script nothing it does not use.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Any, Iterator, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONF = os.path.join(ROOT, "hybridrec", "conf")

# ------------------------------------------------------------------------------ naming
SHARDINGS = ["auto", "table_wise", "row_wise", "column_wise", "table_row_wise"]


def ranks_label(world: int) -> str:
    """``1 rank``, ``2 ranks``."""
    return f"{world} rank{'s' if world > 1 else ''}"


# The two hand-written TorchRec loops of the bench (benchmarks/reference_torchrec.py --input):
# "reference" builds the same batches hybridrec reads, on the training thread, as hybridrec
# does; "pregenerated" cycles batches TorchRec's RandomRecDataset made before the clock
# started, as TorchRec's own examples do, so it pays no input cost at all.
REFERENCE_KINDS = {"reference": "hybridrec", "pregenerated": "pregenerated"}


def config_key(r: dict) -> tuple:
    """A run's configuration: the repetitions of one configuration share it."""
    return (r["kind"], r["world_size"], r["sharding"], r["dense"], r["pipeline"])


def config_name(key: tuple) -> str:
    """How the console and the report name a configuration (``config_key``)."""
    kind, world, sharding, dense, pipeline = key
    if kind == "reference":
        return f"{ranks_label(world)} · TorchRec reference (planner, DDP, sparse_dist)"
    if kind == "pregenerated":
        return f"{ranks_label(world)} · TorchRec reference, pre-generated batches (RandomRecDataset)"
    return f"{ranks_label(world)} · {sharding} · {dense} · {pipeline}"


# ------------------------------------------------------------------------------ running
def run_logged(cmd: list[str], log: str) -> None:
    """Run a command from the repository root, its output to ``log``; a failure raises with
    the log's tail."""
    # The repository's hybridrec, also for a command that is not `python -m` from ROOT.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    if proc.returncode in (128 + signal.SIGINT, -signal.SIGINT):
        # Ctrl-C reached the command (its process group) and ended it: the user's stop, not a failure
        raise KeyboardInterrupt
    if proc.returncode:
        tail = open(log).read()[-4000:]
        raise RuntimeError(f"failed ({proc.returncode}): {' '.join(cmd)}\n--- {log}\n{tail}")


def steady_rate(run_dir: str, global_batch: int, warmup: int) -> float:
    """samples/s from the end of step ``warmup`` to the last step (metrics.jsonl)."""
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    rows = [r for r in rows if "elapsed_s" in r]  # step records (eval records have none)
    first, last = rows[0], rows[-1]
    if first["step"] != warmup:
        raise RuntimeError(f"{run_dir}: first log record at step {first['step']}, expected {warmup}")
    return (last["step"] - first["step"]) * global_batch / (last["elapsed_s"] - first["elapsed_s"])


def train_summary(overrides: list[str], out: str, env: Optional[dict[str, str]] = None) -> dict:
    """``python -m hybridrec.train <overrides>``'s summary.json, the run written to ``out``
    (``env``: the process's whole environment; None: this one's)."""
    subprocess.run(
        [sys.executable, "-m", "hybridrec.train", *overrides, f"hydra.run.dir={out}"],
        check=True,
        capture_output=True,
        cwd=ROOT,
        env=env,
    )
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


def _train(overrides: list[str], out: str) -> dict:
    """``python -m hybridrec.train``'s summary.json ``train`` block."""
    return train_summary(overrides, out)["train"]


def _spin() -> None:
    while True:
        pass


@contextlib.contextmanager
def busy_machine(busy: bool) -> Iterator[None]:
    """With ``busy``, one other process spins on a core for the duration (the machine a user
    shares with other work); without, nothing."""
    hog = multiprocessing.Process(target=_spin, daemon=True) if busy else None
    if hog:
        hog.start()
    try:
        yield
    finally:
        if hog:
            hog.terminate()


def measure_alternating(base: list[str], reps: int, busy: bool, settings: dict[str, str]) -> dict[str, list[dict]]:
    """Each setting's summary.json ``train`` block per repetition of ``python -m
    hybridrec.train <base> <setting>``, the settings alternating (a, b, a, b, ...): drift hits
    them alike. ``settings``: name -> override. ``busy``: one other process spins meanwhile."""
    results: dict[str, list[dict]] = {k: [] for k in settings}
    with busy_machine(busy), tempfile.TemporaryDirectory() as tmp:
        for rep in range(reps):
            for name, override in settings.items():
                out = os.path.join(tmp, f"{name}-{rep}".replace(" ", "_"))
                results[name].append(_train([*base, override], out))
    return results


def compose_config(overrides: list[str] = ()) -> Any:
    """The config ``python -m hybridrec.train <overrides>`` would see.

    Hydra is initialized once per process and kept, not as a context manager: later calls
    reuse its parsed YAML."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from hybridrec.config import register_configs

    register_configs()
    if not GlobalHydra.instance().is_initialized():
        initialize_config_dir(config_dir=os.path.abspath(CONF), version_base="1.3")
    return compose(config_name="config", overrides=list(overrides))


# ------------------------------------------------------------------------------ results
def write_markdown(path: str, lines: list[str], label: str) -> None:
    """A results file from its lines, echoed to the console with where it went."""
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"{label}: {path}")


class LoadAverage:
    """The machine's 1-minute load average, sampled every 10 s while a measurement runs: what
    else ran beside it, which every time and throughput depends on."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(10):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> "LoadAverage":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def machine() -> dict[str, Any]:
    """The CPU, GPUs and library versions a result was measured with."""
    import fbgemm_gpu
    import hydra
    import torch
    import torchrec

    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass  # not Linux: platform.processor() stays
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "cuda": torch.version.cuda,
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
