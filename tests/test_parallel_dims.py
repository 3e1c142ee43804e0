"""ParallelDims: one layout, the same before launch and in every rank; the 2D sync has one owner."""

import pytest
import torch

from conftest import compose_cfg
from hybridrec.config import DenseParallel
from hybridrec.parallel.devices import Cuda, device_type, pick_device
from hybridrec.parallel.distributed import LaunchError, LocalLayout, backend, local_layout
from hybridrec.parallel.parallel_dims import ParallelDims, job_dims, planning_dims, rank_dims
from hybridrec.run.preflight import device_choice

pytestmark = pytest.mark.unit


def test_the_launcher_and_the_ranks_see_the_same_layout():
    cfg = compose_cfg(["mesh=hsdp", "launcher.nproc_per_node=4"])
    before = job_dims(cfg, world_size=8, env={})  # 2 nodes x 4 (a submitit job)
    inside = rank_dims(cfg, 8, torch.device("cpu"), env={"LOCAL_WORLD_SIZE": "4"})
    assert before == inside
    assert (inside.replicate, inside.shard, inside.local_world_size) == (2, 4, 4)
    # under torchrun, its environment is the truth
    torchrun = {"RANK": "0", "WORLD_SIZE": "8", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "8"}
    assert job_dims(cfg, 8, env=torchrun).local_world_size == 8


