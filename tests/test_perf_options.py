"""Performance options: intra-op threads per rank, torch.compile of the dense blocks, and the
cost of the embedding init on a column shard."""

import contextlib
import os

import pytest
import torch

from conftest import compose_cfg
from dist_helpers import spawn
from hybridrec.run.rank import idle_cores, intra_op_threads

BASE = [
    "+experiment=ctr",
    "data.num_embeddings_per_feature=[500,200,100]",
    "model.embedding_dim=16",
    "model.dense_arch_layer_sizes=[32,16]",
    "model.over_arch_layer_sizes=[32,1]",
    "data.batch_size=64",
    "train.steps=6",
    "train.eval_every=0",
    "data.eval_batches=1",
    "mesh=single",
]


@pytest.mark.unit
def test_threads_per_rank_split_the_cores_unless_set(tmp_path, monkeypatch):
    cores = len(os.sched_getaffinity(0))
    all_idle = lambda cpus: float(len(cpus))
    assert intra_op_threads(compose_cfg(["launcher.threads_per_rank=3"]), {}) == 3
    # split between the node's ranks, whatever their device (GPU ranks share the host's cores too)
    two = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert intra_op_threads(compose_cfg([]), two, all_idle) == max(1, cores // 2)
    assert intra_op_threads(compose_cfg(["launcher.device=cuda"]), two, all_idle) == max(1, cores // 2)
    assert intra_op_threads(compose_cfg([]), {"OMP_NUM_THREADS": "1"}) is None  # the user's choice stands
    # no more than the cores idle now: a busy neighbour's core is not counted
    assert intra_op_threads(compose_cfg([]), {}, lambda cpus: len(cpus) - 1.0) == max(1, cores - 1)
    assert intra_op_threads(compose_cfg([]), {}, lambda cpus: 0.1) == 1
    assert intra_op_threads(compose_cfg([]), {}, lambda cpus: None) == cores  # not measurable: the split
    # the counters: two samples of /proc/stat's per-CPU lines, the window apart
    import hybridrec.run.rank as rank

    samples = iter([{0: (100, 200), 1: (100, 200)}, {0: (100, 300), 1: (200, 300)}])  # cpu0 busy, cpu1 idle
    monkeypatch.setattr(rank, "_cpu_ticks", lambda stat, cpus: next(samples))
    assert idle_cores([0, 1], window_s=0) == 1.0
    monkeypatch.undo()
    assert idle_cores([0], window_s=0, stat=str(tmp_path / "none")) is None


def compiled_losses(cfg, run_dir):
    """Per-step losses, and the graphs dynamo made for this run: its caches are cleared
    first, as in a new process (the pool's rank runs scenarios of other tests too)."""
    from torch._dynamo.utils import counters

    from dist_helpers import _train_each

    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]

    def collect(trainer, summary):
        return {"losses": list(trainer.losses), "graphs": counters["stats"]["unique_graphs"] - before}

    return _train_each([cfg], run_dir, collect)[0]


@pytest.mark.dist
def test_compiled_dense_blocks_train_like_eager(tmp_path):
    """mesh.compile=true really compiles (dynamo makes graphs) and trains to the eager losses
    (inductor may reorder float sums: close, not bit-equal). Over 20 s where inductor's cache
    is cold: it compiles C++ kernels."""
    eager = spawn(compiled_losses, 1, compose_cfg(BASE), str(tmp_path / "eager"))
    compiled = spawn(compiled_losses, 1, compose_cfg(BASE + ["mesh.compile=true"]), str(tmp_path / "compiled"))
    assert eager["graphs"] == 0 and compiled["graphs"] >= 2  # one per dense block at least
    torch.testing.assert_close(torch.tensor(compiled["losses"]), torch.tensor(eager["losses"]), rtol=0, atol=1e-5)


@pytest.mark.unit
def test_a_column_shard_draws_only_its_own_columns(monkeypatch):
    """The embedding init of a column shard is the full table's slice, and costs its own
    width only: a 4-way column split does not draw the full table on every rank."""
    import hybridrec.parallel.parallelize as par

    rows, dim = 70_000, 256  # two row blocks, eight column chunks
    full = torch.empty(rows, dim)
    for r, c, values in par.table_blocks(3, "t", rows, dim, 0, rows, 0, dim):
        full[r : r + values.size(0), c : c + values.size(1)] = values
    drawn = []
    draw = par._draw
    monkeypatch.setattr(par, "_draw", lambda *a: drawn.append(a[1] * a[2]) or draw(*a))
    shard = torch.full((rows - 1000, 64), float("nan"))  # rows 1000.., columns 128..192
    for r, c, values in par.table_blocks(3, "t", rows, dim, 1000, rows, 128, 192):
        shard[r : r + values.size(0), c : c + values.size(1)] = values
    assert torch.equal(shard, full[1000:, 128:192])
    assert sum(drawn) == rows * 64  # the shard's 64 columns of both row blocks, nothing wider


@pytest.mark.unit
def test_units_resharding_to_n_ranks_share_one_mesh():
    """reshard_after_forward=2 on a 4-rank mesh: FSDP2 would build one 2-rank DeviceMesh (new
    communicators) per unit; every unit shares one. A fake 4-rank group, in this process."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hybridrec.base.compat import one_post_forward_mesh

    def post_forward_meshes(shared: bool) -> set[int]:
        mesh = init_device_mesh("cpu", (4,))
        units = [torch.nn.Linear(8, 8) for _ in range(3)]
        with one_post_forward_mesh() if shared else contextlib.nullcontext():
            for unit in units:
                fully_shard(unit, mesh=mesh, reshard_after_forward=2)
        return {id(u._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info.mesh) for u in units}

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        assert len(post_forward_meshes(shared=False)) == 3  # FSDP2 alone: one mesh per unit
        assert len(post_forward_meshes(shared=True)) == 1
    finally:
        dist.destroy_process_group()
