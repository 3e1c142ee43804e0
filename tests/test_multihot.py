"""Multi-hot, weighted, mean-pooled and table-sharing sparse features: a source's ids,
lengths and weights reach every model unchanged, TorchRec pools them as declared (sharded as
unsharded), the planner sees each feature's pooling factor, and features that cannot share
a table, or a checkpoint trained on other features, are refused."""

from __future__ import annotations

from typing import Optional

import numpy as np
import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR
from torchrec.modules.embedding_configs import PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from conftest import compose_cfg
from dist_helpers import spawn, train_and_gather
from hybridrec.checkpoint import CheckpointError, TrainState, check_fits, layout_differences
from hybridrec.data import SparseFeature, build_source, loader
from hybridrec.data.source import Rows, Source
from hybridrec.models import SparseArch, build_model, tables_of
from hybridrec.parallel.optim import lr_multiplier
from hybridrec.parallel.parallelize import init_embeddings
from shared import TOL, assert_same_training

# (feature, most ids in a row): every kind of feature in one source
FEATURES = [
    (SparseFeature("multi", 50, 2.5), 5),  # 0..5 ids
    (SparseFeature("wmulti", 40, 2.0, weighted=True), 4),  # 0..4 ids, each with its weight
    (SparseFeature("left", 30, 1.5, table="t_shared"), 2),  # two features, one table
    (SparseFeature("right", 30, 1.0, table="t_shared"), 1),
    (SparseFeature("avg", 20, 2.0, pooling="mean"), 4),  # 0..4 ids, averaged
]
# two towers: a multi-hot user feature, and item features of which one is weighted and averaged
TOWER_FEATURES = [
    (SparseFeature("user", 20), 1),
    (SparseFeature("history", 30, 3.0, table="t_item"), 5),  # items the user saw: the item table
    (SparseFeature("item", 30, table="t_item"), 1),
    (SparseFeature("tags", 10, 2.0, pooling="mean", weighted=True), 3),
]
_SPLITS = {"train": 0, "eval": 1}