def test_srun_ranks_find_their_node_layout_or_are_refused():
    srun = {"RANK": "5", "WORLD_SIZE": "7", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_TASKS_PER_NODE": "4,3"}
    assert local_layout(srun) == LocalLayout(rank=1, world_size=3)
    assert local_layout({**srun, "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_NODEID": "1"}).world_size == 4
    # RANK set by hand, no local layout: never every rank on cuda:0, never "one node"
    with pytest.raises(LaunchError, match="LOCAL_RANK and LOCAL_WORLD_SIZE"):
        local_layout({"RANK": "3", "WORLD_SIZE": "8"})
    with pytest.raises(LaunchError):
        rank_dims(compose_cfg([]), 8, torch.device("cpu"), env={"RANK": "3", "WORLD_SIZE": "8"})
    assert local_layout({}) == LocalLayout(0, 1)  # a single process


NO_CUDA_BUILD, NO_GPU, FOUR_GPUS = Cuda(None, 0), Cuda("12.8", 0), Cuda("12.8", 4)


def test_the_device_is_chosen_loudly_never_silently():
    auto = compose_cfg([])
    assert "CPU-only build" in device_choice(auto, job_dims(auto, 1, {}), NO_CUDA_BUILD)
    assert "no usable GPU" in device_choice(auto, job_dims(auto, 1, {}), NO_GPU)
    assert device_type(auto, FOUR_GPUS) == "cuda" and device_type(auto, NO_GPU) == "cpu"
    cuda = compose_cfg(["launcher.device=cuda"])
    for machine, why in ((NO_CUDA_BUILD, "CPU-only build"), (NO_GPU, "no usable GPU")):
        with pytest.raises(ValueError, match=f"launcher.device=cuda but .*{why}"):
            device_choice(cuda, job_dims(cuda, 1, {}), machine)
    eight = compose_cfg(["launcher.device=cuda", "launcher.nproc_per_node=8"])
    with pytest.raises(ValueError, match=r"8 ranks per node .* but 4 GPU\(s\) visible"):
        device_choice(eight, job_dims(eight, 8, {}), FOUR_GPUS)
    assert "4 of 4 GPU(s)" in device_choice(cuda, ParallelDims.build(cuda.mesh, 4, 4, "cuda"), FOUR_GPUS)


def test_each_local_rank_gets_its_own_gpu():
    cfg = compose_cfg(["launcher.device=cuda"])
    env = {"RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4"}
    assert pick_device(cfg, env, FOUR_GPUS) == torch.device("cuda", 2)
    with pytest.raises(LaunchError, match="local rank 2 has no GPU: 2 visible"):
        pick_device(cfg, env, Cuda("12.8", 2))
    assert pick_device(compose_cfg([]), env, NO_CUDA_BUILD) == torch.device("cpu")


def test_cpu_offload_on_cuda_gets_a_gloo_backend_for_cpu_tensors():
    assert backend(torch.device("cpu")) == "gloo"
    assert backend(torch.device("cuda", 0)) == "nccl"
    # FSDP2's CPU offload clips gradients that live on the CPU: NCCL cannot reduce them
    assert backend(torch.device("cuda", 0), cpu_offload=True) == "cuda:nccl,cpu:gloo"


def test_planning_dims_take_the_mesh_planning_keys():
    cfg = compose_cfg(
        [
            "topology.world_size=64",
            "topology.local_world_size=8",
            "topology.compute_device=cuda",
            "mesh.embedding_replicas=4",
        ]
    )
    d = planning_dims(cfg)
    assert (d.world_size, d.local_world_size, d.device_type) == (64, 8, "cuda")
    assert (d.embedding_group, d.embedding_group_per_node) == (16, 2)


@pytest.mark.parametrize(
    "overrides,world,local,message",
    [
        (["mesh=hsdp", "mesh.replicate=3"], 8, 8, r"replicate x mesh.shard = world_size"),
        (["mesh.embedding_replicas=3"], 8, 8, r"embedding_replicas=3 must be >= 1 and divide the world size 8"),
        (["mesh.embedding_replicas=3"], 12, 4, r"one must divide the other"),
    ],
)
def test_inconsistent_degrees_are_refused_naming_the_keys(overrides, world, local, message):
    with pytest.raises(ValueError, match=message):
        ParallelDims.build(compose_cfg(overrides).mesh, world, local, "cuda")


def test_the_2d_sync_has_one_owner():
    """TorchRec's sparse-dist pipeline would sync a DMPCollection itself every batch
    (dmp_collection_sync_interval_batches=1 by default): hybridrec turns that off and syncs in
    after_step, every mesh.embedding_sync_every steps and after the last."""
    from hybridrec.config import Pipeline
    from hybridrec.parallel.parallelize import Parallelized

    class Replicas(torch.nn.Module):
        syncs: list = []

        def sync(self):
            self.syncs.append(self.step)

    model = Replicas()
    p = Parallelized(
        model,
        None,
        ParallelDims.build(compose_cfg([]).mesh, 1, 1, "cpu"),
        sync_every=3,
        dense_parameters=0,
        dense=DenseParallel.single,
    )
    for step in range(1, 8):
        model.step = step
        p.after_step(step, last=step == 7)
    assert model.syncs == [3, 6, 7]
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    pipeline = p.pipeline(Pipeline.sparse_dist, optimizer, torch.device("cpu"))
    assert pipeline._dmp_collection_sync_interval_batches is None


@pytest.mark.parametrize(
    "overrides, world, expected",
    [
        (["mesh=fsdp"], 1, "single"),  # no peer: FSDP2 would only add its per-step work
        (["mesh=ddp"], 1, "single"),
        (["mesh=fsdp"], 2, "fsdp"),
        (["mesh=ddp"], 2, "ddp"),
        (["mesh=hsdp"], 4, "hsdp"),
        (["mesh=single"], 1, "single"),
        # mixed precision on one rank: autocast, no FSDP2; its CPU offload is more than communication
        (["mesh=fsdp", "mesh.param_dtype=bfloat16", "mesh.reduce_dtype=float32"], 1, "single"),
        (["mesh=fsdp", "mesh.param_dtype=bfloat16", "mesh.reduce_dtype=float32"], 2, "fsdp"),
        (["mesh=fsdp", "mesh.cpu_offload=true"], 1, "fsdp"),
    ],
)
def test_the_dense_wrapper_a_job_runs(overrides, world, expected):
    from hybridrec.parallel.parallelize import dense_mode

    assert dense_mode(compose_cfg(overrides).mesh, world).value == expected
