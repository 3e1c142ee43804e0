"""The framework's correctness proof: 2-rank hybrid training (TorchRec-sharded embeddings +
FSDP2 or DDP dense layers) produces the same per-step losses and the same final embedding and
dense weights as single-process training on the same global batches.

Three levels, all on the same data and initial weights:
  plain   - an unsharded PyTorch model, a hand-written loop, torch.optim (no TorchRec sharding,
            no FSDP, no pipeline): the independent reference;
  1 rank  - hybridrec itself with world_size=1;
  2 ranks - hybridrec on 2 gloo ranks, for every sharding type, FSDP2 and DDP.
"""

import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR

from conftest import compose_cfg
from dist_helpers import spawn, train_and_collect, train_and_gather
from hybridrec.data import build_source, loader
from hybridrec.models import build_model
from hybridrec.parallel.optim import lr_multiplier
from hybridrec.parallel.parallelize import init_embeddings
from shared import BASE, TOL, assert_same_training

pytestmark = pytest.mark.dist  # every test reads runs of 1 or 2 launched ranks


EMBEDDING_L2 = ["model.embedding_l2=0.05"]


def _cfg(*extra):
    return compose_cfg(BASE + list(extra))


def plain_reference(cfg) -> tuple[list[float], dict[str, torch.Tensor], list[float]]:
    """Unsharded DLRM trained with plain SGD by hand: the same math, no distributed code.
    Applies the config's lr schedules (torch's LambdaLR) and dense clipping the plain way."""
    torch.manual_seed(cfg.seed)
    data = build_source(cfg.data, cfg.seed)
    model = build_model(cfg, data.features, data.num_dense_features)
    ebc = model.sparse_module()
    ebc.to_empty(device="cpu")
    init_embeddings(ebc, cfg.seed)  # an unsharded table is a full replica: the whole table's init
    dense_params = [p for n, p in model.named_parameters() if "embedding_bags" not in n]
    sparse = torch.optim.SGD(ebc.parameters(), lr=cfg.optimizer.sparse.lr)
    dense = torch.optim.SGD(dense_params, lr=cfg.optimizer.dense.lr)
    schedules = [
        LambdaLR(sparse, lr_multiplier(cfg.optimizer.sparse_schedule)),
        LambdaLR(dense, lr_multiplier(cfg.optimizer.dense_schedule)),
    ]
    losses, norms = [], []
    for batch in loader.batches(data, "train", 0, 1, cfg.train.steps):
        loss, _ = model(batch)
        sparse.zero_grad(), dense.zero_grad()
        loss.backward()
        if cfg.optimizer.clip_grad_norm:
            norms.append(torch.nn.utils.clip_grad_norm_(dense_params, cfg.optimizer.clip_grad_norm).item())
        sparse.step(), dense.step()
        for s in schedules:
            s.step()
        losses.append(loss.item())
    return losses, model.state_dict(), norms


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    cfgs = [
        _cfg("optimizer=sgd"),
        _cfg("optimizer=adagrad"),
        _cfg("optimizer=adagrad"),
        _cfg("optimizer=adagrad", "seed=1"),
        _cfg(ADAGRAD),
        _cfg("optimizer=sgd", *SCHEDULED),
        _cfg(*ADAMW),
        _cfg("mesh=single"),
        _cfg("train.eval_every=3"),
        _cfg("optimizer=sgd", *EMBEDDING_L2),
    ]
    return spawn(train_and_gather, 1, cfgs, str(tmp_path_factory.mktemp("one")))


def test_same_seed_same_losses(one_rank):
    assert one_rank[1]["losses"] == one_rank[2]["losses"]  # bit-identical
    assert one_rank[1]["losses"] != one_rank[3]["losses"]


@pytest.mark.parametrize("run,extra", [(0, []), (9, EMBEDDING_L2)], ids=["plain", "embedding_l2"])
def test_one_rank_matches_plain_pytorch(one_rank, run, extra):
    """hybridrec's single-rank path (DMP, fused SGD, the dense part unwrapped, pipeline) against a
    model with no TorchRec sharding, trained by a hand-written loop; with model.embedding_l2
    the penalty's gradient reaches the fused tables as autograd's reaches plain ones."""
    cfg = _cfg("optimizer=sgd", *extra)
    losses, state, _ = plain_reference(cfg)
    assert losses[-1] < losses[0]  # it learns
    assert_same_training(one_rank[run], {"losses": losses, "state": state})
    if extra:  # the penalty is in the loss and in the tables' updates
        assert losses[0] > one_rank[0]["losses"][0]
        key = next(k for k in state if "embedding_bags" in k)
        assert not torch.allclose(state[key], one_rank[0]["state"][key])