class TinySource(Source):
    """Random rows of ``features`` held by nothing but a seed: global batch k of a split is a
    function of (seed, split, k), so every world size reads the same global batches. The eval
    split has ``eval_rows`` rows: its last global batch is short (the loader pads it). The
    other keyword arguments are the ``data`` config's (built by Hydra as a run builds a source)."""

    def __init__(
        self,
        batch_size: int,
        num_dense_features: int = 4,
        seed: int = 0,
        eval_batches: Optional[int] = None,
        features: Optional[list] = None,
        eval_rows: Optional[int] = None,
        **_config,
    ) -> None:
        features = features or FEATURES
        self.features = [f for f, _ in features]
        self._most = [k for _, k in features]
        self.num_dense_features, self.batch_size, self.seed = num_dense_features, batch_size, seed
        self.eval_batches, self.splits = eval_batches, ("train", "eval")
        self.eval_rows = eval_rows if eval_rows is not None else batch_size + batch_size // 2 + 3

    def num_batches(self, split: str) -> Optional[int]:
        return None if split == "train" else -(-self.eval_rows // self.batch_size)

    def global_batch(self, split: str, index: int) -> tuple[np.ndarray, list, list, np.ndarray]:
        """Dense, per feature (values, lengths) and weights (None: unweighted), labels."""
        n = self.batch_size if split == "train" else min(self.batch_size, self.eval_rows - index * self.batch_size)
        rng = np.random.default_rng([self.seed, _SPLITS[split], index])
        dense = rng.normal(size=(n, self.num_dense_features)).astype(np.float32)
        ids, weights = [], []
        for f, most in zip(self.features, self._most):
            lengths = rng.integers(0, most + 1, n).astype(np.int32)
            ids.append((rng.integers(0, f.num_embeddings, int(lengths.sum())), lengths))
            weights.append(rng.uniform(0.1, 2.0, int(lengths.sum())).astype(np.float32) if f.weighted else None)
        # a label the ids and dense features decide in part: the model has something to learn
        labels = (dense[:, 0] + (ids[0][1] > 2) + rng.normal(size=n) > 0.5).astype(np.float32)
        return dense, ids, weights, labels

    def read(self, split: str, epoch: int, index: int, lo: int, hi: int) -> Rows:
        dense, ids, weights, labels = self.global_batch(split, index)
        hi = min(hi, len(labels))
        lo = min(lo, hi)
        part_ids, part_weights = [], []
        for (values, lengths), w in zip(ids, weights):
            offsets = np.concatenate([[0], np.cumsum(lengths)])
            part_ids.append((values[offsets[lo] : offsets[hi]], lengths[lo:hi]))
            part_weights.append(None if w is None else w[offsets[lo] : offsets[hi]])
        return Rows.of(dense[lo:hi], part_ids, labels[lo:hi], weights=part_weights if self.weighted else None)


def _source(batch_size=16, **kw) -> TinySource:
    return TinySource(batch_size, **kw)


def _expected(source: TinySource, split: str, index: int, lo: int, hi: int) -> dict[str, tuple]:
    """Per feature: (values, lengths, weights) of rows [lo, hi) as the source drew them."""
    dense, ids, weights, _ = source.global_batch(split, index)
    out = {}
    for f, (values, lengths), w in zip(source.features, ids, weights):
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        part = slice(offsets[lo], offsets[hi])
        out[f.name] = (
            torch.from_numpy(values[part]),
            torch.from_numpy(lengths[lo:hi]).long(),
            torch.ones(offsets[hi] - offsets[lo]) if w is None else torch.from_numpy(w[part]),
        )
    return out


def _assert_kjt(kjt: KeyedJaggedTensor, expected: dict[str, tuple]) -> None:
    assert kjt.keys() == list(expected)
    assert kjt.weights_or_none() is not None
    for name, jt in kjt.to_dict().items():
        values, lengths, weights = expected[name]
        assert torch.equal(jt.values(), values), name
        assert torch.equal(jt.lengths().long(), lengths), name
        assert torch.equal(jt.weights(), weights), name


@pytest.mark.unit
@pytest.mark.parametrize("world_size", [1, 2])
def test_training_batches_carry_the_sources_ids_lengths_and_weights(world_size):
    source = _source()
    assert source.weighted
    local = source.batch_size // world_size
    for rank in range(world_size):
        for index, batch in enumerate(loader.batches(source, "train", rank, world_size, 3)):
            _assert_kjt(batch.sparse_features, _expected(source, "train", index, rank * local, (rank + 1) * local))
    lengths = torch.cat([b.sparse_features["multi"].lengths() for b in loader.batches(source, "train", 0, 1, 8)])
    assert set(lengths.tolist()) == set(range(6))  # really multi-hot, rows without ids included


@pytest.mark.unit
def test_a_padded_eval_batch_keeps_the_real_rows_and_pads_with_id_0_of_weight_1():
    source = _source()  # 27 eval rows in batches of 16: the second has 11 real rows
    batches = list(loader.batches(source, "eval", 0, 1))
    assert len(batches) == 2 and batches[1].real.tolist() == [True] * 11 + [False] * 5
    _assert_kjt(batches[0].batch.sparse_features, _expected(source, "eval", 0, 0, 16))
    kjt = batches[1].batch.sparse_features
    real = _expected(source, "eval", 1, 0, 11)
    padding = (torch.zeros(5, dtype=torch.int64), torch.ones(5, dtype=torch.int64), torch.ones(5))
    _assert_kjt(kjt, {name: tuple(torch.cat([r, p]) for r, p in zip(real[name], padding)) for name in real})
    # a rank whose split ran out feeds padding only: weighted too
    pad = loader.padding_batch(source, 2).batch.sparse_features
    _assert_kjt(
        pad,
        {
            f.name: (torch.zeros(8, dtype=torch.int64), torch.ones(8, dtype=torch.int64), torch.ones(8))
            for f in source.features
        },
    )


@pytest.mark.unit
def test_worker_processes_send_the_weights_with_the_ids():
    source = _source()
    inline = list(loader.batches(source, "eval", 1, 2))
    workers = list(loader.batches(source, "eval", 1, 2, num_workers=2))
    for a, b in zip(inline, workers, strict=True):
        assert torch.equal(a.real, b.real)
        _assert_kjt(
            b.batch.sparse_features,
            {
                k: (jt.values(), jt.lengths().long(), jt.weights())
                for k, jt in a.batch.sparse_features.to_dict().items()
            },
        )


@pytest.mark.unit
def test_rows_of_weighs_unweighted_features_1_and_rows_without_weights_are_unweighted():
    ids = [(np.array([3, 4, 5]), np.array([2, 1])), (np.array([7]), np.array([1, 0]))]
    rows = Rows.of(np.zeros((2, 1)), ids, np.zeros(2), weights=[None, np.array([0.5])])
    assert rows.id_weights.tolist() == [1.0, 1.0, 1.0, 0.5]  # feature-major, one per id
    assert rows.batch(["a", "b"]).sparse_features.weights().tolist() == [1.0, 1.0, 1.0, 0.5]
    plain = Rows.of(np.zeros((2, 1)), ids, np.zeros(2))
    assert plain.batch(["a", "b"]).sparse_features.weights_or_none() is None
    # a weighted model reads weights of every batch: rows without any weigh 1.0
    assert plain.batch(["a", "b"], weighted=True).sparse_features.weights().tolist() == [1.0] * 4
    merged = Rows.cat([rows, plain])  # each feature's ids: the first part's, then the second's
    assert merged.values.tolist() == [3, 4, 5, 3, 4, 5, 7, 7] and merged.lengths.tolist() == [
        [2, 1, 2, 1],
        [1, 0, 1, 0],
    ]
    assert merged.id_weights.tolist() == [1.0] * 6 + [0.5, 1.0]
    padded = merged.padded(5)  # a padding row: one id 0 of weight 1 in every feature
    assert padded.values.tolist() == [3, 4, 5, 3, 4, 5, 0, 7, 7, 0] and padded.lengths[:, 4].tolist() == [1, 1]
    assert padded.id_weights.tolist() == [1.0] * 7 + [0.5, 1.0, 1.0] and padded.real.tolist() == [True] * 4 + [False]


# ------------------------------------------------------------------------------- the models
SMALL = ["model.embedding_dim=8", "model.dense_arch_layer_sizes=[16,8]"]
MODELS = {
    "dlrm": ["model=dlrm", *SMALL, "model.over_arch_layer_sizes=[16,1]"],
    "dcn": [
        "model=dcn",
        *SMALL,
        "model.over_arch_layer_sizes=[16,1]",
        "model.dcn_num_layers=2",
        "model.dcn_low_rank_dim=4",
    ],
    "deepfm": ["model=deepfm", *SMALL, "model.deep_layer_sizes=[16]"],
    "two_tower": [
        "model=two_tower",
        "model.embedding_dim=8",
        "model.tower_layer_sizes=[16,8]",
        "model.user_features=[user,history]",
    ],
}


def _unsharded(name: str, source: TinySource, seed: int = 0):
    """The model of ``MODELS[name]`` for ``source``, its tables materialized and initialized
    as a run initializes them."""
    cfg = compose_cfg(MODELS[name])
    torch.manual_seed(seed)
    model = build_model(cfg, source.features, source.num_dense_features)
    model.sparse_module().to_empty(device="cpu")
    init_embeddings(model.sparse_module(), seed)
    return model


@pytest.mark.unit
@pytest.mark.parametrize("name", list(MODELS))
def test_every_model_trains_on_multi_hot_weighted_shared_and_mean_features(name):
    source = _source(features=TOWER_FEATURES if name == "two_tower" else None)
    model = _unsharded(name, source)
    tables = model.sparse_module().embedding_bag_configs()
    by_table = {t.name: t.feature_names for t in tables}
    assert sum(len(t.feature_names) for t in tables) == len(source.features)
    assert (by_table["t_item"] if name == "two_tower" else by_table["t_shared"]) == (
        ["history", "item"] if name == "two_tower" else ["left", "right"]
    )
    if name in ("dlrm", "dcn"):  # TorchRec's DLRM counts features, not tables, from the configs
        assert model.model.sparse_arch.F == len(source.features) == 5
    batch = next(loader.batches(source, "train", 0, 1, 1))
    loss, (_, logits, _) = model(batch)
    loss.backward()
    assert logits.shape == (source.batch_size,) and torch.isfinite(loss)
    for table, bag in model.sparse_module().embedding_bags.items():
        assert bag.weight.grad is not None and bag.weight.grad.abs().sum() > 0, table
    # a table's rows move only where its features have ids
    touched = torch.cat([batch.sparse_features[f].values() for f in by_table[tables[0].name]]).unique()
    grad = model.sparse_module().embedding_bags[tables[0].name].weight.grad
    assert set(grad.abs().sum(1).nonzero().flatten().tolist()) <= set(touched.tolist())


@pytest.mark.unit
def test_mean_pooling_averages_and_weights_multiply():
    features = [
        SparseFeature("s", 10),
        SparseFeature("m", 10, pooling="mean"),
        SparseFeature("w", 10, table="t_s", weighted=True),
        SparseFeature("wm", 10, pooling="mean", weighted=True),
    ]
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["s", "m", "w", "wm"],
        values=torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9]),
        lengths=torch.tensor([2, 0, 0, 3, 1, 1, 2, 0]),
        weights=torch.tensor([1.0, 1, 1, 1, 1, 2, 3, 0.5, 4]),
    )
    unweighted = KeyedJaggedTensor.from_lengths_sync(
        keys=["s", "m"], values=torch.tensor([1, 2, 3, 4, 5]), lengths=torch.tensor([2, 0, 0, 3])
    )
    for feats, batch in ((features, kjt), (features[:2], unweighted)):
        arch = SparseArch(feats, 4)  # what DLRM, DCN and DeepFM pool with
        ebc = arch.embedding_bag_collection
        ebc.to_empty(device="cpu")
        torch.manual_seed(0)
        for p in ebc.parameters():
            p.data.uniform_(-1, 1)
        table = {name: bag.weight for name, bag in ebc.embedding_bags.items()}
        out = dict(zip(arch.sparse_feature_names, arch(batch).unbind(1)))
        # TorchRec takes an unweighted mean itself; a weighted collection's is left to the model
        pooling = {t.name: t.pooling for t in ebc.embedding_bag_configs()}
        assert pooling["t_m"] == (PoolingType.SUM if len(feats) == 4 else PoolingType.MEAN)
        s, m = table["t_s"], table["t_m"]
        torch.testing.assert_close(out["s"], torch.stack([s[1] + s[2], torch.zeros(4)]))
        torch.testing.assert_close(out["m"], torch.stack([torch.zeros(4), (m[3] + m[4] + m[5]) / 3]))
        if len(feats) == 4:
            torch.testing.assert_close(out["w"], torch.stack([2 * s[6], 3 * s[7]]))  # t_s: shared with s
            # weighted mean: sum(weight * embedding) / ids
            torch.testing.assert_close(
                out["wm"], torch.stack([(0.5 * table["t_wm"][8] + 4 * table["t_wm"][9]) / 2, torch.zeros(4)])
            )


