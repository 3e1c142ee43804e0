"""The trainer: builds data, model, parallelism and optimizers once; ``train()`` is the loop.

``run`` is what every rank executes, whether started by ``launch.py``, by ``torchrun`` or
directly in the Hydra process for a single-rank run.
"""

from __future__ import annotations

import datetime
import gc
import hashlib
import json
import logging
import math
import os
import platform
import sys
import time
import warnings
from typing import Any, Iterator, Mapping, Optional

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.errors import record

from hybridrec import checkpoint
from hybridrec.config import Logger
from hybridrec.data import DataError, ReadReport, RecBatch, build_source, loader
from hybridrec.data.loader import padding_batch
from hybridrec.metrics import (
    MetricsLog,
    all_gather_cat,
    binary_metrics,
    format_eval,
    ranking_metrics,
    comm_compute_split,
    step_breakdown,
    format_summary,
    peak_rss_mb,
    percentiles_ms,
    plot_report,
    write_json,
)
from hybridrec.logs import JobLogging, Progress, configure_rank
from hybridrec.models import build_model
from hybridrec.optim import TrainOptimizer
from hybridrec.parallel_dims import pick_device, rank_dims  # noqa: F401  (pick_device: the ranks' entry)
from hybridrec.parallelize import parallelize
from hybridrec.sharding import PlanError, format_report

log = logging.getLogger(__name__)


