"""Evaluation metrics (TorchRec's formulas), step timing, peak memory, the profiler's comm/compute split and
step breakdown, and the run's output files: metrics.jsonl, report.png, TensorBoard events (summary.json's
schema, built from these numbers, is hybridrec.summary)."""

from __future__ import annotations

import json
import math
import os
import resource
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
from torchrec.metrics.accuracy import compute_accuracy, get_accuracy_states
from torchrec.metrics.auc import compute_auc
from torchrec.metrics.calibration import compute_calibration
from torchrec.metrics.ctr import compute_ctr
from torchrec.metrics.ne import compute_cross_entropy, compute_logloss, compute_ne

_ETA = 1e-12  # TorchRec's clamp for probabilities in NE


def binary_metrics(probs: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """AUC, NE, log loss, calibration, CTR and accuracy of click probabilities, with
    TorchRec's metric functions (torchrec.metrics), over the whole eval set.

    Called on the predictions gathered from every rank, so the result does not depend on
    the world size: AUC needs every prediction (a sort), the others are sums.
    """
    probs, labels = probs.double().view(1, -1), labels.double().view(1, -1)
    weights = torch.ones_like(labels)
    ce_sum = compute_cross_entropy(labels, probs, weights, _ETA).sum()
    pos, neg = labels.sum(), (1 - labels).sum()
    accuracy = get_accuracy_states(labels, probs, weights, threshold=0.5)
    return {
        "auc": float(compute_auc(1, [probs], [labels], [weights])[0]),
        "ne": float(compute_ne(ce_sum, weights.sum(), pos, neg, _ETA)),
        # TorchRec's cross entropy is in bits; log loss is conventionally in nats.
        "logloss": float(compute_logloss(ce_sum, pos, neg, _ETA)) * math.log(2),
        # predicted clicks / actual clicks: 1.0 is calibrated
        "calibration": float(compute_calibration(probs.sum(), (labels * weights).sum())),
        "ctr": float(compute_ctr(pos, weights.sum())),
        "accuracy": float(compute_accuracy(accuracy["accuracy_sum"], accuracy["weighted_num_samples"])),
        "n": int(labels.numel()),
    }


def ranking_metrics(scores: np.ndarray, relevance: np.ndarray, query: np.ndarray, threshold: float,
                    k: int) -> dict[str, float]:
    """Per-query NDCG@k (gains 2^rel - 1), MAP and recall@k (relevant: relevance >=
    threshold), averaged over queries. A query without any relevant row has no recall or
    average precision, one with zero ideal DCG no NDCG: they are left out of those means and
    the counts say how many queries each mean covers. Ties in score keep row order.
    (torchrec.metrics has NDCG only for its windowed, per-session RecMetric, not over a
    gathered eval set, hence this.)"""
    order = np.lexsort((-scores, query))  # by query, then score descending (stable)
    q, rel = query[order], relevance[order].astype(np.float64)
    starts = np.flatnonzero(np.r_[True, q[1:] != q[:-1]])
    pos = np.arange(len(q)) - np.repeat(starts, np.diff(np.r_[starts, len(q)]))  # 0-based rank in query
    top = pos < k
    discount = 1.0 / np.log2(pos + 2.0)
    dcg = np.add.reduceat(np.where(top, (2.0**rel - 1) * discount, 0.0), starts)
    ideal_order = np.lexsort((-relevance, query))
    ideal_rel = relevance[ideal_order].astype(np.float64)
    idcg = np.add.reduceat(np.where(top, (2.0**ideal_rel - 1) * discount, 0.0), starts)
    hit = (rel >= threshold).astype(np.float64)
    n_rel = np.add.reduceat(hit, starts)
    hits_at_k = np.add.reduceat(hit * top, starts)
    hits_so_far = np.cumsum(hit) - np.repeat(np.r_[0.0, np.cumsum(hit)[starts[1:] - 1]], np.diff(np.r_[starts, len(q)]))
    ap = np.add.reduceat(hit * hits_so_far / (pos + 1.0), starts)
    has_rel, has_gain = n_rel > 0, idcg > 0
    return {
        f"ndcg@{k}": float(np.mean(dcg[has_gain] / idcg[has_gain])) if has_gain.any() else float("nan"),
        "map": float(np.mean(ap[has_rel] / n_rel[has_rel])) if has_rel.any() else float("nan"),
        f"recall@{k}": float(np.mean(hits_at_k[has_rel] / n_rel[has_rel])) if has_rel.any() else float("nan"),
        "queries": int(len(starts)),
        "queries_with_relevant": int(has_rel.sum()),
    }


def gather_to_first(t: torch.Tensor) -> Optional[torch.Tensor]:
    """Every rank's 1-D ``t`` (lengths may differ), concatenated in rank order on rank 0;
    None on the other ranks. Collective.

    An all-gather would hold the whole eval set on every rank, N times what rank 0 needs;
    here a rank holds only its own part, and rank 0 the whole (what AUC, a sort, needs).
    ``dist.gather`` takes equal shapes, hence the padding to the longest part."""
    world = dist.get_world_size()
    size = torch.tensor([t.numel()], dtype=torch.int64, device=t.device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)  # N integers: every rank needs the longest for its padding
    lengths = [int(s) for s in sizes]
    padded = torch.cat([t, t.new_zeros(max(lengths) - t.numel())])
    if dist.get_rank() != 0:
        dist.gather(padded, None, dst=0)
        return None
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.gather(padded, parts, dst=0)
    return torch.cat([part[:n] for part, n in zip(parts, lengths)])


def peak_rss_mb() -> float:
    """This process's peak resident memory (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_device_mb(device: torch.device) -> dict[str, float]:
    """This process's peak GPU memory (what the planner's device estimate is compared to):
    torch's caching allocator, allocated (tensors) and reserved (held from the driver). Empty
    on CPU, where peak_rss_mb is the measure."""
    if device.type != "cuda":
        return {}
    return {"peak_device_allocated_mb": round(torch.cuda.max_memory_allocated(device) / 2**20, 1),
            "peak_device_reserved_mb": round(torch.cuda.max_memory_reserved(device) / 2**20, 1)}


def percentiles_ms(seconds: list[float]) -> dict[str, float]:
    if not seconds:
        return {}
    ms = np.array(seconds) * 1000
    return {"step_time_p50_ms": float(np.percentile(ms, 50)), "step_time_p95_ms": float(np.percentile(ms, 95))}


# ------------------------------------------------------------------------------ profiling
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


def comm_compute_split(events: Any) -> dict[str, Any]:
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
BREAKDOWN_PHASES = ("input", "embedding lookup + all-to-all", "dense forward + backward",
                    "dense collective", "optimizer", "other")
_PHASE_LABELS = (
    ("input", ("## next_batch", "## load_batch", "copy_batch_to_gpu", "## wait_for_batch")),
    ("embedding lookup + all-to-all", (
        "sparse_data_dist", "kjtlistawaitable", "[lookup]", "[output_dist", "embeddingbagcollectionawaitable",
        "all2all", "splitlookupfunction", "fbgemm::", "dmp_collection_sync", "alltoall")),
    ("dense collective", ("fsdp::all_gather", "fsdp::post_backward_reduce", "fsdp::reduce_scatter",
                          "c10d::allreduce", "c10d::_allgather_base", "c10d::allgather",
                          "c10d::_reduce_scatter_base", "c10d::reduce_scatter")),
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
    ops = sorted(((e.time_range.start, e.time_range.end, _phase(e.name)) for e in events
                  if e.thread == main and not e.name.startswith("ProfilerStep")
                  and e.time_range.end > lo and e.time_range.start < hi), key=lambda x: (x[0], -x[1]))
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
    for s, e, name in sorted((e.time_range.start, e.time_range.end, e.name.lower()) for e in events
                             if e.thread != main and e.name.lower().startswith(("gloo:", "nccl"))):
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


# ------------------------------------------------------------------------------ files
def write_json(path: str, obj: Any) -> None:
    """Write through a temporary file and rename, so a reader never sees half a file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, path)


