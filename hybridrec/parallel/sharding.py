"""Embedding placement: the sharder, the topology, per-table constraints, the planner, and the
plan report (what was placed where, at what estimated memory and cost).

Used by real runs (``parallelize.py``: ``collective_plan`` over the process group) and by the
dry run (``hybridrec.plan``: the same planner on a simulated topology, no process group), so a
dry run prints the plan that a real run on that topology would use.
"""

from __future__ import annotations

import fnmatch
import math
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Union, cast

import torch
import torch.distributed as dist
from fbgemm_gpu.split_table_batched_embeddings_ops_common import CacheAlgorithm as FbgemmCacheAlgorithm
from omegaconf import DictConfig, OmegaConf
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.storage_reservations import (
    FixedPercentageStorageReservation,
    HeuristicalStorageReservation,
)
from torchrec.distributed.planner.types import (
    HardwareConfig,
    KernelConfig,
    ParameterConstraints,
    PlannerError,
    ShardingOption,
    Stats,
    Topology,
    TopologyFactory,
    TrainerConfig,
)
from torchrec.distributed.types import CacheParams, ShardingPlan, ShardingType
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingCollection

from hybridrec.base.compat import planner_options, planner_reserved_share, planner_topology
from hybridrec.config import StorageReservation
from hybridrec.models import Ranker
from hybridrec.parallel.parallel_dims import ParallelDims

if TYPE_CHECKING:
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

GIB = 1024**3  # TorchRec's planner counts GB as 2^30 bytes; so do we


class HybridEBCSharder(EmbeddingBagCollectionSharder):
    """TorchRec's sharder, with row-wise, table-row-wise and grid sharding offered on CPU too.

    TorchRec 1.8 lists them for CUDA/MTIA only, but on CPU/gloo they plan, train and match
    single-process training (tests/test_equivalence.py). Offering them makes every row-wise
    code path runnable and testable without a GPU.
    """

    _CPU_EXTRA = (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE, ShardingType.GRID_SHARD)

    def sharding_types(self, compute_device_type: str) -> list[str]:
        types = super().sharding_types(compute_device_type)
        if compute_device_type == "cpu":
            types += [t.value for t in self._CPU_EXTRA if t.value not in types]
        return types


class HybridECSharder(EmbeddingCollectionSharder):
    """TorchRec's sharder of sequence embeddings (an ``EmbeddingCollection``: one vector per id,
    no pooling), the sequence rankers' item table; its CPU options (data-parallel, table-,
    column- and row-wise) are TorchRec's own."""


def sharders(qcomm_codecs_registry: Optional[dict] = None) -> list:
    """The sharders of every table kind a model holds: pooled (EmbeddingBagCollection) and
    sequence (EmbeddingCollection) embeddings."""
    return [
        HybridEBCSharder(qcomm_codecs_registry=qcomm_codecs_registry),
        HybridECSharder(qcomm_codecs_registry=qcomm_codecs_registry),
    ]


def table_configs(module: Union[EmbeddingBagCollection, EmbeddingCollection]) -> list:
    """The table configs of a model's sparse module: an EmbeddingBagCollection's or an
    EmbeddingCollection's (each names its tables' rows, width and features)."""
    if hasattr(module, "embedding_bag_configs"):
        return module.embedding_bag_configs()
    return module.embedding_configs()


class PlanError(ValueError):
    """The planner found no plan; the message says why and what would make one possible."""