@pytest.mark.unit
def test_features_sharing_a_table_must_agree_on_its_rows_and_pooling():
    with pytest.raises(
        ValueError,
        match=r"sharing table t_x must have the same num_embeddings: "
        r"a num_embeddings=10, b num_embeddings=12",
    ):
        tables_of([SparseFeature("a", 10, table="t_x"), SparseFeature("c", 5), SparseFeature("b", 12, table="t_x")])
    with pytest.raises(
        ValueError,
        match=r"sharing table t_x must have the same pooling: "
        r"a pooling=sum, b pooling=mean",
    ):
        build_model(
            compose_cfg(MODELS["dlrm"]),
            [SparseFeature("a", 10, table="t_x"), SparseFeature("b", 10, table="t_x", pooling="mean")],
            4,
        )
    with pytest.raises(ValueError, match="sparse feature a is given twice"):
        tables_of([SparseFeature("a", 10), SparseFeature("a", 10)])
    with pytest.raises(ValueError, match=r"sparse feature a: pooling='max'"):
        SparseFeature("a", 10, pooling="max")
    # the table of a feature of its own keeps its name: a checkpoint's state dict keys
    assert [t.name for t in tables_of([SparseFeature("a", 10), SparseFeature("b", 10, table="t_a")])] == ["t_a"]


