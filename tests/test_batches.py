"""Every source's batches, byte for byte, as recorded in ``tests/golden/batches.json``: the way
a batch is built (arrays, shared-memory workers, the KeyedJaggedTensor's construction) may
change, its content may not. At 1 and 2 ranks, every split, inline and with worker processes,
and on each of the instruction sets NumPy dispatches its kernels to on this CPU: the same
seed and files give the same batches on every machine."""

import json
import os
import subprocess
import sys

import pytest

from batch_sources import GOLDEN, SOURCES, digests

with open(GOLDEN) as f:
    RECORDED = json.load(f)


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(SOURCES))
def test_a_sources_batches_are_the_recorded_ones(name):
    assert digests(name) == RECORDED[name]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SOURCES))
def test_worker_processes_build_the_recorded_batches(name):
    assert digests(name, workers=2) == RECORDED[name]


def _dispatched() -> list[str]:
    """The instruction-set targets NumPy dispatches to on this CPU, above its baseline."""
    from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__

    return [t for t in __cpu_dispatch__ if __cpu_features__.get(t)]


# Each a set of NumPy's dispatch targets to turn off (NPY_DISABLE_CPU_FEATURES): its AVX-512
# kernels, then every kernel above the baseline (AVX2 and FMA3 on x86-64).
LEVELS = {
    "without AVX-512": lambda ts: [t for t in ts if "512" in t or t == "X86_V4"],
    "the baseline kernels only": lambda ts: ts,
}


@pytest.mark.slow
@pytest.mark.parametrize("level", sorted(LEVELS))
def test_numpys_kernels_for_other_cpus_build_the_recorded_batches(level):
    """NumPy picks its exp, log, power and cos kernels at run time by the CPU's instruction
    sets, and they differ by a few ulps: here they are turned off as on a CPU without them,
    and every source must still give the recorded bytes (a CPU with AVX-512 once drew other
    synthetic ids than one without)."""
    off = LEVELS[level](_dispatched())
    if not off:
        pytest.skip(f"this CPU has no NumPy kernels to turn off for {level} ({_dispatched() or 'none dispatched'})")
    code = (
        "import json, sys; sys.path.insert(0, 'tests');"
        "from numpy._core._multiarray_umath import __cpu_features__ as f;"
        "from batch_sources import SOURCES, digests;"
        "print(json.dumps({'on': [t for t in %r if f.get(t)], 'digests': {n: digests(n) for n in SOURCES}}))" % off
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        env={**os.environ, "NPY_DISABLE_CPU_FEATURES": " ".join(off)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["on"] == []  # the kernels really were off
    assert out["digests"] == RECORDED
