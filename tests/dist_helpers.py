"""Scenarios that run inside ranks (importable by the ranks), and ``spawn``, which runs one
on the test process's pool of ranks (``rank_pool``: started once, many scenarios)."""

from __future__ import annotations

import os
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch.distributed.tensor import DTensor

from hybridrec.base.compat import ShardedTensor
from hybridrec.data import loader
from hybridrec.parallel.devices import pick_device
from hybridrec.parallel.distributed import init_distributed, shutdown_distributed
from hybridrec.training.trainer import Trainer


def spawn(fn, nproc: int, *args: Any) -> Any:
    """``fn(*args)`` on ``nproc`` ranks of this test process's pool; rank 0's return value.
    The launcher's own start-up (the elastic agent, restarts, signals) is tested through the
    real commands (test_cli, test_elastic, test_signals)."""
    from rank_pool import ranks

    return ranks(nproc).run(fn, *args)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict, on rank 0 (other ranks get an empty dict). Collective.

    Embedding shards (ShardedTensor, any sharding type) are gathered with
    ``ShardedTensor.gather`` into a tensor on the process group's device (NCCL gathers
    CUDA tensors only), then copied to CPU; FSDP2 parameters (DTensor) with
    ``full_tensor``; replicated tensors are taken as they are. Keys are those of the
    unsharded model."""
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        if isinstance(value, ShardedTensor):
            full = torch.empty(value.size(), dtype=value.dtype, device=device) if rank == 0 else None
            value.gather(dst=0, out=full)
        elif isinstance(value, DTensor):
            full = value.full_tensor()
        else:
            full = value
        if rank == 0:
            out[key] = full.detach().cpu().clone()
    return out


def _train_each(cfgs: list[DictConfig], run_dir: str, collect, before=None) -> list[dict[str, Any]]:
    """Train each config in turn in one process group; ``collect(trainer, summary)`` says
    what each run returns (one function for all, or a list of one per config); ``before(trainer)``,
    when given, runs after the trainer is built and before it trains."""
    warnings.simplefilter("ignore", FutureWarning)
    device = pick_device(cfgs[0])
    init_distributed(device)
    done = False
    try:
        results = []
        for i, cfg in enumerate(cfgs):
            out = os.path.join(run_dir, str(i))
            os.makedirs(out, exist_ok=True)
            trainer = Trainer(cfg, out, device)
            if before:
                before(trainer)
            results.append((collect[i] if isinstance(collect, list) else collect)(trainer, trainer.train()))
        done = True
        return results
    finally:
        shutdown_distributed(clean=done)


def train_and_gather(cfgs: list[DictConfig], run_dir: str) -> list[dict[str, Any]]:
    """Per config: per-step global losses, the unsharded final weights (rank 0), the plan."""
    return _train_each(cfgs, run_dir, _gather)


def _gather(trainer: Trainer, summary: dict[str, Any]) -> dict[str, Any]:
    return {
        "losses": trainer.losses,
        "state": full_state_dict(trainer.model),
        "summary": summary,
        "dense_placements": _dense_placements(trainer),
        "plan_notes": (trainer.plan or {}).get("notes"),
        "grad_norms": [n.item() for n in trainer.optimizer.grad_norms],
        "eval_logits": _eval_logits(trainer),
        "pipeline": type(trainer.pipeline).__name__,
    }


def train_and_collect(jobs: list[tuple[DictConfig, str]], run_dir: str) -> list[dict[str, Any]]:
    """Per (config, what): "gather" returns what train_and_gather does, "reshard" the FSDP2
    reshard-after-forward state of the root and each dense unit. Runs of both kinds share one process group."""
    collectors = {"gather": _gather, "reshard": _reshard_states}
    return _train_each([cfg for cfg, _ in jobs], run_dir, [collectors[what] for _, what in jobs])


@torch.no_grad()
def _eval_logits(trainer: Trainer) -> torch.Tensor:
    """The trained model's logits on the first global eval batch (gathered from all ranks)."""
    model = trainer.pipeline.detach()
    model.eval()
    batch = next(loader.batches(trainer.data, "eval", trainer.rank, trainer.world_size, 1)).batch
    _, (_, logits, _) = model(batch.to(trainer.device))
    return all_gather_cat(logits).cpu()


def all_gather_cat(t: torch.Tensor) -> torch.Tensor:
    """Concatenate equal-sized tensors from every rank, in rank order, on every rank."""
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return torch.cat(out)