@pytest.mark.unit
def test_the_planner_gets_each_features_pooling_factor_on_a_shared_table():
    from hybridrec.parallel.parallel_dims import ParallelDims
    from hybridrec.parallel.sharding import build_constraints
    from hybridrec.training.build import plan_inputs

    source = _source()
    cfg = compose_cfg(MODELS["dlrm"])
    inputs = plan_inputs(cfg, ParallelDims.build(cfg.mesh, 2, 2, "cpu"), source)
    model = build_model(cfg, source.features, source.num_dense_features)
    constraints = build_constraints(inputs.sharding, model.sparse_module().embedding_bag_configs(), inputs.pooling)
    assert {t: c.pooling_factors for t, c in constraints.items()} == {
        "t_multi": [2.5],
        "t_wmulti": [2.0],
        "t_shared": [1.5, 1.0],
        "t_avg": [2.0],
    }


# ------------------------------------------------------------------------------- checkpoints
# features as checkpoints saved them before tables, pooling and weights
OLD = [
    {"name": "a", "num_embeddings": 10, "pooling_factor": 1.0},
    {"name": "b", "num_embeddings": 5, "pooling_factor": 1.0},
]


def _state(features) -> TrainState:
    return TrainState(
        step=1,
        schedulers=[],
        features=features,
        num_dense_features=3,
        rng=torch.zeros(1, 1),
        losses=torch.zeros(1),
        runs=[],
    )


