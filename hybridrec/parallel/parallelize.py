"""The only place where hybridrec shards a model.

Order, fixed for every model:
  1. fuse the sparse optimizer into the embedding backward (TorchRec needs it before sharding);
  2. plan the embedding tables with TorchRec's planner (identical plan on every rank);
  3. DistributedModelParallel shards the tables and hands the rest of the model to our
     data-parallel wrapper, which applies FSDP2 ``fully_shard`` to each dense unit (or DDP);
     with mesh.embedding_replicas = R > 1 it is TorchRec's DMPCollection (2D): the plan of
     step 2 is one sharding group's, applied to each of the R groups, while the dense
     wrapper still spans all ranks (DMPCollection passes the global group to it);
  4. initialize the embedding shards from the seed, independently of the plan.
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence, cast

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor
from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs_registry
from torchrec.distributed.model_parallel import (
    DataParallelWrapper,
    DefaultDataParallelWrapper,
    DistributedModelParallel,
    DMPCollection,
)
from torchrec.distributed.train_pipeline import TrainPipeline, TrainPipelineBase, TrainPipelineSparseDist
from torchrec.distributed.types import ShardingEnv
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from hybridrec.base.compat import ShardedTensor, dmp_root, floating_to, one_post_forward_mesh, pipeline_model
from hybridrec.config import (
    CommPrecision,
    DenseParallel,
    FSDPUnits,
    Pipeline,
)
from hybridrec.models import Ranker
from hybridrec.parallel.optim import TrainOptimizer, sparse_optimizer
from hybridrec.parallel.parallel_dims import ParallelDims
from hybridrec.parallel.sharding import PlanInputs, plan_tables, sharders

if TYPE_CHECKING:
    from torchrec.distributed.shards_wrapper import LocalShardsWrapper


class FSDP2Wrapper(DataParallelWrapper):
    """Shards the model's dense units with FSDP2 (``fully_shard``), on a 1-D mesh (fsdp) or a
    2-D replicate x shard mesh (hsdp).

    DMP calls ``wrap`` once the tables are sharded. TorchRec's default wrapper puts the rest of
    the model in DDP, which fails on FSDP2's DTensor parameters, so this one applies
    ``fully_shard`` to the units the model names (its MLPs / cross network) and leaves the
    tables alone. Data-parallel tables need nothing here: TorchRec wraps their lookups in DDP
    itself (ShardedEmbeddingBagCollection.init_data_parallel).
    """

    def __init__(self, mesh_cfg: DictConfig, dims: ParallelDims) -> None:
        self.cfg, self.dims = mesh_cfg, dims

    def device_mesh(self, env: ShardingEnv, device: torch.device) -> DeviceMesh:
        if self.cfg.dense == DenseParallel.hsdp:
            # The dense side spans every rank (under 2D too, where env is one sharding group's).
            return init_device_mesh(
                device.type, (self.dims.replicate, self.dims.shard), mesh_dim_names=("replicate", "shard")
            )
        return DeviceMesh.from_group(env.process_group, device.type)

    def wrap(self, dmp: DistributedModelParallel, env: ShardingEnv, device: torch.device) -> None:
        cfg = self.cfg
        dtype = lambda d: None if d is None else getattr(torch, d.value)
        kwargs = dict(
            mesh=self.device_mesh(env, device),
            reshard_after_forward=cfg.reshard_after_forward,
            # Outputs back in fp32: they meet fp32 embeddings in the interaction and the loss.
            mp_policy=MixedPrecisionPolicy(
                param_dtype=dtype(cfg.param_dtype),
                reduce_dtype=dtype(cfg.reduce_dtype),
                output_dtype=torch.float32 if cfg.param_dtype else None,
            ),
            offload_policy=CPUOffloadPolicy(pin_memory=device.type == "cuda") if cfg.cpu_offload else OffloadPolicy(),
        )
        units: list[FSDPModule] = []  # the modules whose parameters are gathered, in forward order
        # units=root: no per-block units; the root below then owns every dense parameter.
        blocks = [] if cfg.units == FSDPUnits.root else dmp.module.dense_units()
        if cfg.units == FSDPUnits.root and cfg.param_dtype:
            # A unit casts its own inputs to the compute dtype and its outputs back to fp32.
            # With one root unit only the model's input is cast: a dense block fed by the
            # fp32 embeddings (DLRM's top MLP after the interaction) would see fp32 inputs
            # with bf16 weights. Give each block the unit's casts without making it a unit.
            for block in dmp.module.dense_units():
                cast_at_boundary(block, cast(torch.dtype, dtype(cfg.param_dtype)))  # param_dtype is set here
        with one_post_forward_mesh():  # reshard_after_forward=N: one N-rank mesh for all units
            for block in blocks:
                if cfg.units == FSDPUnits.layer:
                    for layer in dense_layers(block):
                        fully_shard(layer, **kwargs)
                        units.append(cast(FSDPModule, layer))  # fully_shard made it one
                fully_shard(block, **kwargs)  # the block's own parameters (all of them in arch mode)
                if cfg.units == FSDPUnits.arch or any(True for _ in block.parameters(recurse=False)):
                    units.append(block)
        # Then the root, as torchtitan does: one root state for all units (lazy init, and
        # prefetch across blocks). The tables are TorchRec's; FSDP2 must not touch them.
        # The root gets FSDP2's own rule unless the user sets one for it: passing any value
        # (even mesh.reshard_after_forward's default True) turns off FSDP2's automatic choice,
        # which keeps the root unsharded after forward because backward needs it at once.
        # With units=root (the whole dense part in the root) an explicit True all-gathers it
        # twice per step.
        root = cast(Ranker, dmp_root(dmp))  # the model DMP was given, its tables sharded in place
        root_kwargs = {**kwargs, "reshard_after_forward": cfg.root_reshard_after_forward}
        fully_shard(root, **root_kwargs, ignored_params=set(root.sparse_module().parameters()))
        # Explicit prefetch: issue the next units' all-gathers while this one computes.
        for i, unit in enumerate(units):
            if cfg.forward_prefetch:
                unit.set_modules_to_forward_prefetch(units[i + 1 : i + 1 + cfg.forward_prefetch])
            if cfg.backward_prefetch:
                unit.set_modules_to_backward_prefetch(units[max(0, i - cfg.backward_prefetch) : i][::-1])


def cast_at_boundary(module: nn.Module, dtype: torch.dtype) -> None:
    """Floating-point inputs of ``module`` cast to ``dtype``, its outputs back to fp32: what
    FSDP2's ``MixedPrecisionPolicy(cast_forward_inputs=True, output_dtype=float32)`` does at
    a unit boundary, for a block inside a larger unit."""

    module.register_forward_pre_hook(
        lambda _m, args, kwargs: (floating_to(args, dtype), floating_to(kwargs, dtype)), with_kwargs=True
    )
    module.register_forward_hook(lambda _m, _args, out: floating_to(out, torch.float32))


class NoDataParallel(DataParallelWrapper):
    """One rank, dense modules unwrapped. With ``compute_dtype`` (mesh.param_dtype), each
    dense block runs under ``torch.autocast``: its matmuls in that dtype from the fp32 master
    weights, its outputs cast back to fp32 where they meet the fp32 embeddings and the loss,
    as FSDP2's mixed precision does at a unit boundary (``cast_at_boundary``); the weights,
    their gradients and the optimizer stay fp32."""

    def __init__(self, compute_dtype: Optional[torch.dtype] = None) -> None:
        self.compute_dtype = compute_dtype

    def wrap(self, dmp: DistributedModelParallel, env: ShardingEnv, device: torch.device) -> None:
        dmp.module.to(device)
        if self.compute_dtype is not None:
            for block in dmp.module.dense_units():
                block.forward = autocast_forward(block.forward, device.type, self.compute_dtype)


def autocast_forward(forward: Callable[..., Any], device_type: str, dtype: torch.dtype) -> Callable[..., Any]:
    """``forward`` under ``torch.autocast(device_type, dtype)``, its floating outputs in fp32.
    The block's forward, not the module, as torch.compile is applied: the module keeps its
    class and parameter names, so plans and checkpoints do not change."""

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, dtype=dtype):
            out = forward(*args, **kwargs)
        return floating_to(out, torch.float32)

    return run


def dense_layers(block: nn.Module) -> list[nn.Module]:
    """A dense block's layers in forward order: the first modules, depth first, that own
    parameters directly (Linear, ...). Parameter containers (ParameterList, as in TorchRec's
    LowRankCrossNet) have no forward of their own, so their parameters stay with the block."""
    layers = []
    for child in block.children():
        if isinstance(child, (nn.ParameterList, nn.ParameterDict)):
            continue
        if any(True for _ in child.parameters(recurse=False)):
            layers.append(child)
        else:
            layers += dense_layers(child)
    return layers


class BasePipeline(TrainPipelineBase):
    """TorchRec's plain pipeline. It never rewires the model's forward, so detaching it for
    evaluation (as TrainPipelineSparseDist needs) just hands the model back."""

    def detach(self) -> torch.nn.Module:
        return pipeline_model(self)


@dataclass
class Parallelized:
    """What ``parallelize`` gives the training loop: the sharded model, the plan report (rank
    0), the layout, and the per-step work parallelism needs beyond the pipeline."""

    model: DistributedModelParallel
    plan: dict | None
    dims: ParallelDims
    sync_every: int
    """2D: steps between replica syncs (0 = no replicas)."""
    dense_parameters: int
    """The model's parameters outside the tables (what DDP or FSDP2 holds), counted before
    sharding: the whole model's, on any world size."""
    dense: DenseParallel
    """The dense wrapper that runs (``dense_mode``): mesh.dense, or single on one rank."""

    def pipeline(
        self, kind: Pipeline, optimizer: torch.optim.Optimizer | TrainOptimizer, device: torch.device
    ) -> TrainPipeline:
        """TorchRec's train pipeline. sparse_dist overlaps the next batch's input all-to-all
        with this batch's forward/backward. Its own 2D sync is turned off: ``after_step`` is
        the one owner of the sync, so that it runs every mesh.embedding_sync_every steps
        and never twice."""
        if kind == Pipeline.sparse_dist:
            return TrainPipelineSparseDist(self.model, optimizer, device, dmp_collection_sync_interval_batches=None)
        return BasePipeline(self.model, optimizer, device)

    def after_step(self, step: int, last: bool) -> None:
        """2D: average the replicas' tables and sparse optimizer state every sync_every steps
        and after the last one (evaluation and the final checkpoint see one model)."""
        if self.sync_every and (step % self.sync_every == 0 or last):
            self.model.sync()