def _dense_placements(trainer: Trainer) -> str:
    """How the dense parameters are held: their DTensor placements ("S(0)" for FSDP2 on a 1-D
    mesh, "RS(0)" for HSDP: replicated x sharded), or "replicated" for plain tensors."""
    dense = [p for m in trainer.model.module.dense_units() for p in m.parameters()]
    kinds = {"".join(map(str, p.placements)) if isinstance(p, DTensor) else "replicated" for p in dense}
    assert len(kinds) == 1, kinds
    return kinds.pop()


def late_rank_health_check(delay_s: float, timeout_s: float) -> str:
    """Rank 1 arrives ``delay_s`` late at the start-up health check; returns what rank 0 saw."""
    import time

    from hybridrec.parallel.distributed import health_check

    init_distributed(torch.device("cpu"))
    try:
        if dist.get_rank() == 1:
            time.sleep(delay_s)
        try:
            health_check(timeout_s)
            return "ok"
        except RuntimeError as e:
            return str(e)
    finally:
        dist.destroy_process_group()  # gloo's is local: it does not wait for the late rank


def train_replicated(cfgs: list[DictConfig], run_dir: str) -> list[dict[str, Any]]:
    """Per config (GPU): per-step global losses, the final eval metrics, the plan's topology
    (rank 0) and, per rank, the sum of its local embedding shards: under 2D, ranks holding
    replicas of the same shards must agree."""

    def collect(trainer: Trainer, summary: dict[str, Any]) -> dict[str, Any]:
        with torch.no_grad():
            total = torch.zeros((), dtype=torch.float64, device=trainer.device)
            for weight in trainer.model.module.sparse_module().state_dict().values():
                local = weight.to_local() if isinstance(weight, DTensor) else weight
                shards = local.local_shards() if hasattr(local, "local_shards") else [local]
                for shard in shards:
                    total += (shard.tensor if hasattr(shard, "tensor") else shard).double().sum()
        sums = [None] * dist.get_world_size()
        dist.all_gather_object(sums, total.item())
        return {
            "losses": trainer.losses,
            "eval": summary["eval"],
            "shard_sums": sums,
            "topology": (trainer.plan or {}).get("topology"),
        }

    return _train_each(cfgs, run_dir, collect)


def train_and_summarize(cfgs: list[DictConfig], run_dir: str) -> list[dict[str, Any]]:
    """Per config: per-step global losses and the run's summary (no weights gathered)."""
    return _train_each(cfgs, run_dir, lambda trainer, summary: {"losses": trainer.losses, "summary": summary})


def _reshard_states(trainer: Trainer, _summary: dict[str, Any]) -> dict[str, Any]:
    """For the FSDP2 root and each dense unit, whether it reshards its parameters after
    forward (FSDP2's post-forward mesh is set)."""
    from torch.distributed.fsdp import FSDPModule

    root = trainer.model._dmp_wrapped_module
    units = {
        "root": root,
        **{f"unit{i}": u for i, u in enumerate(trainer.model.module.dense_units()) if isinstance(u, FSDPModule)},
    }
    groups = {name: module._get_fsdp_state()._fsdp_param_group for name, module in units.items()}
    # a unit without parameters of its own (the root when every block is a unit) has no group
    return {name: None if g is None else g.post_forward_mesh_info is not None for name, g in groups.items()}


def rank_outcomes(cfg: DictConfig, run_dir: str) -> list[tuple[str, str, int]]:
    """``hybridrec.run.rank.run`` with jobs that fail as a rank's job can: a bug, a killed
    DataLoader worker, a user's error, the device out of memory. Per job: the exception the caller gets, its message,
    and the job's intra-op threads (``launcher.threads_per_rank``). Each run meets at a port
    of its own; the failed run's group is destroyed here, as the launcher ends the rank."""
    from hybridrec.base.signals import Killed
    from hybridrec.data import DataError
    from hybridrec.run import rank
    from rank_pool import _free_port

    threads = []

    def failing(error: BaseException):
        def job(cfg: DictConfig, run_dir: str, device: torch.device) -> dict[str, Any]:
            threads.append(torch.get_num_threads())
            raise error

        return job

    before, outcomes = torch.get_num_threads(), []
    errors = (
        RuntimeError("a bug in the job"),
        Killed("rank 0's DataLoader worker was killed by SIGKILL", 9),
        DataError("train.csv:3: a bad row"),
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.1 GiB total)\nmore"),
    )
    try:
        for error in errors:
            os.environ["MASTER_PORT"] = str(_free_port())
            try:
                rank.run(cfg, run_dir, job=failing(error))
            except BaseException as e:  # noqa: BLE001  (what the caller gets is the result)
                outcomes.append((type(e).__name__, str(e), threads[-1]))
            finally:
                if dist.is_initialized():
                    dist.destroy_process_group()
    finally:
        torch.set_num_threads(before)  # the pool's rank runs other scenarios
    return outcomes


