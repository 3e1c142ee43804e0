"""What a run measures of itself: peak memory, step-time percentiles, and the analysis of
a torch.profiler trace (the share of time in collectives, the per-step breakdown)."""

from __future__ import annotations

import math
import resource
from typing import Any, Optional, TypedDict

import numpy as np
import torch


def peak_rss_mb() -> float:
    """This process's peak resident memory (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_device_mb(device: torch.device) -> dict[str, float]:
    """This process's peak GPU memory (what the planner's device estimate is compared to):
    torch's caching allocator, allocated (tensors) and reserved (held from the driver). Empty
    on CPU, where peak_rss_mb is the measure."""
    if device.type != "cuda":
        return {}
    return {
        "peak_device_allocated_mb": round(torch.cuda.max_memory_allocated(device) / 2**20, 1),
        "peak_device_reserved_mb": round(torch.cuda.max_memory_reserved(device) / 2**20, 1),
    }


class StepTimes(TypedDict, total=False):
    """``percentiles_ms``: the step-time keys of summary.json's ``train`` block (both absent
    when no step ran)."""

    step_time_p50_ms: float
    step_time_p95_ms: float


def percentiles_ms(seconds: list[float]) -> StepTimes:
    if not seconds:
        return {}
    ms = np.array(seconds) * 1000
    return {"step_time_p50_ms": float(np.percentile(ms, 50)), "step_time_p95_ms": float(np.percentile(ms, 95))}


_COMM_KINDS = {  # collective -> what it is for, in a sparse + FSDP2 job
    "all_to_all": "embedding all-to-all",
    "alltoall": "embedding all-to-all",
    "all_gather": "FSDP2 all-gather",
    "allgather": "FSDP2 all-gather",
    "reduce_scatter": "FSDP2 reduce-scatter",
    "reducescatter": "FSDP2 reduce-scatter",
    "all_reduce": "all-reduce (gradients, metrics)",
    "allreduce": "all-reduce (gradients, metrics)",
    "broadcast": "broadcast",
    # NCCL runs an all-to-all as grouped send/recv: its kernel is ncclDevKernel_SendRecv.
    "sendrecv": "embedding all-to-all",
}


def _collective(name: str) -> bool:
    """A collective's own work: gloo's events, or NCCL's device kernels (ncclDevKernel_*,
    ncclKernel_*). ProcessGroupNCCL's host-side ``nccl:...`` records only time the launch."""
    return name.startswith("gloo:") or (name.startswith("nccl") and not name.startswith("nccl:"))


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


class CommSplit(TypedDict):
    """``comm_compute_split``: a rank's profile (``hybridrec.reports.summary.Profile``, where
    each key is described) less its rank and step breakdown."""

    profiled_steps: int
    profiled_ms: float
    comm_ms: float
    compute_ms: float
    comm_share: float
    comm_ms_by_kind: dict[str, float]


def comm_compute_split(events: Any) -> CommSplit:
    """Share of the profiled steps' wall time during which a collective was running.

    Window = the union of the ProfilerStep spans. Communication = the union of the backend's
    own collective events (``gloo:...`` work, or NCCL's kernels on GPU) inside it, in total
    and per kind; compute = the rest of the window. Comm that overlaps compute (TorchRec's
    pipeline does this) counts as comm: this is how busy the network was, an upper bound on
    the time it cost.
    """
    steps = [(e.time_range.start, e.time_range.end) for e in events if e.name.startswith("ProfilerStep")]
    lo, hi = min(a for a, _ in steps), max(b for _, b in steps)
    window = _union_us(steps)
    by_kind: dict[str, list[tuple[float, float]]] = {}
    for e in events:
        name = e.name.lower()
        if not _collective(name):
            continue
        kind = next((v for k, v in _COMM_KINDS.items() if k in name.replace(" ", "_")), "other collectives")
        a, b = max(e.time_range.start, lo), min(e.time_range.end, hi)
        if b > a:
            by_kind.setdefault(kind, []).append((a, b))
    comm = _union_us([iv for ivs in by_kind.values() for iv in ivs])
    return {
        "profiled_steps": len(steps),
        "profiled_ms": window / 1000,
        "comm_ms": comm / 1000,
        "compute_ms": (window - comm) / 1000,
        "comm_share": comm / window if window else 0.0,
        "comm_ms_by_kind": {k: _union_us(v) / 1000 for k, v in sorted(by_kind.items())},
    }