def dense_mode(mesh: DictConfig, world_size: int) -> DenseParallel:
    """The dense wrapper a job runs: ``mesh.dense``, except on one rank, where there is no
    peer to gather parameters from or reduce gradients with. There FSDP2 and DDP would only add
    their per-step hooks and copies (and, for FSDP2, DTensor dispatch in every optimizer op),
    about a tenth of ctr's step on one CPU rank (README, Performance), so the dense part runs
    unwrapped, as mesh=single. The result is the same model: with one rank, FSDP2's shard is
    the whole tensor and both wrappers' gradient reduction is the identity; checkpoints load
    across the change (DCP stores global tensors). Mixed precision (mesh.param_dtype) runs
    there too, by autocast around each dense block (``NoDataParallel``): the bf16 compute
    without FSDP2's per-step cost (mesh.reduce_dtype has nothing to reduce). FSDP2 stays only
    for CPU offload, which is more than communication."""
    if world_size > 1 or mesh.dense == DenseParallel.single:
        return mesh.dense
    if mesh.dense in (DenseParallel.fsdp, DenseParallel.hsdp) and mesh.cpu_offload:
        return mesh.dense
    return DenseParallel.single


def parallelize(
    model: Ranker,
    plan_inputs: PlanInputs,
    mesh: DictConfig,
    fused_optimizer: DictConfig,
    seed: int,
    device: torch.device,
    pg: dist.ProcessGroup,
) -> Parallelized:
    """Shard ``model``: tables by TorchRec's plan (``plan_inputs``), the dense part by
    ``mesh.dense`` (the ``mesh`` config, MeshConfig); ``fused_optimizer`` (optimizer.sparse)
    is fused into the tables' backward; ``seed`` initializes the embedding shards."""
    dims = plan_inputs.dims
    dense_parameters = model.dense_parameter_count()  # before DMP and FSDP2 wrap them
    cls, kwargs = sparse_optimizer(fused_optimizer)
    apply_optimizer_in_backward(cls, model.sparse_module().parameters(), kwargs)

    if mesh.compile:
        # The block's forward, not the module: DDP's and FSDP2's hooks run around the compiled
        # code (as torchtitan compiles blocks before fully_shard), and the module keeps its
        # class and parameter names, so plans and checkpoints do not change.
        for block in model.dense_units():
            block.forward = torch.compile(block.forward)
    qcomms = None
    if (mesh.embedding_comms_forward, mesh.embedding_comms_backward) != (CommPrecision.fp32,) * 2:
        qcomms = get_qcomm_codecs_registry(
            QCommsConfig(
                forward_precision=CommType(mesh.embedding_comms_forward.value),
                backward_precision=CommType(mesh.embedding_comms_backward.value),
            ),
            device=device,
        )
    sharder = sharders(qcomms)
    plan, report = plan_tables(model, plan_inputs, sharder, pg)
    dense = dense_mode(mesh, dims.world_size)
    if dense in (DenseParallel.fsdp, DenseParallel.hsdp):
        wrapper: DataParallelWrapper = FSDP2Wrapper(mesh, dims)
    elif dense == DenseParallel.ddp:
        wrapper = DefaultDataParallelWrapper()
    else:
        wrapper = NoDataParallel(None if mesh.param_dtype is None else getattr(torch, mesh.param_dtype.value))
    if dims.embedding_replicas > 1:
        dmp: DistributedModelParallel = DMPCollection(
            module=model,
            device=device,
            plan=plan,
            world_size=dims.world_size,
            sharding_group_size=dims.embedding_group,
            global_pg=pg,
            node_group_size=dims.embedding_group_per_node,  # as planned: the group's ranks per node
            sharders=sharder,
            data_parallel_wrapper=wrapper,
        )
    else:
        dmp = DistributedModelParallel(
            module=model,
            env=ShardingEnv.from_process_group(pg),
            device=device,
            plan=plan,
            sharders=sharder,
            data_parallel_wrapper=wrapper,
        )
    init_embeddings(dmp.module.sparse_module(), seed)
    return Parallelized(
        dmp, report, dims, mesh.embedding_sync_every if dims.embedding_replicas > 1 else 0, dense_parameters, dense
    )


