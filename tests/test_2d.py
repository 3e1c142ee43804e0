"""2D parallelism (mesh.embedding_replicas = R): tables sharded within groups of world_size / R
ranks and replicated across the R groups by TorchRec's DMPCollection. Checked here: the
config rules, the refusal on CPU before any rank starts, the dry-run plan for 512 ranks, and
(on 2+ GPUs only) training against a plain run."""

import json

import pytest
import torch

import commands
from conftest import compose_cfg, dry_plan_for
from hybridrec.parallel.sharding import format_report
from hybridrec.run.validation import check_device, validate


@pytest.mark.unit
@pytest.mark.parametrize(
    "overrides, world, message",
    [
        (["mesh.embedding_replicas=3"], 4, "mesh.embedding_replicas=3 must be >= 1 and divide the world size 4"),
        (["mesh.embedding_replicas=0"], 4, "mesh.embedding_replicas=0 must be >= 1"),
        (["mesh.embedding_replicas=2", "mesh.embedding_sync_every=0"], 4, "embedding_sync_every must be >= 1"),
        (["mesh.embedding_replicas=2", "checkpoint.dir=/tmp/x"], 4, "checkpoints of 2D-sharded tables"),
    ],
)
def test_replica_rules(overrides, world, message):
    with pytest.raises(ValueError, match=message):
        validate(compose_cfg(["+experiment=ctr", *overrides]), world)


@pytest.mark.unit
def test_replicas_need_cuda():
    cfg = compose_cfg(["+experiment=ctr", "mesh.embedding_replicas=2"])
    validate(cfg, 4)  # the config itself is fine ...
    check_device(cfg, "cuda")
    with pytest.raises(ValueError, match="DMPCollection .* asserts a CUDA or MTIA device"):
        check_device(cfg, "cpu")  # ... but not on CPU


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_training_refuses_replicas_on_cpu_before_starting_ranks(tmp_path):
    proc = commands.run(
        "hybridrec.train",
        "+experiment=ctr",
        "launcher.nproc_per_node=2",
        "mesh.embedding_replicas=2",
        f"hydra.run.dir={tmp_path}",
        timeout=120,
    )
    assert proc.returncode != 0
    assert "hybridrec: invalid config: mesh.embedding_replicas=2 needs CUDA" in proc.stderr
    assert "[rank" not in proc.stderr and not (tmp_path / "plan.json").exists()


@pytest.mark.slow
def test_group_layout_follows_the_nodes():
    # 8 ranks, 4 per node, 2 replicas: groups of 4 ranks, 2 of them on each node
    report = dry_plan_for(compose_cfg(["+experiment=ctr", "mesh.embedding_replicas=2"]), 8, 4, "cuda")
    t = report["topology"]
    assert (t["world_size"], t["sharding_group_size"], t["replica_group_size"], t["sharding_group_per_node"]) == (
        8,
        4,
        2,
        2,
    )
    assert len(report["ranks"]) == 4 and {r for p in report["tables"].values() for r in p["ranks"]} <= {0, 1, 2, 3}
    with pytest.raises(ValueError, match="embedding_replicas=3 with 4 ranks per node"):
        dry_plan_for(compose_cfg(["+experiment=ctr", "mesh.embedding_replicas=3"]), 12, 4, "cuda")


@pytest.mark.slow
def test_plan_cli_512_ranks_8_replicas(tmp_path):
    """DLRM-DCNv2 (MLPerf Criteo 1TB) on 64 nodes x 8 GPUs with 8 replicas: one sharding group of
    64 ranks, one per node (the replicas of a shard share a node), planned and reported.
    Over 20 s: the planner's search over 26 large tables for 64 ranks."""
    proc = commands.run(
        "hybridrec.plan",
        "+experiment=dcnv2_criteo1tb",
        "topology.world_size=512",
        "topology.local_world_size=8",
        "mesh.embedding_replicas=8",
        "topology.compute_device=cuda",
        "topology.device_memory_gb=80",
        f"hydra.run.dir={tmp_path}",
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Embedding plan: 512 rank(s), 8 per node, cuda" in proc.stdout
    assert "2D: sharding groups of 64 rank(s) (1 per node), replica groups of 8 rank(s)" in proc.stdout
    report = json.load(open(tmp_path / "plan.json"))
    assert report["topology"]["sharding_group_size"] == 64 and report["topology"]["replica_group_size"] == 8
    assert len(report["tables"]) == 26 and len(report["ranks"]) == 64  # per-rank memory of one group
    for r in report["ranks"]:
        assert r["est_device_bytes"] <= r["device_capacity_bytes"]
    # every table is held in full by each group: the group's memory covers all ~97 GiB of tables
    group_bytes = sum(r["est_device_bytes"] for r in report["ranks"])
    assert group_bytes >= sum(p["rows"] * p["dim"] * 4 for p in report["tables"].values())
    assert format_report(report).count("\n") > 26 + 64


GPUS = torch.cuda.device_count()


@pytest.mark.gpu
@pytest.mark.skipif(
    GPUS < 2,
    reason=f"2D parallelism needs 2+ CUDA GPUs (TorchRec's DMPCollection asserts "
    f"a CUDA/MTIA device); this machine has {GPUS}",
)
def test_replicated_tables_train_like_sharded_tables(tmp_path):
    """On 2 (or 4) GPUs with plain SGD and a sync after every step, 2 replica groups train
    exactly like 1-D sharding: each group's embedding gradient is its own mean-loss gradient
    (TorchRec divides by the sharding group's size) and sync() averages the groups' updates,
    which for SGD is the update of the global mean loss. Replicas end identical."""
    from dist_helpers import spawn, train_replicated

    world = 4 if GPUS >= 4 else 2
    base = [
        "data.batch_size=64",
        "data.num_embeddings_per_feature=[300,200,100,50]",
        "data.ids_per_feature=2",
        "data.eval_batches=2",
        "model.embedding_dim=8",
        "model.dense_arch_layer_sizes=[16,8]",
        "model.over_arch_layer_sizes=[16,1]",
        "train.steps=8",
        "train.log_every=1",
        "optimizer=sgd",
        "sharding=table_wise",
        "launcher.device=cuda",
    ]
    plain = compose_cfg(base)
    replicated = compose_cfg(base + ["mesh.embedding_replicas=2", "mesh.embedding_sync_every=1"])
    rarely = compose_cfg(base + ["mesh.embedding_replicas=2", "mesh.embedding_sync_every=5"])
    one, two, lazy = spawn(train_replicated, world, [plain, replicated, rarely], str(tmp_path))
    assert two["topology"]["sharding_group_size"] == world // 2 and two["topology"]["replica_group_size"] == 2
    torch.testing.assert_close(torch.tensor(two["losses"]), torch.tensor(one["losses"]), rtol=1e-4, atol=1e-5)
    assert two["eval"]["auc"] == pytest.approx(one["eval"]["auc"], abs=1e-4)
    for result in (two, lazy):  # replica groups are rank pairs (0, 1), (2, 3): identical after the final sync
        sums = result["shard_sums"]
        assert all(sums[r] == pytest.approx(sums[r + 1], rel=1e-6) for r in range(0, world, 2)), sums
    # syncing every 5 steps lets the replicas drift in between: close to, not equal to, the plain run
    assert lazy["losses"][:1] == pytest.approx(one["losses"][:1], rel=1e-4)
    assert lazy["losses"] != pytest.approx(one["losses"], rel=1e-6)