def test_one_rank_schedules_and_clipping_match_plain_pytorch(one_rank):
    """The schedules reach the fused sparse optimizer (TorchRec reads the lr at zero_grad)
    and the dense one; clipping sees the same global norm as a plain model's."""
    losses, state, norms = plain_reference(_cfg("optimizer=sgd", *SCHEDULED))
    assert_same_training(one_rank[5], {"losses": losses, "state": state})
    torch.testing.assert_close(torch.tensor(one_rank[5]["grad_norms"]), torch.tensor(norms), **TOL)
    assert sum(n > 0.1 for n in norms) >= len(norms) // 2  # max_norm=0.1 really clips


SPLIT = "sharding.tables=[{match:'*',min_partition:4}]"  # 8-dim tables split into 2 x 4 columns
# Column splits are exact under element-wise optimizers (see test_rowwise_adagrad_...).
ADAGRAD = "optimizer.sparse._target_=torch.optim.Adagrad"
# Element-wise Adagrad's first step is lr * g / (|g| + 1e-10): for a weight whose gradient
# nearly cancels within the batch (|g| ~ 1e-9), the summation order moves the step by more
# than fp32 noise elsewhere. Its weights are compared at atol 1e-5 (losses still at TOL).
ADAGRAD_STATE_TOL = dict(rtol=1e-5, atol=1e-5)
# warmup then cosine decay (sparse), warmup then polynomial decay (dense), clipping
SCHEDULED = [
    "optimizer.sparse_schedule.warmup_steps=2",
    "optimizer.sparse_schedule.name=cosine",
    "optimizer.sparse_schedule.decay_start=3",
    "optimizer.sparse_schedule.decay_steps=4",
    "optimizer.dense_schedule.warmup_steps=3",
    "optimizer.dense_schedule.name=polynomial",
    "optimizer.dense_schedule.decay_start=3",
    "optimizer.dense_schedule.decay_steps=5",
    "optimizer.clip_grad_norm=0.1",
]
ADAMW = ["optimizer/dense=adamw", "optimizer.dense.lr=0.01", "optimizer.clip_grad_norm=1.0"]
# (variant name, overrides, expected sharding type per table, shards per table)
VARIANTS = [
    ("table_wise", ["sharding=table_wise"], "table_wise", 1),
    ("row_wise", ["sharding=row_wise"], "row_wise", 2),
    ("column_wise", ["sharding=column_wise", SPLIT, ADAGRAD], "column_wise", 2),
    ("table_row_wise", ["sharding=table_row_wise"], "table_row_wise", 2),
    ("table_column_wise", ["sharding=table_column_wise", SPLIT, ADAGRAD], "table_column_wise", 2),
    ("grid", ["sharding=grid", SPLIT, ADAGRAD], "grid_shard", 4),
    ("data_parallel", ["sharding=data_parallel"], "data_parallel", 2),
    # one model, four placements, from per-table constraints
    (
        "mixed",
        [
            ADAGRAD,
            "sharding.tables=[{match:t_cat_0,sharding_types:[column_wise],min_partition:4},"
            "{match:t_cat_1,sharding_types:[row_wise]},{match:t_cat_2,sharding_types:[table_row_wise]},"
            "{match:t_cat_3,sharding_types:[data_parallel],compute_kernels:[dense]}]",
        ],
        {"t_cat_0": "column_wise", "t_cat_1": "row_wise", "t_cat_2": "table_row_wise", "t_cat_3": "data_parallel"},
        None,
    ),
    ("table_wise+ddp", ["sharding=table_wise", "mesh=ddp"], "table_wise", 1),
    ("row_wise+sgd", ["sharding=row_wise", "optimizer=sgd"], "row_wise", 2),
    ("row_wise+sgd+embedding_l2", ["sharding=row_wise", "optimizer=sgd", *EMBEDDING_L2], "row_wise", 2),
    # dense parallelism variants, all against the same 1-rank run
    ("hsdp 1x2", ["sharding=table_wise", "mesh=hsdp", "mesh.replicate=1", "mesh.shard=2"], "table_wise", 1),
    ("hsdp 2x1", ["sharding=table_wise", "mesh=hsdp", "mesh.replicate=2", "mesh.shard=1"], "table_wise", 1),
    (
        "fsdp per-layer units, prefetch, no reshard",
        [
            "sharding=table_wise",
            "mesh.units=layer",
            "mesh.forward_prefetch=2",
            "mesh.backward_prefetch=1",
            "mesh.reshard_after_forward=false",
        ],
        "table_wise",
        1,
    ),
    ("fsdp one root unit", ["sharding=table_wise", "mesh.units=root"], "table_wise", 1),
    (
        "fsdp reshard to 2, cpu offload",
        ["sharding=table_wise", "mesh.reshard_after_forward=2", "mesh.cpu_offload=true"],
        "table_wise",
        1,
    ),
    ("adamw + clipping", ["sharding=row_wise", *ADAMW], "row_wise", 2),
    ("sgd + schedules + clipping", ["sharding=row_wise", "optimizer=sgd", *SCHEDULED], "row_wise", 2),
]
# what each variant must match at 1 rank (default: the rowwise-Adagrad run)
REFERENCE = {
    "row_wise+sgd": 0,
    "row_wise+sgd+embedding_l2": 9,
    "column_wise": 4,
    "table_column_wise": 4,
    "grid": 4,
    "mixed": 4,
    "adamw + clipping": 6,
    "sgd + schedules + clipping": 5,
}
PLACEMENTS = {"table_wise+ddp": "replicated", "hsdp 1x2": "RS(0)", "hsdp 2x1": "RS(0)"}