# ------------------------------------------------------------------------------ topology
def build_topology(topo: DictConfig, dims: ParallelDims, detect: bool = True) -> tuple[Topology, dict[str, Any]]:
    """TorchRec's Topology from the ``topology`` config (TopologyConfig). Unset memory sizes are detected from this
    machine when ``detect`` (a real run, or the check before one), else TorchRec's defaults
    (a dry run plans for a cluster, not for the laptop it runs on). Also returns the resolved
    values and where each came from, for the report.

    With mesh.embedding_replicas = R > 1 (2D), the topology is one sharding group's: its
    world_size / R ranks, with as many per node as the group has (ParallelDims)."""
    world_size, local_world_size, device_type = dims.world_size, dims.local_world_size, dims.device_type
    resolved: dict[str, Any] = {
        "world_size": world_size,
        "local_world_size": local_world_size,
        "compute_device": device_type,
    }
    replicas = dims.embedding_replicas
    plan_world, plan_local = dims.embedding_group, dims.embedding_group_per_node
    if replicas > 1:
        resolved.update(sharding_group_size=plan_world, replica_group_size=replicas, sharding_group_per_node=plan_local)
    if topo.device_memory_gb is not None:
        hbm, resolved["device_memory"] = int(topo.device_memory_gb * GIB), "config"
    elif detect and device_type == "cuda" and torch.cuda.is_available():
        hbm, resolved["device_memory"] = torch.cuda.get_device_properties(0).total_memory, "detected"
    else:
        hbm, resolved["device_memory"] = None, "TorchRec default"
    if topo.host_memory_gb is not None:
        ddr, resolved["host_memory"] = int(topo.host_memory_gb * GIB), "config"
    elif detect:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        ddr, resolved["host_memory"] = total // local_world_size, "detected"
    else:
        ddr, resolved["host_memory"] = None, "TorchRec default"
    bw = lambda gbs: None if gbs is None else gbs * GIB / 1000  # GB/s -> bytes/ms
    topology = TopologyFactory.create_topology(
        trainer_config=TrainerConfig(
            world_size=plan_world,
            local_world_size=plan_local,
            hbm_cap_bytes=hbm,
            ddr_cap_bytes=ddr,
        ),
        hardware_config=HardwareConfig(
            intra_host_bw=bw(topo.intra_host_bandwidth_gbs),
            inter_host_bw=bw(topo.inter_host_bandwidth_gbs),
        ),
        kernel_config=KernelConfig(compute_device=device_type),
    )
    storage = topology.devices[0].storage
    resolved["device_memory_gib"] = round(storage.hbm / GIB, 2)
    resolved["host_memory_gib"] = round(storage.ddr / GIB, 2)
    resolved["storage_reservation"] = f"{topo.storage_reservation.value} {topo.reservation_percentage:.0%}"
    return topology, resolved


# ------------------------------------------------------------------------------ constraints
def build_constraints(
    cfg: DictConfig, tables: list[EmbeddingBagConfig], pooling: dict[str, float]
) -> dict[str, ParameterConstraints]:
    """One ParameterConstraints per table: the group-wide types/kernels, the data's pooling
    factors, then every ``sharding.tables`` entry whose glob matches, in order."""
    names = [t.name for t in tables]
    overrides = cast(list[dict[str, Any]], OmegaConf.to_container(cfg.tables, enum_to_str=True))  # a list node
    for i, override in enumerate(overrides):
        if not fnmatch.filter(names, override["match"]):
            raise ValueError(
                f"sharding.tables[{i}].match={override['match']} matches no table; tables are: {', '.join(names)}"
            )
    constraints = {}
    for t in tables:
        fields: dict[str, Any] = {
            "sharding_types": [s.value for s in cfg.types] or None,
            "compute_kernels": list(cfg.compute_kernels) or None,
            "pooling_factors": [float(pooling.get(f, 1.0)) for f in t.feature_names],
        }
        for override in overrides:
            if fnmatch.fnmatchcase(t.name, override["match"]):
                fields.update({k: v for k, v in override.items() if v is not None and k != "match"})
        if fields.get("cache_params") is not None:
            cache = {k: v for k, v in fields["cache_params"].items() if v is not None}
            if "algorithm" in cache:
                cache["algorithm"] = FbgemmCacheAlgorithm[cache["algorithm"].upper()]
            fields["cache_params"] = CacheParams(**cache)
        constraints[t.name] = ParameterConstraints(**fields)
    return constraints