@pytest.mark.unit
def test_a_checkpoint_fits_only_features_that_use_its_tables_alike():
    # saved before features had tables, pooling and weights: the defaults are what it was trained with
    check_fits(_state(OLD), [SparseFeature("a", 10), SparseFeature("b", 5, 3.0, table="t_b")], 3, "ck")
    with pytest.raises(
        CheckpointError,
        match=r"sparse feature 1 is b \(5 rows, mean pooling, weighted\) but ck was "
        r"trained with b \(5 rows\)",
    ):
        check_fits(_state(OLD), [SparseFeature("a", 10), SparseFeature("b", 5, pooling="mean", weighted=True)], 3, "ck")
    with pytest.raises(CheckpointError, match=r"sparse feature 1 is b \(5 rows, table t_a\)"):
        check_fits(_state(OLD), [SparseFeature("a", 10), SparseFeature("b", 5, table="t_a")], 3, "ck")
    saved = [vars(f) for f in (SparseFeature("a", 10, weighted=True), SparseFeature("b", 5, pooling="mean"))]
    check_fits(_state(saved), [SparseFeature("a", 10, weighted=True), SparseFeature("b", 5, pooling="mean")], 3, "ck")


@pytest.mark.unit
def test_resuming_with_features_fed_otherwise_names_each_change():
    cfg = compose_cfg(MODELS["dlrm"])
    assert layout_differences(cfg, OLD, 3, cfg, [vars(SparseFeature("a", 10)), vars(SparseFeature("b", 5))], 3) == []
    run = [SparseFeature("a", 10, pooling="mean"), SparseFeature("b", 10, table="t_a", pooling="mean", weighted=True)]
    assert layout_differences(cfg, OLD, 3, cfg, [vars(f) for f in run], 3) == [
        "tables: only in the checkpoint [t_b], only in the run []",
        "feature a: checkpoint table t_a, sum pooling, run table t_a, mean pooling",
        "feature b: checkpoint table t_b, sum pooling, run table t_a, mean pooling, weighted",
    ]


# ---------------------------------------------------------------------- sharded = unsharded
# The tiny training run on TinySource (Hydra builds it from data._target_, as a run builds its source).
RUN = [
    "data._target_=test_multihot.TinySource",
    "data.batch_size=32",
    "data.num_dense_features=4",
    "data.eval_batches=2",
    *MODELS["dlrm"],
    "optimizer=sgd",
    "train.steps=5",
    "train.log_every=5",
    "launcher.device=cpu",
]