# The other 2-rank runs: (name, overrides)
OTHERS = [
    ("column_wise, rowwise adagrad", ["sharding=column_wise", SPLIT]),
    ("pipeline sparse_dist", ["sharding=row_wise", "train.eval_every=3"]),
    ("pipeline base", ["sharding=row_wise", "train.eval_every=3", "train.pipeline=base"]),
    ("bf16", ["mesh.param_dtype=bfloat16", "mesh.reduce_dtype=float32"]),
    ("qcomms", ["mesh.embedding_comms_forward=bf16", "mesh.embedding_comms_backward=bf16"]),
]
# One training step each, for the FSDP2 reshard states
RESHARD = [
    ("root auto", ["mesh.units=root", "train.steps=1"]),
    ("root explicit", ["mesh.units=root", "train.steps=1", "mesh.root_reshard_after_forward=true"]),
    ("units", ["mesh.units=arch", "train.steps=1"]),
    ("units kept", ["mesh.units=arch", "train.steps=1", "mesh.reshard_after_forward=false"]),
]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Every 2-rank run of this module, by name. One launch trains them all in sequence:
    process start-up and rendezvous are paid once."""
    runs = [(name, overrides, "gather") for name, overrides, _, _ in VARIANTS]
    runs += [(name, overrides, "gather") for name, overrides in OTHERS]
    runs += [(name, overrides, "reshard") for name, overrides in RESHARD]
    jobs = [(_cfg(*overrides), what) for _, overrides, what in runs]
    results = spawn(train_and_collect, 2, jobs, str(tmp_path_factory.mktemp("two")))
    assert len(results) == len(runs)
    return {name: result for (name, _, _), result in zip(runs, results)}


@pytest.mark.parametrize("name,overrides,expected,shards", VARIANTS, ids=[v[0].replace(" ", "-") for v in VARIANTS])
def test_two_ranks_match_one_rank(one_rank, two_ranks, name, overrides, expected, shards):
    result = two_ranks[name]
    plan = result["summary"]["plan"]
    types = expected if isinstance(expected, dict) else {t: expected for t in plan}
    assert {t: p["sharding_type"] for t, p in plan.items()} == types, (name, plan)
    if shards:  # the tables really are split as the type says
        assert all(len(p["ranks"]) == shards for p in plan.values()), (name, plan)
    assert {r for p in plan.values() for r in p["ranks"]} == {0, 1}, (name, plan)
    # dense parameters are FSDP2 DTensors sharded over both ranks, HSDP's 2-D ones, or replicas
    assert result["dense_placements"] == PLACEMENTS.get(name, "S(0)"), name
    reference = one_rank[REFERENCE.get(name, 1)]
    assert result["summary"]["world_size"] == 2
    # evaluation combines all ranks: same model and data, same metrics as 1 rank
    ev, ref_ev = result["summary"]["eval"], reference["summary"]["eval"]
    assert ev["n"] == ref_ev["n"] and abs(ev["auc"] - ref_ev["auc"]) < 1e-6, (name, ev, ref_ev)
    assert ev["ne"] == pytest.approx(ref_ev["ne"], rel=1e-5), name
    if reference["grad_norms"]:  # clipping: the global norm is the single-process norm
        torch.testing.assert_close(torch.tensor(result["grad_norms"]), torch.tensor(reference["grad_norms"]), **TOL)
    try:
        assert_same_training(result, reference, ADAGRAD_STATE_TOL if ADAGRAD in overrides else TOL)
    except AssertionError as e:
        raise AssertionError(f"{name}: {e}") from None


def test_rowwise_adagrad_with_column_splits_differs_and_says_so(one_rank, two_ranks):
    """TorchRec keeps a row-wise accumulator per column shard: not the unsharded optimizer.
    hybridrec cannot change the kernel, so it states it in the plan instead."""
    result = two_ranks["column_wise, rowwise adagrad"]
    notes = result["plan_notes"]
    assert len(notes) == 1 and "per column shard" in notes[0] and "t_cat_0" in notes[0]
    diff = max(abs(a - b) for a, b in zip(result["losses"], one_rank[1]["losses"]))
    assert diff > 1e-4  # really different: the note is not a false alarm


def test_single_matches_fsdp_on_one_rank(one_rank):
    assert_same_training(one_rank[7], one_rank[1])


def test_evaluation_during_training_changes_nothing(one_rank):
    """Eval detaches TorchRec's pipeline and re-attaches it: training stays bit-identical."""
    assert one_rank[8]["losses"] == one_rank[1]["losses"]
    assert [e["step"] for e in one_rank[8]["summary"]["eval_history"]] == [3, 6, 8]