class Trainer:
    def __init__(self, cfg: DictConfig, run_dir: str, device: torch.device) -> None:
        self.cfg, self.run_dir, self.device = cfg, run_dir, device
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # Dense layers are initialized from the global RNG before sharding: same values on
        # every rank and for every world size. Embeddings get their own plan-independent init.
        torch.manual_seed(cfg.seed)
        self.data = build_source(cfg.data, cfg.seed)
        loader.check_splits(self.data)  # an empty split fails here, before any training
        model = build_model(cfg, self.data.features, self.data.num_dense_features, self.data.list_size)
        pooling = {f.name: f.pooling_factor for f in self.data.features}
        self.loss = model.loss
        self.parallel = parallelize(model, cfg, rank_dims(cfg, self.world_size, device), device, pooling,
                                    dist.group.WORLD)
        self.model, self.plan = self.parallel.model, self.parallel.plan
        if self.rank == 0:
            log.info("\n" + format_report(self.plan))
            write_json(os.path.join(run_dir, "plan.json"), self.plan)
        self.optimizer = TrainOptimizer(self.model, cfg.optimizer)
        self.pipeline = self.parallel.pipeline(cfg.train.pipeline, self.optimizer, device)
        tensorboard = os.path.join(run_dir, "tensorboard") if cfg.logger == Logger.tensorboard else None
        self.metrics = MetricsLog(os.path.join(run_dir, "metrics.jsonl") if self.rank == 0 else None, tensorboard)
        self.losses: list[float] = []  # global mean loss of every step
        self.step_times: list[float] = []  # host wall time of every step, seconds
        self.eval_history: list[dict[str, Any]] = []
        self.eval_seconds = 0.0  # excluded from the training throughput
        self.profile: Optional[dict[str, Any]] = None
        self.start_step = 0  # > 0 when resuming: the steps (= global batches) already done
        # This run's id, after the ids of the runs it continues (rank 0's is the one saved):
        # what decides which checkpoints keep_last may delete.
        self.runs = [checkpoint.new_run_id()]
        self.checkpointer = checkpoint.Checkpointer(self) if cfg.checkpoint.dir else None
        self.resumed_from: Optional[dict[str, Any]] = None
        # Rank 0 warns when a damaged newer checkpoint is skipped (again after each restart).
        if path := checkpoint.resume_path(cfg, warn=self.rank == 0):
            self.start_step = checkpoint.load(self, path)
            self.resumed_from = {"path": os.path.abspath(path), "step": self.start_step}
            log.info(f"resumed from {path} at step {self.start_step}")

    def step(self, batches: Iterator, step: int) -> torch.Tensor:
        """Training step ``step`` (1-based) on the next batch of ``batches``: TorchRec's
        pipeline (forward, backward, fused sparse and dense optimizer), then parallelism's
        per-step work. Returns this rank's loss (a tensor: reading it would sync the device)."""
        loss, _logits, _labels = self.pipeline.progress(batches)
        self.parallel.after_step(step, last=step == self.cfg.train.steps)
        return loss

    def train(self) -> dict[str, Any]:
        cfg, every = self.cfg.train, self.cfg.checkpoint.every_n_steps
        batches = self._batches("train", cfg.steps, start=self.start_step)
        self.local_losses = torch.zeros(cfg.steps, device=self.device)
        progress = Progress(cfg.steps, self.start_step, enabled=self.rank == 0, logger=log)
        profiler = self._profiler()
        self.start = time.perf_counter()
        try:
            with progress.logging():
                for step in range(self.start_step + 1, cfg.steps + 1):
                    tick = time.perf_counter()
                    self.local_losses[step - 1] = self.step(batches, step)
                    self.step_times.append(time.perf_counter() - tick)
                    progress.advance(step)
                    if profiler:
                        profiler.step()
                    save = self.checkpointer and (step == cfg.steps or (every and step % every == 0))
                    if step % cfg.log_every == 0 or step == cfg.steps or save:
                        self._log(step, progress)  # also checks the losses are finite: no bad checkpoint
                    if save:
                        self.checkpointer.save(step)
                    if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
                        self._evaluate_and_log(self.select_split, step)
                if self.checkpointer:
                    self.checkpointer.wait()  # an async save still in flight is committed here
        finally:
            progress.close()  # the bar's last state first, then whatever reports an error
        wall = time.perf_counter() - self.start - self.eval_seconds
        if profiler:
            profiler.stop()
        # Validation (when the source has it) drives the history; the test split is scored
        # once, at the end, and never used to choose anything.
        final = {split: self._evaluate_and_log(split, cfg.steps) for split in ("valid", "eval")
                 if split in self.data.splits}
        return self._finish(wall, final)

    def _log(self, step: int, progress: Progress) -> None:
        # One all-reduce per window, not per step: the reduction is a sync point.
        window = self._global_mean(self.local_losses[len(self.losses) : step])
        if bad := [i for i, x in enumerate(window) if not math.isfinite(x)]:
            raise FloatingPointError(
                f"non-finite loss {window[bad[0]]} at step {len(self.losses) + bad[0] + 1}: stopping "
                f"before any further checkpoint (the last one is intact)"
            )
        self.losses += window
        elapsed = time.perf_counter() - self.start - self.eval_seconds
        rate = (step - self.start_step) * self.cfg.data.batch_size / elapsed
        progress.report(step, self.losses[-1], rate, elapsed)
        extra = {"grad_norm": self.optimizer.grad_norms[-1].item()} if self.optimizer.grad_norms else {}
        self.metrics.log(step=step, loss=self.losses[-1], loss_mean=sum(window) / len(window), samples_per_second=rate,
                         elapsed_s=elapsed, lr=self.optimizer.lrs(), **extra)

    def _global_mean(self, local: torch.Tensor) -> list[float]:
        # Each rank's loss is the mean over its equal-sized slice: the average over ranks is
        # the mean over the global batch (gloo has no AVG, so SUM then divide).
        total = local.detach().clone()
        dist.all_reduce(total)
        return (total / self.world_size).tolist()

    @property
    def select_split(self) -> str:
        """The split that evaluations during training report on: validation if there is one."""
        return "valid" if "valid" in self.data.splits else "eval"

    def _evaluate_and_log(self, split: str, step: int) -> dict[str, float]:
        tick = time.perf_counter()
        result = self.evaluate(split)
        self.eval_seconds += time.perf_counter() - tick
        if split == self.select_split:
            self.eval_history.append({"step": step, "split": split, **result})
        self.metrics.log(step=step, split=split, eval=result)
        if self.rank == 0:
            log.info(f"{split} @ step {step}: {format_eval(result)}")
        return result

    @torch.no_grad()
    def evaluate(self, split: str = "eval") -> dict[str, float]:
        """Metrics over the whole ``split`` (``eval`` = test, ``valid``), predictions gathered
        from every rank."""
        model = self.pipeline.detach()  # restores the model's own forward (no pipelining)
        model.eval()
        columns: dict[str, list[torch.Tensor]] = {"score": [], "label": [], "real": []}
        batches = self._batches(split)
        while True:
            item = next(batches, None)
            # Ranks can run out at different batches (a sharded source): one all-reduce per
            # batch agrees on the end, and a rank that ran out feeds padding meanwhile (the
            # sharded embedding lookups are collectives every rank must join).
            more = torch.tensor([item is not None], dtype=torch.int32, device=self.device)
            dist.all_reduce(more, op=dist.ReduceOp.MAX)
            if not more.item():
                break
            item = item or padding_batch(self.data, self.world_size)
            _, (_, logits, y) = model(item.batch.to(self.device))
            columns["score"].append(logits)
            columns["label"].append(y)
            real = item.real
            if isinstance(item.batch, RecBatch):  # ranking sources: padding inside lists too
                real = real & (item.batch.weights > 0)
                for name in ("relevance", "query"):
                    columns.setdefault(name, []).append(getattr(item.batch, name))
            columns["real"].append(real.to(torch.uint8))  # (gloo gathers no bool)
        model.train()  # the pipeline re-attaches itself at the next progress()
        c = {name: all_gather_cat(torch.cat(parts).to(self.device)).cpu() for name, parts in columns.items()}
        real = c.pop("real").bool()  # padding rows (the last batch of a split) are no rows
        c = {name: t[real] for name, t in c.items()}
        result = binary_metrics(torch.sigmoid(c["score"]), c["label"])
        if not self.loss.calibrated:
            # Scores trained by a ranking or regression objective are not click probabilities:
            # NE, log loss, calibration and accuracy of sigmoid(score) would mean nothing.
            result = {k: v for k, v in result.items() if k not in ("ne", "logloss", "calibration", "accuracy")}
        if self.data.ranking_k is not None:  # lists per user: NDCG, MAP, recall
            result |= ranking_metrics(c["score"].double().numpy(), c["relevance"].numpy(), c["query"].numpy(),
                                      self.data.threshold, self.data.ranking_k)
        return result

    def _batches(self, split: str, num_batches: Optional[int] = None, start: int = 0):
        """This rank's batches of ``split`` from the shared input loop, with the configured
        worker processes (pinned memory when training on CUDA)."""
        d = self.cfg.data
        return loader.batches(self.data, split, self.rank, self.world_size, num_batches, start,
                              num_workers=d.num_workers, prefetch=d.prefetch, pin_memory=self.device.type == "cuda")

    def _profiler(self) -> Optional[torch.profiler.profile]:
        """torch.profiler over steps start_step+1 .. start_step+steps (one warm-up step)."""
        p = self.cfg.profile
        if not p.enabled:
            return None
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        trace_dir = os.path.join(self.run_dir, "profile")
        os.makedirs(trace_dir, exist_ok=True)

        def on_trace_ready(prof: torch.profiler.profile) -> None:
            prof.export_chrome_trace(os.path.join(trace_dir, f"trace_rank{self.rank}.json"))
            events = prof.events()
            self.profile = {"rank": self.rank, **comm_compute_split(events), "breakdown_ms": step_breakdown(events)}

        profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=p.start_step - 1, warmup=1, active=p.steps, repeat=1),
            on_trace_ready=on_trace_ready,
        )
        profiler.start()
        return profiler

    def _finish(self, wall: float, final: dict[str, dict[str, float]]) -> dict[str, Any]:
        self.metrics.close()
        summary = self.summary(wall, final)
        report = self._read_report()
        if report is not None:  # file sources: rows read, bad rows, dropped tails, collisions
            summary["data"] = report
            if report["bad_rows"] and self.rank == 0:
                first = next(e for f in report["files"].values() for e in f["errors"])
                log.warning(f"data: skipped {report['bad_rows']} bad rows of "
                            f"{report['rows'] + report['bad_rows']} (first: {first}); see summary.json")
            for lost in report.get("unreadable", []) if self.rank == 0 else []:
                log.warning(f"data: {lost}; the lines before it were used")
        if self.rank == 0:
            plot_report(self.metrics.records, os.path.join(self.run_dir, "report.png"))
            log.info("summary\n" + format_summary(summary))
        return summary

    def _read_report(self) -> Optional[dict[str, Any]]:
        """The source's read report, summed over ranks when each rank read its own part of
        the files (``per_rank_report``); otherwise every rank read the same and rank 0's is
        the report."""
        report = self.data.report()
        if report is None or not getattr(self.data, "per_rank_report", False):
            return report
        parts = [None] * self.world_size
        dist.all_gather_object(parts, report)
        total = ReadReport()
        for part in parts:
            total.merge(ReadReport.from_dict(part))
        total.collisions = parts[0]["collisions"]  # estimated by rank 0 (shard 0)
        return total.to_dict()

    def summary(self, wall: float, final: dict[str, dict[str, float]]) -> dict[str, Any]:
        steps = len(self.losses)
        tail = self.losses[-max(1, steps // 10) :]
        run_samples = (steps - self.start_step) * self.cfg.data.batch_size  # in this process
        per_rank = [None] * self.world_size
        dist.all_gather_object(per_rank, (round(peak_rss_mb(), 1), self.profile))
        rss = [m for m, _ in per_rank]
        plan = self.plan or {"tables": {}, "ranks": []}  # the report lives on rank 0
        samples = steps * self.cfg.data.batch_size
        summary = {
            "world_size": self.world_size,
            "device": str(self.device),
            "dense_parallel": self.cfg.mesh.dense.value,
            "steps": steps,
            "global_batch_size": self.cfg.data.batch_size,
            "wall_time_s": round(wall, 3),
            "samples_per_second": run_samples / wall,
            "train_loss": sum(tail) / len(tail),  # mean of the last 10% of steps
            "train": {
                "steps": steps,
                "samples": samples,
                "resumed_from_step": self.start_step,
                "wall_time_s": round(wall, 3),  # training only, this process: evaluation excluded
                "samples_per_second": run_samples / wall,
                **percentiles_ms(self.step_times),
            },
            "eval": final["eval"],  # the test split: scored once, at the end
            **({"valid": final["valid"]} if "valid" in final else {}),
            "eval_history": self.eval_history,  # on validation when the source has it
            "provenance": provenance(self.cfg, self.resumed_from),
            "plan": plan["tables"],
            "peak_rss_mb": rss,
            # the planner's estimate beside the measurement, per rank
            "memory_per_rank": [
                {
                    "rank": r["rank"],
                    "est_device_mb": round(r["est_device_bytes"] / 2**20, 1),
                    "est_host_mb": round(r["est_host_bytes"] / 2**20, 1),
                    "peak_rss_mb": rss[r["rank"]],
                }
                for r in plan["ranks"]
            ],
        }
        if self.cfg.profile.enabled:
            summary["profile"] = [p for _, p in per_rank]
        return summary


def provenance(cfg: DictConfig, resumed_from: Optional[dict[str, Any]]) -> dict[str, Any]:
    """What a result came from: the checkpoint it resumed (path, step), the library versions,
    and a hash of the resolved config (equal hashes, same settings)."""
    import hydra
    import torchrec
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> Optional[str]:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    resolved = OmegaConf.to_yaml(cfg, resolve=True, sort_keys=True)
    return {
        "resumed_from": resumed_from,
        "config_sha256": hashlib.sha256(resolved.encode()).hexdigest(),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torchrec": torchrec.__version__,
            "fbgemm_gpu": installed("fbgemm-gpu-cpu") or installed("fbgemm-gpu"),
            "hydra": hydra.__version__,
            "hybridrec": installed("hybridrec"),
        },
    }


def init_distributed(device: torch.device, timeout_s: float = 300.0) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)  # every collective's timeout
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # Started by the elastic agent, whose store outlives restarts. Prefix this attempt's
        # keys: after a restart, gloo otherwise read the dead attempt's peer addresses from
        # the shared store and failed to connect (seen on torch 2.13).
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
        )
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"hybridrec/attempt_{attempt}", store),
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=timeout,
        )
    elif "RANK" in os.environ:  # another launcher (e.g. srun): rendezvous through env://
        dist.init_process_group(backend, timeout=timeout)
    else:  # a single process still gets a process group, so there is one code path
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def health_check(timeout_s: float) -> None:
    """One monitored barrier across all ranks: a rank that does not answer in time is named
    (gloo's monitored_barrier reports which ranks failed) instead of everyone hanging. NCCL
    has no monitored barrier, so GPU jobs run it on a gloo group."""
    group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    try:
        dist.monitored_barrier(group, timeout=datetime.timedelta(seconds=timeout_s), wait_all_ranks=True)
    except RuntimeError as e:
        raise RuntimeError(f"health check: not every rank answered within {timeout_s:g} s: {e}") from e


