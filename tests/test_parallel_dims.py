"""ParallelDims: one layout, the same before launch and in every rank; the 2D sync has one owner."""

import pytest
import torch
from conftest import compose_cfg

from hybridrec.parallel_dims import ParallelDims, job_dims, planning_dims, rank_dims

pytestmark = pytest.mark.unit


def test_the_launcher_and_the_ranks_see_the_same_layout():
    cfg = compose_cfg(["mesh=hsdp", "launcher.nproc_per_node=4"])
    before = job_dims(cfg, world_size=8, env={})  # 2 nodes x 4 (a submitit job)
    inside = rank_dims(cfg, 8, torch.device("cpu"), env={"LOCAL_WORLD_SIZE": "4"})
    assert before == inside
    assert (inside.replicate, inside.shard, inside.local_world_size) == (2, 4, 4)
    # under torchrun, its environment is the truth
    assert job_dims(cfg, 8, env={"LOCAL_WORLD_SIZE": "8"}).local_world_size == 8


def test_planning_dims_take_the_mesh_planning_keys():
    cfg = compose_cfg(["mesh.world_size=64", "mesh.local_world_size=8", "mesh.compute_device=cuda",
                       "mesh.embedding_replicas=4"])
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
    from hybridrec.parallelize import Parallelized

    class Replicas(torch.nn.Module):
        syncs: list = []

        def sync(self):
            self.syncs.append(self.step)

    model = Replicas()
    p = Parallelized(model, None, ParallelDims.build(compose_cfg([]).mesh, 1, 1, "cpu"), sync_every=3)
    for step in range(1, 8):
        model.step = step
        p.after_step(step, last=step == 7)
    assert model.syncs == [3, 6, 7]
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    pipeline = p.pipeline(Pipeline.sparse_dist, optimizer, torch.device("cpu"))
    assert pipeline._dmp_collection_sync_interval_batches is None