# Per-step phases of the host's main thread, innermost match wins (TorchRec's pipelines and
# sharded modules, FSDP2 and c10d label their work with record_function; the names are theirs).
# Anything inside a phase without a label of its own (aten ops) belongs to that phase.
BREAKDOWN_PHASES = (
    "input",
    "embedding lookup + all-to-all",
    "dense forward + backward",
    "dense collective",
    "optimizer",
    "other",
)
_PHASE_LABELS = (
    ("input", ("## next_batch", "## load_batch", "copy_batch_to_gpu", "## wait_for_batch")),
    (
        "embedding lookup + all-to-all",
        (
            "sparse_data_dist",
            "kjtlistawaitable",
            "[lookup]",
            "[output_dist",
            "embeddingbagcollectionawaitable",
            "all2all",
            "splitlookupfunction",
            "fbgemm::",
            "dmp_collection_sync",
            "alltoall",
        ),
    ),
    (
        "dense collective",
        (
            "fsdp::all_gather",
            "fsdp::post_backward_reduce",
            "fsdp::reduce_scatter",
            "c10d::allreduce",
            "c10d::_allgather_base",
            "c10d::allgather",
            "c10d::_reduce_scatter_base",
            "c10d::reduce_scatter",
        ),
    ),
    ("optimizer", ("## optimizer",)),
    ("dense forward + backward", ("## forward", "## backward", "## zero_grad")),
)
# A collective running on the backend's own thread while the main thread sits in a phase
# with no op of its own (a wait: DDP's reducer, an awaitable) is charged to that collective.
_WAIT_KINDS = (("all_to_all", "embedding lookup + all-to-all"), ("alltoall", "embedding lookup + all-to-all"))


def _phase(name: str) -> Optional[str]:
    name = name.lower()
    return next((phase for phase, labels in _PHASE_LABELS if any(s in name for s in labels)), None)


def step_breakdown(events: Any) -> dict[str, float]:
    """Milliseconds per profiled step in each of BREAKDOWN_PHASES, summing to the step time.

    Host wall time of the thread that runs the steps. Each instant goes to the innermost
    labelled event around it (see _PHASE_LABELS), so the embedding lookup inside the model's
    forward counts as embedding, not as dense forward. The sparse optimizer is fused into the
    embedding backward (fbgemm) and counts there; "optimizer" is the dense optimizer. Time in
    a phase with no op running (the thread waiting) while a collective runs on the backend's
    thread is charged to that collective: embedding for all-to-all, dense collective for the
    rest. "other" is the remainder: Python, logging, the loss's all-reduce.
    """
    steps = [e for e in events if e.name.startswith("ProfilerStep")]
    if not steps:
        return {}
    main = steps[0].thread
    windows = sorted((e.time_range.start, e.time_range.end) for e in steps)
    lo, hi = windows[0][0], windows[-1][1]
    ops = sorted(
        (
            (e.time_range.start, e.time_range.end, _phase(e.name))
            for e in events
            if e.thread == main
            and not e.name.startswith("ProfilerStep")
            and e.time_range.end > lo
            and e.time_range.start < hi
        ),
        key=lambda x: (x[0], -x[1]),
    )
    # Sweep: segments (start, end, phase, idle); idle = the thread is in no op, or only in a
    # phase's own span with no child op open (waiting, not computing).
    segments: list[tuple[float, float, str, bool]] = []
    stack: list[tuple[float, Optional[str]]] = []  # open ops: (end, phase or None = inherit)
    cursor = lo

    def advance(to: float) -> None:
        nonlocal cursor
        while cursor < to:
            while stack and stack[-1][0] <= cursor:
                stack.pop()
            end = min(to, stack[-1][0]) if stack else to
            phase = next((p for _, p in reversed(stack) if p), "other")
            idle = not stack or stack[-1][1] in ("dense forward + backward", "optimizer")
            segments.append((cursor, end, phase, idle))
            cursor = end

    for start, end, phase in ops:
        advance(max(start, lo))
        stack.append((min(end, hi), phase))
    advance(hi)
    # Collectives on the backend's threads (gloo work, NCCL kernels), as disjoint intervals.
    comm: list[tuple[float, float, str]] = []
    reach = -math.inf
    for s, e, name in sorted(
        (e.time_range.start, e.time_range.end, e.name.lower())
        for e in events
        if e.thread != main and e.name.lower().startswith(("gloo:", "nccl"))
    ):
        if e > max(s, reach):
            comm.append((max(s, reach), e, next((p for k, p in _WAIT_KINDS if k in name), "dense collective")))
            reach = e
    totals = dict.fromkeys(BREAKDOWN_PHASES, 0.0)
    for a, b, phase, idle in segments:
        for wa, wb in windows:  # only time inside the profiled steps
            sa, sb = max(a, wa), min(b, wb)
            if sb <= sa:
                continue
            waited = 0.0
            if idle:
                for ca, cb, kind in comm:
                    if (ob := min(sb, cb) - max(sa, ca)) > 0:
                        totals[kind] += ob
                        waited += ob
            totals[phase] += sb - sa - waited
    return {p: round(v / 1000 / len(steps), 3) for p, v in totals.items()}