def plain_reference(cfg) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The run's model unsharded, trained by a hand-written loop with torch's SGD on the same
    global batches (as tests/test_equivalence.py's reference)."""
    torch.manual_seed(cfg.seed)
    data = build_source(cfg.data, cfg.seed)
    model = build_model(cfg, data.features, data.num_dense_features)
    ebc = model.sparse_module()
    ebc.to_empty(device="cpu")
    init_embeddings(ebc, cfg.seed)
    dense_params = [p for n, p in model.named_parameters() if "embedding_bags" not in n]
    optimizers = [
        torch.optim.SGD(ebc.parameters(), lr=cfg.optimizer.sparse.lr),
        torch.optim.SGD(dense_params, lr=cfg.optimizer.dense.lr),
    ]
    schedules = [
        LambdaLR(optimizers[0], lr_multiplier(cfg.optimizer.sparse_schedule)),
        LambdaLR(optimizers[1], lr_multiplier(cfg.optimizer.dense_schedule)),
    ]
    losses = []
    for batch in loader.batches(data, "train", 0, 1, cfg.train.steps):
        loss, _ = model(batch)
        for o in optimizers:
            o.zero_grad()
        loss.backward()
        for o in (*optimizers, *schedules):
            o.step()
        losses.append(loss.item())
    return losses, model.state_dict()


@pytest.mark.dist
def test_two_ranks_train_as_one_unsharded_process(tmp_path):
    """Row-wise and table-wise sharded over 2 gloo ranks (weights and lengths through the
    input all-to-all, a mean across row shards, the weighted collection's mean that the
    model takes itself) against the unsharded model, with the padded eval batch scored."""
    cfgs = [compose_cfg([*RUN, "sharding=row_wise"]), compose_cfg([*RUN, "sharding=table_wise"])]
    reference = dict(zip(("losses", "state"), plain_reference(cfgs[0])))
    for cfg, result in zip(cfgs, spawn(train_and_gather, 2, cfgs, str(tmp_path)), strict=True):
        plan = result["summary"]["plan"]
        assert set(plan) == {"t_multi", "t_wmulti", "t_shared", "t_avg"}
        assert {p["sharding_type"] for p in plan.values()} == {cfg.sharding.types[0].value}
        assert result["summary"]["eval"]["n"] == 51  # TinySource's eval rows: the padding is not scored
        assert_same_training(result, reference, TOL)


# ------------------------------------------------------------------------------- export
@pytest.mark.slow  # a torch.export trace takes seconds
def test_a_weighted_multi_hot_model_exports_to_a_program_that_takes_the_weights(tmp_path):
    from hybridrec.serving.export import PROGRAM, write_program

    source = _source()
    model = _unsharded("dlrm", source).eval()
    spec = write_program(model, source.features, source.num_dense_features, str(tmp_path), {})
    assert list(spec["inputs"]) == ["dense", "values", "lengths", "weights"]
    assert [(f["name"], f["table"], f["pooling"], f["weighted"]) for f in spec["features"]] == [
        ("multi", "t_multi", "sum", False),
        ("wmulti", "t_wmulti", "sum", True),
        ("left", "t_shared", "sum", False),
        ("right", "t_shared", "sum", False),
        ("avg", "t_avg", "mean", False),
    ]
    program = torch.export.load(tmp_path / PROGRAM)
    calls = [n.target for n in program.graph.nodes if n.op == "call_function"]  # the means taken with aten too
    assert all(str(t).startswith("aten.") or getattr(t, "__module__", None) == "_operator" for t in calls), calls
    run = program.module()
    batch = next(loader.batches(source, "eval", 0, 1, 1)).batch
    sparse = batch.sparse_features
    rows = 3  # and a smaller batch: the program takes any
    lengths = sparse.lengths().view(len(sparse.keys()), -1)
    keep = torch.repeat_interleave(torch.arange(lengths.shape[1]).repeat(len(sparse.keys())) < rows, lengths.flatten())
    with torch.no_grad():
        expected = torch.sigmoid(model.score(batch))
        got = run(batch.dense_features, sparse.values(), sparse.lengths(), sparse.weights())
        few = run(
            batch.dense_features[:rows],
            sparse.values()[keep],
            lengths[:, :rows].reshape(-1).contiguous(),
            sparse.weights()[keep],
        )
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(few, expected[:rows], rtol=1e-6, atol=1e-6)
    # the weights count: other weights, other scores
    changed = run(batch.dense_features, sparse.values(), sparse.lengths(), sparse.weights() * 2)
    assert not torch.allclose(changed, got)