def _quiet_deprecations() -> None:
    # Notices about the libraries' own internals that a user can do nothing about: TorchRec's
    # embedding shards are ShardedTensors, and FSDP2 calls collectives torch has renamed.
    # Matched by message, so any other warning still shows.
    for message in (
        "Please use DTensor instead and we are deprecating ShardedTensor",
        r"`torch.distributed.\w+` is deprecated",
    ):
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)


# Errors the user can fix (bad input files, a damaged or mismatched checkpoint, a full disk,
# a plan the planner cannot meet: under torchrun the ranks plan before anything else has):
# reported as one line naming the file or key, without a traceback, and never restarted.
USER_ERRORS = (DataError, checkpoint.CheckpointError, PlanError)
USER_ERROR_EXIT = 3
"""Exit code of a rank stopped by a user error (its message is in the elastic error file)."""


def full_errors() -> bool:
    """HYDRA_FULL_ERROR=1 (Hydra's own switch) shows the traceback of user errors too."""
    return os.environ.get("HYDRA_FULL_ERROR") == "1"


def intra_op_threads(cfg: DictConfig, device: torch.device, env: Mapping[str, str]) -> Optional[int]:
    """The rank's intra-op thread count, or None to leave torch's (OMP_NUM_THREADS) as is."""
    if cfg.launcher.threads_per_rank:
        return cfg.launcher.threads_per_rank
    if device.type == "cpu" and "OMP_NUM_THREADS" not in env:
        # N local ranks each defaulting to every core oversubscribe the CPU (torchrun sets
        # OMP_NUM_THREADS=1 for this reason; elastic_launch does not): split the cores.
        return max(1, (os.cpu_count() or 1) // int(env.get("LOCAL_WORLD_SIZE", 1)))
    return None


@record  # under the elastic launcher, a failing rank's traceback reaches the user
def run(cfg: DictConfig, run_dir: str, parent_reports: bool = False,
        job_logging: Optional[JobLogging] = None) -> dict[str, Any]:
    """One rank's whole job: process group, Trainer, summary (rank 0), teardown.

    ``parent_reports``: the rank was started by ``launch.spawn``, which prints a user error's
    one line itself; the rank then records the message in the elastic error file and exits
    quietly with USER_ERROR_EXIT. Otherwise a user error propagates to the caller.
    ``job_logging``: the Hydra job's logging, for a rank in a process of its own."""
    device = pick_device(cfg)
    if threads := intra_op_threads(cfg, device, os.environ):
        torch.set_num_threads(threads)
    init_distributed(device, cfg.launcher.collective_timeout_s)
    summary = None
    try:
        health_check(cfg.launcher.health_check_timeout_s)
        summary = _train_rank(cfg, run_dir, device, job_logging)  # the Trainer is freed when it returns
        dist.barrier()  # leave together: no rank tears down while another still communicates
        return summary
    except USER_ERRORS as e:
        if parent_reports and not full_errors() and (error_file := os.environ.get("TORCHELASTIC_ERROR_FILE")):
            # The format torch elastic reads back into ChildFailedError (a plain message).
            with open(error_file, "w") as f:
                json.dump({"message": str(e), "timestamp": int(time.time())}, f)
            sys.exit(USER_ERROR_EXIT)
        raise
    finally:
        shutdown_distributed(clean=summary is not None)


def _train_rank(cfg: DictConfig, run_dir: str, device: torch.device,
                job_logging: Optional[JobLogging]) -> dict[str, Any]:
    rank = dist.get_rank()
    configure_rank(rank, job_logging)
    _quiet_deprecations()
    # Under torchrun every rank ran Hydra on its own; rank 0's run directory is the one.
    shared = [run_dir]
    dist.broadcast_object_list(shared, src=0)
    run_dir = shared[0]
    summary = Trainer(cfg, run_dir, device).train()
    if rank == 0:
        write_json(os.path.join(run_dir, "summary.json"), summary)
        log.info(
            f"{summary['steps']} steps, {summary['samples_per_second']:,.0f} samples/s, "
            f"train loss {summary['train_loss']:.4f}, eval {format_eval(summary['eval'])}"
        )
        print(f"hybridrec: outputs in {os.path.abspath(run_dir)} (summary.json, metrics.jsonl)", flush=True)
    return summary


def shutdown_distributed(clean: bool) -> None:
    """Release everything that holds a process group, then destroy the groups.

    The model, pipeline and FSDP2 mesh keep references to gloo/NCCL groups (TorchRec creates
    sub-groups too); left to interpreter shutdown, their transport threads are torn down in
    arbitrary order, which can abort a rank after a successful run. On failure, skip the
    collective destroy, which could block on a peer that is still inside a collective
    (as torchtitan does); the launcher then stops the other ranks.
    """
    gc.collect()
    if clean:
        dist.destroy_process_group()
