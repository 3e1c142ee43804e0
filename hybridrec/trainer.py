"""The trainer: builds data, model, parallelism and optimizers once; ``train()`` is the loop.

``run`` is what every rank executes, whether started by ``launch.py``, by ``torchrun`` or
directly in the Hydra process for a single-rank run.
"""

from __future__ import annotations

import gc
import logging
import os
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch.distributed.elastic.multiprocessing.errors import record
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from tqdm import tqdm

from hybridrec.config import Device
from hybridrec.metrics import MetricsLog, all_gather_cat, binary_metrics, peak_rss_mb, write_json
from hybridrec.optim import TrainOptimizer
from hybridrec.parallelize import parallelize
from hybridrec.plan import quiet_enumerator
from hybridrec.sharding import format_report

log = logging.getLogger(__name__)


class Trainer:
    def __init__(self, cfg: DictConfig, run_dir: str, device: torch.device) -> None:
        self.cfg, self.run_dir, self.device = cfg, run_dir, device
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # Dense layers are initialized from the global RNG before sharding: same values on
        # every rank and for every world size. Embeddings get their own plan-independent init.
        torch.manual_seed(cfg.seed)
        self.data = instantiate(cfg.data, seed=cfg.seed)
        model = instantiate(
            cfg.model, features=self.data.features, num_dense_features=self.data.num_dense_features
        )
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        pooling = {f.name: f.pooling_factor for f in self.data.features}
        self.model, self.plan = parallelize(
            model, cfg, device, local_world_size, pooling, dist.group.WORLD
        )
        if self.rank == 0:
            log.info("\n" + format_report(self.plan))
            write_json(os.path.join(run_dir, "plan.json"), self.plan)
        self.optimizer = TrainOptimizer(self.model, cfg.optimizer)
        # Overlaps the next batch's input all-to-all with this batch's forward/backward.
        self.pipeline = TrainPipelineSparseDist(self.model, self.optimizer, device)
        self.metrics = MetricsLog(os.path.join(run_dir, "metrics.jsonl") if self.rank == 0 else None)
        self.losses: list[float] = []  # global mean loss of every step

    def train(self) -> dict[str, Any]:
        steps, log_every = self.cfg.train.steps, self.cfg.train.log_every
        global_batch = self.cfg.data.batch_size
        batches = self.data.batches("train", self.rank, self.world_size, steps)
        local_losses = torch.zeros(steps, device=self.device)
        bar = tqdm(total=steps, desc="train", unit="step", disable=self.rank != 0)
        start = time.perf_counter()
        for step in range(1, steps + 1):
            loss, _logits, _labels = self.pipeline.progress(batches)
            local_losses[step - 1] = loss
            if step % log_every == 0 or step == steps:
                # One all-reduce per window, not per step: the reduction is a sync point.
                self.losses += self._global_mean(local_losses[len(self.losses) : step])
                elapsed = time.perf_counter() - start
                rate = step * global_batch / elapsed
                bar.set_postfix(loss=f"{self.losses[-1]:.4f}", samples_s=f"{rate:,.0f}")
                extra = {"grad_norm": self.optimizer.grad_norms[-1].item()} if self.optimizer.grad_norms else {}
                self.metrics.log(step=step, loss=self.losses[-1], samples_per_second=rate,
                                 elapsed_s=elapsed, lr=self.optimizer.lrs(), **extra)
            bar.update()
        wall = time.perf_counter() - start
        bar.close()
        self.metrics.close()
        summary = self.summary(wall, self.evaluate())
        report = self.data.report()
        if report is not None:  # file sources: rows read, bad rows, dropped tails, collisions
            summary["data"] = report
            if report["bad_rows"] and self.rank == 0:
                first = next(e for f in report["files"].values() for e in f["errors"])
                log.warning(f"data: skipped {report['bad_rows']} bad rows of "
                            f"{report['rows'] + report['bad_rows']} (first: {first}); see summary.json")
        return summary

    def _global_mean(self, local: torch.Tensor) -> list[float]:
        # Each rank's loss is the mean over its equal-sized slice: the average over ranks is
        # the mean over the global batch (gloo has no AVG, so SUM then divide).
        total = local.detach().clone()
        dist.all_reduce(total)
        return (total / self.world_size).tolist()

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """AUC / NE / log loss over the whole eval split, gathered from every rank."""
        model = self.pipeline.detach()  # restores the model's own forward (no pipelining)
        model.eval()
        probs, labels = [], []
        for batch in self.data.batches("eval", self.rank, self.world_size):
            _, (_, logits, y) = model(batch.to(self.device))
            probs.append(torch.sigmoid(logits))
            labels.append(y)
        model.train()
        return binary_metrics(
            all_gather_cat(torch.cat(probs)).cpu(), all_gather_cat(torch.cat(labels)).cpu()
        )

    def summary(self, wall: float, eval_metrics: dict[str, float]) -> dict[str, Any]:
        steps = len(self.losses)
        tail = self.losses[-max(1, steps // 10) :]
        rss = [None] * self.world_size
        dist.all_gather_object(rss, round(peak_rss_mb(), 1))
        plan = self.plan or {"tables": {}, "ranks": []}  # the report lives on rank 0
        return {
            "world_size": self.world_size,
            "device": str(self.device),
            "dense_parallel": self.cfg.mesh.dense.value,
            "steps": steps,
            "global_batch_size": self.cfg.data.batch_size,
            "wall_time_s": round(wall, 3),
            "samples_per_second": steps * self.cfg.data.batch_size / wall,
            "train_loss": sum(tail) / len(tail),  # mean of the last 10% of steps
            "eval": eval_metrics,
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


def pick_device(cfg: DictConfig) -> torch.device:
    want = cfg.launcher.device
    if want == Device.auto:
        want = Device.cuda if torch.cuda.is_available() else Device.cpu
    if want == Device.cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(device: torch.device) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "RANK" in os.environ:  # started by an elastic launcher: rendezvous through env://
        dist.init_process_group(backend)
    else:  # a single process still gets a process group, so there is one code path
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def _configure_logging(rank: int) -> None:
    logging.basicConfig(format=f"[rank{rank}] %(levelname)s %(name)s: %(message)s")
    # Libraries log at INFO on the root logger (fbgemm prints every kernel's arguments), so
    # only hybridrec's own INFO is shown, and only on rank 0: other ranks speak on failure.
    logging.getLogger().setLevel(logging.WARNING)
    logging.getLogger("hybridrec").setLevel(logging.INFO if rank == 0 else logging.WARNING)
    # Notices about the libraries' own internals that a user can do nothing about: TorchRec's
    # embedding shards are ShardedTensors, FSDP2 calls collectives torch has renamed, and the
    # train pipeline's fx tracing logs a notice once per rank. Matched by message, so any
    # other warning still shows.
    for message in (
        "Please use DTensor instead and we are deprecating ShardedTensor",
        r"`torch.distributed.\w+` is deprecated",
    ):
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    quiet_enumerator()


@record  # under the elastic launcher, a failing rank's traceback reaches the user
def run(cfg: DictConfig, run_dir: str) -> dict[str, Any]:
    """One rank's whole job: process group, Trainer, summary (rank 0), teardown."""
    device = pick_device(cfg)
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # N local ranks each defaulting to every core oversubscribe the CPU (torchrun sets
        # OMP_NUM_THREADS=1 for this reason; elastic_launch does not): split the cores.
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    init_distributed(device)
    summary = None
    try:
        summary = _train_rank(cfg, run_dir, device)  # the Trainer is freed when it returns
        dist.barrier()  # leave together: no rank tears down while another still communicates
        return summary
    finally:
        shutdown_distributed(clean=summary is not None)


def _train_rank(cfg: DictConfig, run_dir: str, device: torch.device) -> dict[str, Any]:
    rank = dist.get_rank()
    _configure_logging(rank)
    # Under torchrun every rank ran Hydra on its own; rank 0's run directory is the one.
    shared = [run_dir]
    dist.broadcast_object_list(shared, src=0)
    run_dir = shared[0]
    summary = Trainer(cfg, run_dir, device).train()
    if rank == 0:
        write_json(os.path.join(run_dir, "summary.json"), summary)
        e = summary["eval"]
        log.info(
            f"{summary['steps']} steps, {summary['samples_per_second']:,.0f} samples/s, "
            f"train loss {summary['train_loss']:.4f}, eval AUC {e['auc']:.4f} NE {e['ne']:.4f}"
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