_INIT_BLOCK = 65536  # rows per independently seeded block of the embedding init
# Columns per independently seeded chunk. TorchRec's column-wise shards are multiples of the
# planner's min_partition (128 by default), so a column shard starts and ends on a chunk
# boundary and draws only its own columns: drawing whole rows and keeping a slice cost a
# k-way column split k times the work on every rank.
_INIT_COLS = 32


@torch.no_grad()
def init_embeddings(sharded_ebc: nn.Module, seed: int) -> None:
    """Fill every local shard with values that depend only on (seed, table, row, column).

    TorchRec initializes each shard from the process's random stream, so the same seed gives
    different tables under different plans or world sizes. Here the table is split into
    blocks of rows and chunks of columns, each drawn from its own seeded generator: a shard
    draws the blocks and chunks it overlaps. Result: identical tables for any plan, which is
    what lets a 2-rank run reproduce a 1-rank run, and a run be reproduced on another cluster.

    The values are drawn on the host, on purpose: CUDA's generator gives other numbers for
    the same seed, and a GPU run must start from the tables a CPU run starts from. A GPU
    shard receives each block through pinned memory with an asynchronous copy, so drawing
    the next block overlaps the transfer of this one.
    """
    for key, weight in sharded_ebc.state_dict().items():
        table = key.split(".")[-2]
        rows, dim = weight.size()
        for (row0, col0), local in local_shards(weight):
            # Block by block into the shard: a whole-shard temporary would double the peak
            # memory of the largest table (measured: +256 MB for ctr's 1M x 64 table).
            row1, col1 = row0 + local.size(0), col0 + local.size(1)
            for r, c, values in table_blocks(seed, table, rows, dim, row0, row1, col0, col1):
                if local.is_cuda:
                    # the caching host allocator keeps the pinned block until the copy is done
                    values = values.pin_memory()
                local[r : r + values.size(0), c : c + values.size(1)].copy_(values, non_blocking=local.is_cuda)