def test_base_pipeline_matches_sparse_dist(two_ranks):
    """train.pipeline=base (TorchRec's TrainPipelineBase: one batch at a time, nothing
    overlapped) trains what the default TrainPipelineSparseDist trains: a pipeline changes
    when the input all-to-all runs, not what is computed. Evaluation mid-run included."""
    sparse_dist, base = two_ranks["pipeline sparse_dist"], two_ranks["pipeline base"]
    assert (sparse_dist["pipeline"], base["pipeline"]) == ("TrainPipelineSparseDist", "BasePipeline")
    assert_same_training(base, sparse_dist)
    assert base["summary"]["eval_history"] == sparse_dist["summary"]["eval_history"]


def test_reduced_precision_stays_close_to_fp32(one_rank, two_ranks):
    """bf16 dense compute with fp32 reduction, and bf16 embedding all-to-alls (qcomms): not
    bit-equal to fp32, within stated bounds over the same steps."""
    bf16, qcomms = two_ranks["bf16"], two_ranks["qcomms"]
    fp32 = torch.tensor(one_rank[1]["losses"])
    torch.testing.assert_close(torch.tensor(bf16["losses"]), fp32, rtol=0, atol=1e-2)
    torch.testing.assert_close(torch.tensor(qcomms["losses"]), fp32, rtol=0, atol=1e-4)
    assert bf16["losses"] != one_rank[1]["losses"]  # the policy really applied


def test_fsdp2_root_keeps_its_own_reshard_rule(two_ranks):
    """The root unit gets FSDP2's automatic rule (stay unsharded after forward: backward needs
    it at once) unless mesh.root_reshard_after_forward says otherwise; the units below follow
    mesh.reshard_after_forward."""
    auto, explicit_root, units, units_kept = (two_ranks[name] for name, _ in RESHARD)
    assert auto == {"root": False} and explicit_root == {"root": True}
    assert units == {"root": None, "unit0": True, "unit1": True}
    assert units_kept == {"root": None, "unit0": False, "unit1": False}