def reset_and_gather(cfgs: list[DictConfig], run_dir: str, rows: list[int]) -> list[dict[str, Any]]:
    """Per config: every rank's shards of the item table's weight and optimizer state, each
    (first row, values), as a fresh model has them, after training, and after ``reset_rows``
    set ``rows`` back (rank 0; other ranks get None). The shards are gathered as objects: a
    rank without a shard of the table has no state of it to join a collective with."""
    import numpy as np

    from hybridrec.parallel.parallelize import local_shards
    from hybridrec.parallel.reset_rows import reset_rows

    def snapshot(trainer: Trainer) -> Optional[dict[str, list[tuple[int, torch.Tensor]]]]:
        sd = trainer.model.module.sparse_module().state_dict()
        weight = next(v for k, v in sd.items() if k.endswith("item_table.weight"))
        spans = [(o[0], t.size(0)) for o, t in local_shards(weight)]
        parts = {"weight": [(o[0], t.detach().clone()) for o, t in local_shards(weight)]}
        for _, opt in trainer.optimizer.optimizer.optimizers:
            names = {id(p): n for n, p in getattr(opt, "params", {}).items()}
            for param, state in opt.state.items():
                for key, value in state.items():
                    if key.startswith("item_table."):  # a fused optimizer's, a shard per table shard
                        shards = [t for _, t in local_shards(value)]
                        parts[key] = [(row0, t.clone()) for t, (row0, _) in zip(shards, spans)]
                    elif "item_table" in names.get(id(param), "") and value.dim():  # a data-parallel table's
                        parts[key] = [(0, value.detach().clone())]
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, parts)
        merged: dict[str, list[tuple[int, torch.Tensor]]] = {}
        for rank_parts in gathered:
            for key, shards in rank_parts.items():
                merged.setdefault(key, []).extend(shards)
        return merged if dist.get_rank() == 0 else None

    fresh: dict[int, Any] = {}

    def before(trainer: Trainer) -> None:
        fresh[id(trainer)] = snapshot(trainer)

    def collect(trainer: Trainer, _summary: dict[str, Any]) -> dict[str, Any]:
        trained = snapshot(trainer)
        reset_rows(
            trainer.model.module.sparse_module(), trainer.optimizer, trainer.cfg.seed, {"item_table": np.array(rows)}
        )
        return {"fresh": fresh.pop(id(trainer)), "trained": trained, "reset": snapshot(trainer)}

    return _train_each(cfgs, run_dir, collect, before)


# Tensor methods that read values on the host: on a GPU each waits for the device.
HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")
HYBRIDREC = os.sep + "hybridrec" + os.sep


def host_reads_in_steps(cfgs: list[DictConfig], run_dir: str, first: int, last: int) -> list[dict[str, int]]:
    """Per config: the host reads of tensor values made during training steps ``first`` ..
    ``last`` (the trainer's step: pipeline, optimizer, per-step parallel work), counted by the
    file:line that made each: hybridrec's own file when the read is in hybridrec's code, else
    the library's (TorchRec's, fbgemm's, torch's) innermost frame."""
    import traceback

    counts: list[dict[str, int]] = []
    state = {"on": False}
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counted(name: str):
        original = originals[name]

        def read(self, *args, **kwargs):
            if state["on"]:
                frames = traceback.extract_stack()[:-1]
                caller = frames[-1]
                own = HYBRIDREC in caller.filename and os.sep + "site-packages" + os.sep not in caller.filename
                where = (
                    f"{'hybridrec' if own else 'library'} {os.path.basename(caller.filename)}:{caller.lineno} {name}"
                )
                counts[-1][where] = counts[-1].get(where, 0) + 1
            return original(self, *args, **kwargs)

        return read

    def before(trainer: Trainer) -> None:
        counts.append({})
        step = trainer.step

        def watched(batches, s):
            state["on"] = first <= s <= last
            try:
                return step(batches, s)
            finally:
                state["on"] = False

        trainer.step = watched  # type: ignore[method-assign]  # counted for these steps only, this trainer

    for name in HOST_READS:
        setattr(torch.Tensor, name, counted(name))
    try:
        _train_each(cfgs, run_dir, lambda trainer, summary: None, before)
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
    return counts