def local_shards(tensor: Any) -> list[tuple[Sequence[int], torch.Tensor]]:
    """This rank's parts of a table's weight or optimizer state, each (its offsets in the
    whole, a tensor that aliases it): a ShardedTensor's local shards, a 2D DTensor's
    (TorchRec's LocalShardsWrapper), or a data-parallel table's full replica."""
    if isinstance(tensor, ShardedTensor):
        return [(s.metadata.shard_offsets, s.tensor) for s in tensor.local_shards()]
    if isinstance(tensor, DTensor):
        # no_grad: the wrapper itself, whose shards alias the tables
        local = cast("LocalShardsWrapper", tensor.to_local())
        return list(zip(local.local_offsets(), local.local_shards()))
    return [((0,) * tensor.dim(), tensor)]


def table_blocks(
    seed: int, table: str, rows: int, dim: int, row0: int, row1: int, col0: int, col1: int
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Rows row0..row1, columns col0..col1 of the table's init, one seeded block of rows and
    chunk of columns at a time: (row and column offset of the part within the slice, values)."""
    # TorchRec's default init distribution: uniform(+-sqrt(1 / num_embeddings)).
    bound = (1.0 / rows) ** 0.5
    table_seed = (seed * 1_000_003 + zlib.crc32(table.encode())) * 1_000_033
    chunks = range(col0 // _INIT_COLS, (col1 - 1) // _INIT_COLS + 1)
    for block in range(row0 // _INIT_BLOCK, (row1 - 1) // _INIT_BLOCK + 1):
        lo = block * _INIT_BLOCK
        n = min(_INIT_BLOCK, rows - lo)
        first, last = max(row0 - lo, 0), min(row1 - lo, n)
        for chunk in chunks:
            c0 = chunk * _INIT_COLS
            values = _draw(table_seed + block * 1_000_003 + chunk, n, min(_INIT_COLS, dim - c0), bound)
            yield max(lo - row0, 0), max(c0 - col0, 0), values[first:last, max(col0 - c0, 0) : col1 - c0]


def _draw(seed: int, rows: int, cols: int, bound: float) -> torch.Tensor:
    """One seeded chunk of the init: rows x cols uniform(-bound, bound), on the host."""
    g = torch.Generator().manual_seed(seed % 2**63)
    return torch.empty(rows, cols).uniform_(-bound, bound, generator=g)
