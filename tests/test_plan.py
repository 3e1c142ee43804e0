"""Planning: per-table constraints, the plan report, clear errors, and dry runs for clusters
we do not have (DLRM-DCNv2 at MLPerf scale on 1, 8 and 64 simulated GPUs)."""

import json
import os
import re
from collections import Counter

import pytest

import commands
from conftest import compose_cfg, dry_plan_for
from hybridrec.parallel.sharding import PlanError, format_report

DCN = ["+experiment=dcnv2_criteo1tb"]
LARGEST = {"t_cat_0", "t_cat_9", "t_cat_19", "t_cat_20", "t_cat_21"}  # the 40 M-row tables


def _dcn(world, local, *overrides):
    return dry_plan_for(compose_cfg(DCN + ["topology.device_memory_gb=80", *overrides]), world, local, "cuda")


def _assert_feasible(report, world):
    assert len(report["tables"]) == 26  # every table placed
    assert len(report["ranks"]) == world
    for p in report["tables"].values():
        assert p["ranks"] and all(0 <= r < world for r in p["ranks"])
    for r in report["ranks"]:
        assert r["est_device_bytes"] <= r["device_capacity_bytes"]
        assert r["est_host_bytes"] <= r["host_capacity_bytes"]


@pytest.fixture(scope="module")
def dcn8(tmp_path_factory):
    """`python -m hybridrec.plan` of DCNv2 for 8 GPUs on one node, planned once for the tests of
    that plan (each 8-rank plan of the 26 tables takes seconds): the completed process and the
    plan.json it saved (the plan report, ``preflight.dry_plan``'s, as JSON)."""
    run = tmp_path_factory.mktemp("plan8")
    proc = commands.run(
        "hybridrec.plan",
        *DCN,
        "topology.world_size=8",
        "topology.local_world_size=8",
        "topology.device_memory_gb=80",
        f"hydra.run.dir={run}",
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, json.load(open(os.path.join(run, "plan.json")))


@pytest.mark.slow
def test_dcnv2_on_8_gpus_fits_in_device_memory(dcn8):
    _, report = dcn8
    _assert_feasible(report, 8)
    assert {p["compute_kernel"] for p in report["tables"].values()} == {"fused"}
    assert len({r for p in report["tables"].values() for r in p["ranks"]}) == 8


@pytest.mark.slow
def test_dcnv2_on_64_gpus_plans_differently(dcn8):
    """TorchRec's planner on 64 ranks: 10 s of CPU, over 20 s under coverage (its enumeration
    and partitioning grow with the ranks, and that cluster size is the subject)."""
    (_, report8), report64 = dcn8, _dcn(64, 8)
    _assert_feasible(report64, 64)
    types = lambda r: Counter(p["sharding_type"] for p in r["tables"].values())
    assert types(report64) != types(report8)
    assert len({r for p in report64["tables"].values() for r in p["ranks"]}) > 8


@pytest.mark.unit
def test_dcnv2_on_1_gpu_offloads_the_largest_tables_visibly():
    report = _dcn(1, 1)
    _assert_feasible(report, 1)
    offloaded = {n for n, p in report["tables"].items() if p["compute_kernel"] == "fused_uvm_caching"}
    assert offloaded and offloaded <= LARGEST
    host = sum(report["tables"][n]["est_host_bytes"] for n in offloaded)
    assert host > 3 * 18 * 2**30  # three 40 M x 128 fp32 tables live in host memory
    text = format_report(report)
    assert "Offloaded to host memory" in text and all(n in text for n in offloaded)


@pytest.mark.unit
def test_dcnv2_on_1_gpu_device_memory_only_does_not_fit():
    with pytest.raises(PlanError) as e:
        _dcn(1, 1, "sharding.compute_kernels=[fused]")
    msg = str(e.value)
    short = float(re.search(r"short by ([\d.]+) GiB", msg).group(1))
    assert 25 < short < 35  # ~98 GiB of tables against 68 GiB usable
    assert "topology.world_size=2" in msg and "fused_uvm_caching" in msg


@pytest.mark.unit
def test_a_table_no_rank_can_hold_is_named():
    # 20 GiB per GPU, table-wise only: the 40 M-row tables (19 GiB each) fit in total, not per rank
    with pytest.raises(PlanError, match=r"t_cat_\d+'s smallest shard needs 19\.\d GiB"):
        _dcn(8, 8, "topology.device_memory_gb=20", "sharding=table_wise", "sharding.compute_kernels=[fused]")


SMALL = [
    "data.num_embeddings_per_feature=[1000000,1000,100]",
    "model.embedding_dim=16",
    "model.dense_arch_layer_sizes=[32,16]",
]


@pytest.mark.unit
def test_auto_row_wise_when_a_table_exceeds_a_rank():
    # 1 M x 16 fp32 = 0.0596 GiB; each rank has 0.055 GiB: table-wise cannot hold it
    budget = SMALL + ["topology.host_memory_gb=0.055"]
    with pytest.raises(PlanError):
        dry_plan_for(compose_cfg(budget + ["sharding=table_wise"]), 2, 2, "cpu")
    report = dry_plan_for(compose_cfg(budget), 2, 2, "cpu")
    assert report["tables"]["t_cat_0"]["sharding_type"] == "row_wise"
    assert report["tables"]["t_cat_0"]["ranks"] == [0, 1]


@pytest.mark.unit
def test_per_table_constraints_by_name_and_glob():
    overrides = [
        "+experiment=ctr",
        "sharding.tables=[{match:t_cat_0,sharding_types:[row_wise]},"
        "{match:'t_cat_1*',compute_kernels:[fused_uvm_caching],cache_params:{load_factor:0.1}}]",
    ]
    report = dry_plan_for(compose_cfg(overrides), 2, 2, "cuda")
    tables = report["tables"]
    assert tables["t_cat_0"]["sharding_type"] == "row_wise"
    globbed = {n for n in tables if n.startswith("t_cat_1")}
    assert len(globbed) == 11
    assert {tables[n]["compute_kernel"] for n in globbed} == {"fused_uvm_caching"}
    assert {tables[n]["compute_kernel"] for n in set(tables) - globbed} == {"fused"}


@pytest.mark.unit
def test_a_sequence_item_table_is_never_data_parallel_on_cpu():
    """fbgemm's CPU kernel for data-parallel tables pools each row's ids: an
    EmbeddingCollection's table there would return one vector per row, not per id. On CPU the
    planner is not offered data_parallel for it, and asking for it alone is refused by name;
    on GPUs it stays a choice, and pooled tables keep it on CPU."""
    seq = ["+experiment=sequences"]
    report = dry_plan_for(compose_cfg([*seq, "sharding.types=[data_parallel,table_wise]"]), 2, 2, "cpu")
    assert report["tables"]["t_items"]["sharding_type"] == "table_wise"
    with pytest.raises(PlanError, match="table t_items cannot be data-parallel on CPU") as e:
        dry_plan_for(compose_cfg([*seq, "sharding=data_parallel"]), 2, 2, "cpu")
    assert "\n" not in str(e.value) and "sharding=row_wise" in str(e.value)
    report = dry_plan_for(compose_cfg([*seq, "sharding=data_parallel"]), 2, 2, "cuda")
    assert report["tables"]["t_items"]["sharding_type"] == "data_parallel"
    report = dry_plan_for(compose_cfg(["+experiment=movielens", "sharding=data_parallel"]), 2, 2, "cpu")
    assert {t["sharding_type"] for t in report["tables"].values()} == {"data_parallel"}


@pytest.mark.unit
def test_constraint_that_matches_no_table_is_an_error():
    with pytest.raises(ValueError, match=r"sharding.tables\[0\].match=t_cat_99 matches no table"):
        dry_plan_for(compose_cfg(SMALL + ["sharding.tables=[{match:t_cat_99,min_partition:4}]"]), 1, 1, "cpu")


@pytest.mark.slow
def test_plan_cli_saves_the_plan_and_explains_failure(dcn8, tmp_path):
    ok, plan = dcn8
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "Embedding plan: 8 rank(s), 8 per node, cuda" in ok.stdout
    assert len(plan["tables"]) == 26
    bad = commands.run(
        "hybridrec.plan",
        *DCN,
        "topology.world_size=1",
        "topology.device_memory_gb=80",
        "sharding.compute_kernels=[fused]",
        f"hydra.run.dir={tmp_path}",
        timeout=120,
    )
    assert bad.returncode != 0 and "short by" in bad.stderr


@pytest.mark.slow
def test_training_refuses_a_config_with_no_plan_before_starting_ranks(tmp_path):
    proc = commands.run(
        "hybridrec.train",
        *SMALL,
        "topology.host_memory_gb=0.055",
        "sharding=table_wise",
        "launcher.nproc_per_node=2",
        f"hydra.run.dir={tmp_path}",
        timeout=120,
    )
    assert proc.returncode != 0
    assert "embedding planner found no plan" in proc.stderr and "[rank" not in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "override,message",
    [
        ("topology.world_size=0", "topology.world_size must be >= 1 (or unset), got 0"),  # not read as "unset"
        ("topology.device_memory_gb=-1", "topology.device_memory_gb must be > 0 (or unset to detect it), got -1.0"),
    ],
)
def test_plan_cli_refuses_bad_topology_naming_the_key(tmp_path, override, message):
    proc = commands.run("hybridrec.plan", *SMALL, override, f"hydra.run.dir={tmp_path}", timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == f"hybridrec.plan: {message}"