class MetricsLog:
    """``metrics.jsonl``: one JSON object per logged step and per eval, for scripts; the same
    scalars as TensorBoard events when ``tensorboard_dir`` is given. Rank 0 only."""

    def __init__(self, path: Optional[str], tensorboard_dir: Optional[str] = None) -> None:
        self._f = open(path, "a") if path else None
        self._tb = None
        if path and tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter  # optional dependency

            self._tb = SummaryWriter(tensorboard_dir)
        self.records: list[dict[str, Any]] = []

    def log(self, **record: Any) -> None:
        if not self._f:
            return
        self.records.append(record)
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()
        if self._tb:
            for key, value in _flatten(record).items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        if self._f:
            self._f.close()
        if self._tb:
            self._tb.close()


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = v
    return out


def plot_report(records: list[dict[str, Any]], path: str) -> None:
    """report.png: training loss, eval AUC and NE, and samples/s over steps."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    train = [r for r in records if "loss" in r]
    # The curve is the split evaluated during training (validation when there is one); the
    # test split, scored once at the end, is its own marker.
    splits = {r.get("split", "eval") for r in records if "eval" in r}
    curve = "valid" if "valid" in splits else "eval"
    evals = [r for r in records if "eval" in r and r.get("split", "eval") == curve]
    test = [r for r in records if "eval" in r and r.get("split", "eval") == "eval"] if curve == "valid" else []
    fig, (ax_loss, ax_eval, ax_rate) = plt.subplots(1, 3, figsize=(15, 4))
    ax_loss.plot([r["step"] for r in train], [r["loss_mean"] for r in train], color="tab:blue")
    ax_loss.set(title="training loss (global, mean per log window)", xlabel="step", ylabel="loss")
    if evals:
        steps = [r["step"] for r in evals]
        ax_eval.plot(steps, [r["eval"]["auc"] for r in evals], "o-", color="tab:green", label=f"{curve} AUC")
        for r in test:
            ax_eval.plot([r["step"]], [r["eval"]["auc"]], "*", markersize=12, color="black", label="test AUC")
        ax_eval.set(title="validation" if curve == "valid" else "eval", xlabel="step", ylabel="AUC")
        ax_ne = ax_eval.twinx()
        if "ne" in evals[0]["eval"]:  # calibrated (BCE) runs
            ax_ne.plot(steps, [r["eval"]["ne"] for r in evals], "s--", color="tab:red", label="NE")
            ax_ne.set_ylabel("NE (lower is better)")
        ndcg = next((k for k in evals[0]["eval"] if k.startswith("ndcg")), None)
        if ndcg:  # ranking sources
            ax_eval.plot(steps, [r["eval"][ndcg] for r in evals], "^-", color="tab:purple", label=ndcg.upper())
            ax_eval.set_ylabel("AUC / NDCG")
        ax_eval.legend(handles=ax_eval.lines + ax_ne.lines, loc="center right")
    ax_rate.plot([r["step"] for r in train], [r["samples_per_second"] for r in train], color="tab:purple")
    ax_rate.set(title="throughput (cumulative)", xlabel="step", ylabel="samples/s")
    for ax in (ax_loss, ax_eval, ax_rate):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def format_eval(e: dict[str, Any]) -> str:
    """One line of the eval metrics a run has (ranking objectives have no NE or calibration)."""
    names = {"auc": "AUC", "ne": "NE", "logloss": "logloss", "calibration": "calibration", "map": "MAP"}
    parts = [f"{names.get(k, k)} {v:.4f}" for k, v in e.items() if isinstance(v, float)]
    return "  ".join(parts + [f"n {e['n']:,}"])