# ------------------------------------------------------------------------------ planning
@dataclass
class PlanRecorder(Stats):
    """A planner ``Stats`` hook (TorchRec's extension point for plan reporting) that keeps the
    chosen sharding options with their storage and cost estimates."""

    best_plan: list[ShardingOption] = field(default_factory=list)
    topology: Optional[Topology] = None
    num_proposals: int = 0
    run_time: float = 0.0

    def log(
        self,
        sharding_plan,
        topology,
        batch_size,
        storage_reservation,
        num_proposals,
        num_plans,
        run_time,
        best_plan,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        self.best_plan, self.topology = list(best_plan), topology
        self.num_proposals, self.run_time = num_proposals, run_time


def make_planner(
    topo: DictConfig,
    topology: Topology,
    local_batch_size: int,
    constraints: dict[str, ParameterConstraints],
) -> tuple[EmbeddingShardingPlanner, PlanRecorder]:
    reservation = (
        # TorchRec's heuristic reserves for DDP gradients of the dense part and warns that it
        # over-estimates; with FSDP2 dense parameters TorchRec advises a fixed percentage.
        FixedPercentageStorageReservation(percentage=topo.reservation_percentage)
        if topo.storage_reservation == StorageReservation.fixed
        else HeuristicalStorageReservation(percentage=topo.reservation_percentage)
    )
    recorder = PlanRecorder()
    planner = EmbeddingShardingPlanner(
        topology=topology,
        batch_size=local_batch_size,
        constraints=constraints,
        storage_reservation=reservation,
        stats=recorder,
    )
    return planner, recorder


@dataclass(frozen=True)
class PlanInputs:
    """What the planner needs besides the model, and nothing more: built once per run
    (``hybridrec.training.build.plan_inputs``) for the ranks and for the dry plan before launch."""

    sharding: DictConfig
    """The ``sharding`` config (ShardingConfig): types, kernels and per-table constraints."""
    topology: DictConfig
    """The ``topology`` config (TopologyConfig): memory, bandwidth, storage reservation."""
    dims: ParallelDims
    local_batch: int
    """Rows per rank per step: the planner sizes input and output buffers by it."""
    pooling: dict[str, float]
    """Mean ids per row of each feature, measured from the data."""
    sparse_optimizer: str
    """The fused optimizer's class: some shardings change its math (``optimizer_notes``)."""


def plan_tables(
    model: Ranker,
    inputs: PlanInputs,
    sharder: list,
    pg: Optional[dist.ProcessGroup] = None,
    detect: bool = True,
) -> tuple[ShardingPlan, Optional[dict[str, Any]]]:
    """The plan for ``model``'s tables and its report (the report on the planning rank only).

    With ``pg``: planned on rank 0 and broadcast (``collective_plan``), so every rank shards
    alike. Without: planned locally, for the dry run and the pre-launch check. With
    mesh.embedding_replicas > 1 the plan is one sharding group's (DMPCollection's input).
    """
    topology, info = build_topology(inputs.topology, inputs.dims, detect)
    tables = table_configs(model.sparse_module())
    constraints = build_constraints(inputs.sharding, tables, inputs.pooling)
    if topology.compute_device == "cpu" and isinstance(model.sparse_module(), EmbeddingCollection):
        _no_cpu_data_parallel(constraints)
    planner, recorder = make_planner(inputs.topology, topology, inputs.local_batch, constraints)
    sharding_plan = _plan(planner, model, sharder, pg)
    if not recorder.best_plan:  # a rank that received the plan by broadcast
        return sharding_plan, None
    report = plan_report(recorder, info)
    report["notes"] = optimizer_notes(report, inputs.sparse_optimizer)
    return sharding_plan, report


def _no_cpu_data_parallel(constraints: dict[str, ParameterConstraints]) -> None:
    """fbgemm's CPU kernel for data-parallel tables (DenseTableBatchedEmbeddingBagsCodegen)
    pools every row's ids whatever its pooling mode, so an EmbeddingCollection's table (one
    vector per id) cannot be data-parallel on CPU: the planner is given every other type."""
    dp = ShardingType.DATA_PARALLEL.value
    for name, c in constraints.items():
        allowed = [t for t in (c.sharding_types or [t.value for t in ShardingType]) if t != dp]
        if not allowed:
            raise PlanError(
                f"table {name} cannot be data-parallel on CPU: fbgemm's CPU kernel for data-parallel "
                f"tables pools the ids of a row, and this model looks up one vector per id. Use "
                f"sharding=row_wise, table_wise or auto"
            )
        c.sharding_types = allowed


_COLUMN_SPLITS = {"column_wise", "table_column_wise", "grid_shard"}


def optimizer_notes(report: dict[str, Any], sparse_optimizer: str) -> list[str]:
    """What the plan changes in the optimizer's math. A row-wise optimizer keeps one
    accumulator per row *per shard*: on a table split by columns, each column shard averages
    the squared gradient over its own columns only, so training differs from one process."""
    if "RowWise" not in sparse_optimizer:
        return []
    split = [n for n, p in report["tables"].items() if p["sharding_type"] in _COLUMN_SPLITS and len(p["ranks"]) > 1]
    if not split:
        return []
    return [
        f"{', '.join(split)}: split by columns under {sparse_optimizer.split('.')[-1]}, which "
        f"then keeps a per-row accumulator per column shard; results differ from unsharded "
        f"training. Element-wise Adagrad/Adam/SGD are exact, or forbid column splits for these "
        f"tables (sharding.tables)."
    ]


def _plan(
    planner: EmbeddingShardingPlanner,
    module: Ranker,
    sharder: list,
    pg: Optional[dist.ProcessGroup],
) -> ShardingPlan:
    try:
        if pg is None:
            return planner.plan(module, sharder)
        return planner.collective_plan(module, sharder, pg)
    except PlannerError as e:
        raise PlanError(explain_planner_error(e, planner, module, sharder)) from e


def explain_planner_error(error: PlannerError, planner: EmbeddingShardingPlanner, module: Ranker, sharder: list) -> str:
    """Turn TorchRec's PlannerError into what the user needs: which tables, how many GiB are
    missing and which knobs would make the plan fit. TorchRec's own text follows."""
    topology: Topology = planner_topology(planner)
    options = planner_options(planner, module, sharder)
    by_table: dict[str, list[ShardingOption]] = {}
    for so in options:
        by_table.setdefault(so.name, []).append(so)
    tables = [t.name for t in table_configs(module.sparse_module())]
    lines = ["the embedding planner found no plan."]
    if missing := [t for t in tables if t not in by_table]:
        lines.append(
            f"No sharding option satisfies the constraints of: {', '.join(missing)} "
            f"(check sharding.types, sharding.compute_kernels and sharding.tables for them: "
            f"a type/kernel pair they cannot take, e.g. data_parallel needs the `dense` kernel)."
        )
    # TorchRec's reservation (either policy) is taken from device memory only.
    pct_hbm = planner_reserved_share(planner)
    gpu = topology.compute_device in ("cuda", "mtia")
    tiers = [("hbm", "device", "device_memory_gb")] if gpu else []
    tiers.append(("ddr", "host", "host_memory_gb"))
    short = False
    for tier, memory, knob in tiers:
        # Lower bounds, as TorchRec's own: each table in its cheapest option for this tier,
        # against what the ranks offer after the storage reservation.
        pct = pct_hbm if tier == "hbm" else 0.0
        need = sum(min(getattr(so.total_storage, tier) for so in opts) for opts in by_table.values())
        per_rank = getattr(topology.devices[0].storage, tier) * (1 - pct)
        have = per_rank * topology.world_size
        if need <= have:
            continue
        short = True
        ranks = math.ceil(need / per_rank) if per_rank else "more"
        fix = [
            f"at least {ranks} ranks (topology.world_size={ranks})",
            f"topology.{knob} >= {math.ceil(need / topology.world_size / (1 - pct) / GIB)}",
        ]
        if tier == "hbm":
            fix.append("host memory for the largest tables (sharding.compute_kernels=[fused,fused_uvm_caching])")
        reserved = f" (after the {pct:.0%} reservation)" if pct else ""
        lines.append(
            f"The tables need at least {need / GIB:.1f} GiB of {memory} memory; "
            f"{topology.world_size} rank(s) x {per_rank / GIB:.1f} GiB usable{reserved} = "
            f"{have / GIB:.1f} GiB: short by {(need - have) / GIB:.1f} GiB. "
            f"It would fit with " + ", or ".join(fix) + "."
        )
    if not short and not missing:
        # Enough memory in total, but some table has no option whose shards fit on a rank.
        tier, memory, knob = tiers[0]
        per_rank = getattr(topology.devices[0].storage, tier) * (1 - (pct_hbm if tier == "hbm" else 0.0))
        largest = {
            name: min(max(getattr(s.storage, tier) for s in so.shards) for so in opts)
            for name, opts in by_table.items()
        }
        worst = max(largest, key=largest.__getitem__)
        lines.append(
            f"In total the tables fit, but no placement does: {worst}'s smallest shard needs "
            f"{largest[worst] / GIB:.1f} GiB of {memory} memory and a rank offers "
            f"{per_rank / GIB:.1f} GiB. Allow a type that splits it (row_wise, column_wise, "
            f"table_row_wise, as sharding.tables=[{{match:{worst},sharding_types:[row_wise]}}]) "
            f"or raise topology.{knob}."
        )
    lines.append(f"TorchRec says: {error}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ report
def plan_report(recorder: PlanRecorder, topology_info: dict[str, Any]) -> dict[str, Any]:
    """Per table and per rank: placement and the planner's memory and cost estimates."""
    topology = recorder.topology
    assert topology is not None  # the planner's log call sets it with best_plan, which this rank has
    world = topology.world_size
    est = [{"device_bytes": 0, "host_bytes": 0, "step_ms": 0.0} for _ in range(world)]
    tables = {}
    natural = lambda so: [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", so.name)]
    for so in sorted(recorder.best_plan, key=natural):
        for shard in so.shards:
            est[shard.rank]["device_bytes"] += shard.storage.hbm
            est[shard.rank]["host_bytes"] += shard.storage.ddr
            est[shard.rank]["step_ms"] += shard.perf.total
        rows, dim = so.tensor.shape
        tables[so.name] = {
            "rows": rows,
            "dim": dim,
            "sharding_type": so.sharding_type,
            "compute_kernel": so.compute_kernel,
            "ranks": [s.rank for s in so.shards],
            "est_device_bytes": so.total_storage.hbm,
            "est_host_bytes": so.total_storage.ddr,
        }
    ranks = [
        {
            "rank": r,
            "est_device_bytes": e["device_bytes"],
            "device_capacity_bytes": topology.devices[r].storage.hbm,
            "est_host_bytes": e["host_bytes"],
            "host_capacity_bytes": topology.devices[r].storage.ddr,
            "est_step_ms": round(e["step_ms"], 4),
        }
        for r, e in enumerate(est)
    ]
    return {
        "topology": topology_info,
        "tables": tables,
        "ranks": ranks,
        "planner": {"proposals": recorder.num_proposals, "seconds": round(recorder.run_time, 2)},
    }


def format_report(report: dict[str, Any]) -> str:
    """The plan as the tables a person reads at start-up (device columns only for GPU plans)."""
    gib = lambda b: f"{b / GIB:,.2f}"
    t = report["topology"]
    gpu = t["compute_device"] != "cpu"
    device = f"device {t['device_memory_gib']} GiB ({t['device_memory']}), " if gpu else ""
    out = [
        f"Embedding plan: {t['world_size']} rank(s), {t['local_world_size']} per node, "
        f"{t['compute_device']}, {device}host {t['host_memory_gib']} GiB ({t['host_memory']}), "
        f"reservation {t['storage_reservation']}",
    ]
    if "sharding_group_size" in t:
        out.append(
            f"2D: sharding groups of {t['sharding_group_size']} rank(s) ({t['sharding_group_per_node']} "
            f"per node), replica groups of {t['replica_group_size']} rank(s); below, one sharding "
            f"group (its ranks 0..{t['sharding_group_size'] - 1}), which every replica repeats"
        )
    out += [
        f"{'table':<12}{'rows x dim':>18}  {'sharding':<18}{'kernel':<18}"
        + (f"{'device GiB':>11}" if gpu else "")
        + f"{'host GiB':>10}  ranks",
    ]
    for name, p in report["tables"].items():
        ranks = sorted(set(p["ranks"]))
        shown = ",".join(map(str, ranks)) if len(ranks) <= 8 else f"{ranks[0]}..{ranks[-1]} ({len(ranks)} ranks)"
        out.append(
            f"{name:<12}{p['rows']:>11,} x {p['dim']:<4}  {p['sharding_type']:<18}{p['compute_kernel']:<18}"
            + (f"{gib(p['est_device_bytes']):>11}" if gpu else "")
            + f"{gib(p['est_host_bytes']):>10}  {shown}"
        )
    out.append(
        f"{'rank':<6}"
        + (f"{'device GiB est / capacity':>28}" if gpu else "")
        + f"{'host GiB est / capacity':>28}{'est. step ms':>14}"
    )
    for r in report["ranks"]:
        dev = f"{gib(r['est_device_bytes'])} / {gib(r['device_capacity_bytes'])}"
        host = f"{gib(r['est_host_bytes'])} / {gib(r['host_capacity_bytes'])}"
        out.append(f"{r['rank']:<6}" + (f"{dev:>28}" if gpu else "") + f"{host:>28}{r['est_step_ms']:>14.3f}")
    offloaded = [n for n, p in report["tables"].items() if "uvm" in p["compute_kernel"]]
    if offloaded:
        host = sum(report["tables"][n]["est_host_bytes"] for n in offloaded)
        out.append(
            f"Offloaded to host memory behind a device cache: {', '.join(offloaded)} "
            f"({gib(host)} GiB of host memory; their lookups cost more, see est. step ms)."
        )
    out.append(f"Planner: {report['planner']['proposals']} proposals in {report['planner']['seconds']} s")
    out += [f"Note: {note}" for note in report.get("notes", [])]
    return "\n".join(out)
