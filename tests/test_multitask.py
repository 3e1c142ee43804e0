"""Multi-task ranking (data.labels; shared-bottom, MMoE, PLE; ESMM's dependency): 2 ranks train
as 1 process, a resume is exact, a 2-rank checkpoint continues on 1 rank, the export scores
each task as evaluate does; the loss, the joint logit and the per-task metrics against their
definitions; the planted conversion task; and every bad data.labels refused before launch."""

import math

import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F

import commands
from conftest import compose_cfg
from dist_helpers import spawn, train_and_gather
from hybridrec.config.objective import resolve
from hybridrec.config.tasks import Task, tasks_of
from hybridrec.data import RecBatch, build_source, loader
from hybridrec.models.multitask import TaskLoss, joint_logit
from hybridrec.reports.metrics import binary_metrics, task_metrics
from hybridrec.run.validation import validate
from hybridrec.training.scoring import write_predictions
from shared import TOL, assert_same_training

DEVICE = "launcher.device=cpu"
MT = [
    "+experiment=multitask",
    "data.batch_size=64",
    "data.num_embeddings_per_feature=[300,200,100,50]",
    "data.ids_per_feature=2",
    "data.eval_batches=2",
    "data.valid_batches=1",
    "model.embedding_dim=8",
    "model.dense_arch_layer_sizes=[16,8]",
    "model.expert_layer_sizes=[16,8]",
    "model.tower_layer_sizes=[8]",
    "model.dcn_low_rank_dim=4",
    "train.steps=8",
    "train.log_every=4",
    "train.eval_every=4",
    "checkpoint.every_n_steps=4",
    "sharding=table_wise",
    DEVICE,
]
MODELS = {
    "shared_bottom": ["model=shared_bottom", "model.interaction=dot"],
    "mmoe": ["model=mmoe"],
    "ple": ["model=ple"],
}


# every kind of task: a binary, an ordinal (grades 0..2; the conversions are grades 0 and 1) and a
# regression one
KINDS = [
    "model=mmoe",
    "data.labels=[{name:click},{name:grade,column:conversion,kind:ordinal,levels:3},"
    "{name:again,column:click,kind:regression,weight:0.5}]",
]


def _cfg(model, *extra):
    return compose_cfg(MT + (KINDS if model == "kinds" else MODELS[model]) + list(extra))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """1 rank and 2 ranks of each model; MMoE on 2 ranks stopped at step 4 and resumed, and
    its step-4 checkpoint continued on 1 rank."""
    tmp = tmp_path_factory.mktemp("multitask")
    one = spawn(train_and_gather, 1, [_cfg(m) for m in [*MODELS, "kinds"]], str(tmp / "one"))
    two = spawn(
        train_and_gather,
        2,
        [_cfg(m, f"checkpoint.dir={tmp / m}") for m in [*MODELS, "kinds"]]
        + [
            _cfg("mmoe", f"checkpoint.dir={tmp / 'cut'}", "train.steps=4"),
            _cfg("mmoe", f"checkpoint.dir={tmp / 'cut'}"),
        ],
        str(tmp / "two"),
    )
    (resharded,) = spawn(
        train_and_gather,
        1,
        [_cfg("mmoe", f"checkpoint.dir={tmp / 'to1'}", f"checkpoint.resume={tmp / 'mmoe' / 'step_00000004'}")],
        str(tmp / "to1run"),
    )
    return tmp, dict(zip([*MODELS, "kinds"], one)), dict(zip([*MODELS, "kinds"], two)), two[5], resharded


@pytest.mark.dist
@pytest.mark.parametrize("model", list(MODELS))
def test_two_ranks_train_each_model_as_one_process(runs, model):
    _, one, two, _, _ = runs
    assert_same_training(two[model], one[model])
    torch.testing.assert_close(two[model]["eval_logits"], one[model]["eval_logits"], **TOL)
    assert two[model]["eval_logits"].shape == (64, 2)  # a column per task
    for split in ("eval", "valid"):
        a, b = one[model]["summary"][split], two[model]["summary"][split]
        assert a.keys() == b.keys()
        assert {"click.auc", "conversion.auc", "conversion.auc_given_click", "auc", "logloss"} <= a.keys()
        for key in a:
            assert math.isclose(a[key], b[key], rel_tol=1e-4, abs_tol=1e-5), (split, key)
    # every expert, gate and tower is an FSDP2 unit on 2 ranks
    assert two[model]["dense_placements"] == "S(0)"


@pytest.mark.dist
def test_binary_ordinal_and_regression_tasks_train_on_two_ranks_as_on_one(runs):
    _, one, two, _, _ = runs
    assert_same_training(two["kinds"], one["kinds"])
    (first,) = [v for k, v in one["kinds"]["state"].items() if k.endswith("cutpoints.0.first")]
    assert float(first) != -0.5  # the grade's cut-points are trained (they start at -0.5 and 0.5)
    metrics = two["kinds"]["summary"]["eval"]
    assert {"click.auc", "grade.rmse", "grade.mae", "grade.accuracy", "again.rmse", "again.mae"} <= metrics.keys()
    grades = two["kinds"]["eval_logits"][:, 1]  # the expected grade, in [0, 2]
    assert bool(((grades >= 0) & (grades <= 2)).all())
    for key, value in one["kinds"]["summary"]["eval"].items():
        assert math.isclose(value, metrics[key], rel_tol=1e-4, abs_tol=1e-5), key


@pytest.mark.dist
def test_a_resume_is_exact_and_a_two_rank_checkpoint_continues_on_one_rank(runs):
    _, _, two, resumed, resharded = runs
    assert resumed["summary"]["train"]["resumed_from_step"] == 4
    assert resumed["losses"] == two["mmoe"]["losses"]  # bit for bit
    for key, value in two["mmoe"]["state"].items():
        assert torch.equal(resumed["state"][key], value), key
    assert resharded["summary"]["train"]["resumed_from_step"] == 4
    assert_same_training(resharded, two["mmoe"])


@pytest.mark.slow
def test_the_export_scores_each_task_as_evaluate_does(runs, tmp_path):
    from hybridrec.serving.export import SPEC, export

    tmp, *_ = runs
    step = tmp / "ple" / "step_00000008"
    spec = export(str(step), str(tmp_path / "export"))
    proc = commands.run(
        "hybridrec.evaluate", f"checkpoint={step}", "predictions=true", DEVICE, f"hydra.run.dir={tmp_path / 'eval'}"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    predictions = pq.read_table(tmp_path / "eval" / "predictions.parquet").to_pydict()
    program = torch.export.load(tmp_path / "export" / "model.pt2").module()
    cfg = _cfg("ple")
    data = build_source(cfg.data, cfg.seed)
    with torch.no_grad():
        scores = torch.cat(
            [
                program(b.batch.dense_features, b.batch.sparse_features.values(), b.batch.sparse_features.lengths())
                for b in loader.batches(data, "eval", 0, 1)
            ]
        )
    assert scores.shape == (128, 2)
    for t, name in enumerate(("click", "conversion")):
        torch.testing.assert_close(scores[:, t], torch.tensor(predictions[f"probability_{name}"]), rtol=0, atol=1e-5)
    import json

    written = json.load(open(tmp_path / "export" / SPEC))
    assert written["output"] == spec["output"] == "tasks"
    assert [t["name"] for t in written["tasks"]] == ["click", "conversion"]
    assert written["tasks"][1]["after"] == "click"


# ---------------------------------------------------------------------- definitions
@pytest.mark.unit
def test_the_joint_logit_is_the_product_of_the_probabilities():
    a = torch.tensor([-30.0, -3.0, 0.0, 2.0, 25.0, 40.0], dtype=torch.float64, requires_grad=True)
    b = torch.tensor([4.0, -1.0, 0.5, 30.0, 25.0, 40.0], dtype=torch.float64, requires_grad=True)
    joint = joint_logit(a, b)
    expected = torch.sigmoid(a.detach()) * torch.sigmoid(b.detach())
    torch.testing.assert_close(torch.sigmoid(joint).double(), expected, rtol=1e-5, atol=1e-6)
    joint.sum().backward()
    assert torch.isfinite(a.grad).all() and torch.isfinite(b.grad).all()


@pytest.mark.unit
def test_the_task_loss_is_the_weighted_sum_of_each_tasks_loss():
    tasks = [Task("click", "click"), Task("cv", "cv", weight=3.0, after="click"), Task("time", "t", "regression", 0.5)]
    torch.manual_seed(0)
    logits, labels = torch.randn(16, 3), torch.stack([torch.randint(0, 2, (16,)).float()] * 2 + [torch.randn(16)], 1)
    batch = RecBatch(dense_features=torch.zeros(16, 1), sparse_features=None, labels=labels)
    got = TaskLoss(tasks)(logits, batch)
    want = (
        F.binary_cross_entropy_with_logits(logits[:, 0], labels[:, 0])
        + 3.0 * F.binary_cross_entropy_with_logits(logits[:, 1], labels[:, 1])
        + 0.5 * F.mse_loss(logits[:, 2], labels[:, 2])
    )
    torch.testing.assert_close(got, want)
    # padding rows (weight 0) count as zeros, as in every loss: the same mean on every rank
    batch.weights = torch.tensor([1.0] * 8 + [0.0] * 8)
    half = TaskLoss(tasks)(logits, batch)
    torch.testing.assert_close(
        half,
        (
            F.binary_cross_entropy_with_logits(logits[:8, 0], labels[:8, 0], reduction="sum")
            + 3.0 * F.binary_cross_entropy_with_logits(logits[:8, 1], labels[:8, 1], reduction="sum")
            + 0.5 * F.mse_loss(logits[:8, 2], labels[:8, 2], reduction="sum")
        )
        / 16,
    )


@pytest.mark.unit
def test_an_ordinal_task_is_the_proportional_odds_likelihood_of_its_grade():
    from hybridrec.models.multitask import Cutpoints, grade_probabilities

    cuts = Cutpoints(4)
    with torch.no_grad():
        cuts.gaps.copy_(torch.tensor([-3.0, 2.0]))  # any values: the cut-points still increase
    c = cuts()
    assert c.shape == (3,) and bool((c[1:] > c[:-1]).all())
    assert Cutpoints(2)().shape == (1,)
    score = torch.tensor([-2.0, 0.0, 0.5, 3.0])
    p = grade_probabilities(score, c)
    torch.testing.assert_close(p.sum(1), torch.ones(4))
    assert bool((p > 0).all())
    torch.testing.assert_close(p[:, 1:].flip(1).cumsum(1).flip(1), torch.sigmoid(score[:, None] - c))  # P(>= k)
    grade = torch.tensor([0.0, 3.0, 1.0, 2.0])
    batch = RecBatch(dense_features=torch.zeros(4, 1), sparse_features=None, labels=grade)
    got = TaskLoss([Task("g", "g", "ordinal", levels=4)])(score[:, None], batch, {0: c})
    torch.testing.assert_close(got, -torch.log(p[torch.arange(4), grade.long()]).mean())


@pytest.mark.unit
def test_task_metrics_are_each_tasks_metrics_and_their_weighted_means():
    g = torch.Generator().manual_seed(1)
    n = 400
    click = (torch.rand(n, generator=g) < 0.4).double()
    cv = click * (torch.rand(n, generator=g) < 0.3).double()
    scores = torch.randn(n, 3, generator=g, dtype=torch.float64) + torch.stack([click, cv, click], 1)
    value = torch.randn(n, generator=g, dtype=torch.float64)
    labels = torch.stack([click, cv, value], 1)
    tasks = [
        Task("click", "click", weight=1.0),
        Task("cv", "cv", weight=3.0, after="click"),
        Task("v", "v", "regression"),
    ]
    m = task_metrics(scores, labels, tasks)
    for t, name in enumerate(("click", "cv")):
        own = binary_metrics(torch.sigmoid(scores[:, t]), labels[:, t])
        assert m[f"{name}.auc"] == own["auc"] and m[f"{name}.logloss"] == own["logloss"]
    given = torch.sigmoid(scores[:, 1]) / torch.sigmoid(scores[:, 0])
    rows = click > 0
    assert m["cv.auc_given_click"] == binary_metrics(given[rows].clamp(0, 1), cv[rows])["auc"]
    assert m["auc"] == pytest.approx((m["click.auc"] + 3 * m["cv.auc"]) / 4)
    assert m["v.rmse"] == pytest.approx(float((scores[:, 2] - value).square().mean().sqrt()))
    assert m["v.mae"] == pytest.approx(float((scores[:, 2] - value).abs().mean()))
    assert m["n"] == n


@pytest.mark.unit
def test_predictions_have_a_label_score_and_probability_per_task(tmp_path):
    tasks = [Task("click", "click"), Task("v", "v", "regression")]
    cols = {
        "row": torch.arange(3),
        "label": torch.tensor([[1.0, 2.0], [0.0, 3.0], [1.0, 4.0]]),
        "score": torch.zeros(3, 2),
    }
    assert write_predictions(str(tmp_path / "p.parquet"), cols, True, tasks) == 3
    table = pq.read_table(tmp_path / "p.parquet").to_pydict()
    assert list(table) == ["row", "label_click", "score_click", "probability_click", "label_v", "score_v"]
    assert table["probability_click"] == [0.5] * 3 and table["label_v"] == [2.0, 3.0, 4.0]


@pytest.mark.unit
def test_the_planted_conversion_follows_the_click_and_leaves_the_clicks_as_they_were():
    plain = build_source(compose_cfg(MT[:5] + ["data.labels=null"]).data, 0)
    both = build_source(compose_cfg(MT[:5]).data, 0)
    one = build_source(compose_cfg(MT[:5] + ["data.labels=[{name:conversion}]"]).data, 0)
    for index in range(3):
        clicks = plain.read("train", 0, index, 0, 64).labels
        rows = both.read("train", 0, index, 0, 64)
        assert rows.labels.shape == (64, 2)
        assert torch.equal(rows.labels[:, 0], clicks)  # the same rows and clicks with the second task
        assert bool((rows.labels[:, 1] <= rows.labels[:, 0]).all())  # a conversion only after a click
        assert torch.equal(one.read("train", 0, index, 0, 64).labels, rows.labels[:, 1])  # one task: [n]
    rate = torch.cat([both.read("train", 0, i, 0, 64).labels for i in range(40)]).mean(0)
    assert 0.3 < rate[0] < 0.5 and 0.005 < rate[1] < 0.05, rate


@pytest.mark.unit
def test_objectives_name_a_tasks_metric_or_the_weighted_ones():
    tasks = tasks_of([{"name": "click"}, {"name": "cv", "after": "click"}, {"name": "t", "kind": "regression"}])
    assert resolve("auto", True, None, tasks=tasks).name == "valid.logloss"
    assert resolve("valid.cv.auc", True, None, tasks=tasks).maximize
    assert not resolve("valid.click.logloss", True, None, tasks=tasks).maximize
    assert not resolve("valid.t.rmse", True, None, tasks=tasks).maximize
    assert resolve("valid.cv.auc_given_click", True, None, tasks=tasks).maximize
    with pytest.raises(ValueError, match=r"train.objective=valid.purchase.auc: .*valid.cv.auc"):
        resolve("valid.purchase.auc", True, None, tasks=tasks)


# ---------------------------------------------------------------------- refused before launch
REFUSED = {
    "a missing label column": (
        ["data.labels=[{name:click},{name:buy,column:purchase}]"],
        r"data.labels\[1\].column=purchase: this data has no such label column \(it has: click, conversion\)",
    ),
    "a negative weight": (
        ["data.labels=[{name:click,weight:-1.0},{name:conversion}]"],
        r"data.labels\[0\].weight=-1.0: .*>= 0",
    ),
    "weights all zero": (
        ["data.labels=[{name:click,weight:0.0},{name:conversion,weight:0.0}]"],
        r"every task's weight is 0",
    ),
    "an unknown dependency": (
        ["data.labels=[{name:click},{name:conversion,after:view}]"],
        r"data.labels\[1\].after=view: no task view is listed before conversion",
    ),
    "a dependency listed later": (
        ["data.labels=[{name:conversion,after:click},{name:click}]"],
        r"data.labels\[0\].after=click: no task click is listed before",
    ),
    "a regression dependency": (
        ["data.labels=[{name:click,kind:regression},{name:conversion,after:click}]"],
        r"joins two binary tasks",
    ),
    "an ordinal task without grades": (
        ["data.labels=[{name:click},{name:stars,column:conversion,kind:ordinal}]"],
        r"data.labels\[1\].levels=None: an ordinal task's number of grades",
    ),
    "a task named twice": (["data.labels=[{name:click},{name:click,column:conversion}]"], r"task click is given twice"),
    "a multi-task model without labels": (["data.labels=null"], r"model=MMoE trains several tasks: set data.labels"),
    "a single-task model with two": (
        ["model=dlrm"],
        r"data.labels gives 2 task\(s\) and model=DLRMRanker scores one binary label",
    ),
    "a ranking loss": (["loss=pairwise"], r"leave loss=pointwise"),
    "labels drawn on the device": (["data.device_input=true"], r"data.device_input=true makes one label per row"),
}


@pytest.mark.unit
@pytest.mark.parametrize("case", list(REFUSED))
def test_bad_labels_are_refused_before_launch_naming_the_key(case):
    overrides, message = REFUSED[case]
    with pytest.raises(ValueError, match=message):
        validate(compose_cfg(["+experiment=multitask", DEVICE, *overrides]), 1)


@pytest.mark.unit
def test_the_command_refuses_bad_labels_in_one_line():
    proc = commands.run(
        "hybridrec.train", "+experiment=multitask", "data.labels=[{name:click},{name:conversion,after:view}]", DEVICE
    )
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == [
        "hybridrec: invalid config: data.labels[1].after=view: no task view is listed before conversion (listed before it: click); "
        "a task depends on one listed earlier in data.labels"
    ], proc.stderr[-2000:]


# ---------------------------------------------------------------------- a feature log's labels
def _log(tmp_path, **columns):
    import pyarrow as pa

    table = pa.table(
        {
            "click": pa.array([1, 0, 1, 1, 0, 1, 0, 1], pa.int8()),
            "buy": pa.array([1, 0, 0, 2, 0, 1, 0, 0], pa.int8()),  # 2 at row 3: not 0 or 1
            "minutes": [3.5, 0.0, 1.0, 2.0, 0.0, float("nan"), 0.0, 7.0],  # NaN at row 5: not finite
            "i": pa.array(range(8), pa.int64()),
            **columns,
        }
    )
    pq.write_table(table, tmp_path / "t.parquet")
    pq.write_table(table, tmp_path / "e.parquet")
    return dict(
        batch_size=8,
        train_path=str(tmp_path / "t.parquet"),
        eval_path=str(tmp_path / "e.parquet"),
        label={"column": "???"},
        sparse=[{"name": "i", "column": "i", "num_embeddings": 8}],
        seed=0,
    )


@pytest.mark.unit
def test_a_feature_log_gives_a_label_column_per_task_and_a_bad_label_costs_its_row(tmp_path):
    from hybridrec.data.parquet import ParquetSource

    labels = [
        {"name": "click"},
        {"name": "buy", "after": "click"},
        {"name": "watch", "column": "minutes", "kind": "regression"},
        {"name": "long", "column": "minutes", "threshold": 2.0},
        {"name": "stars", "column": "buy", "kind": "ordinal", "levels": 2},
    ]
    data = ParquetSource(**_log(tmp_path), labels=labels)
    batch = next(loader.batches(data, "train", 0, 1, 1))
    assert batch.labels.shape == (8, 5)
    real = batch.weights.bool().tolist()
    assert real == [True, True, True, False, True, False, True, True]  # rows 3 and 5 are bad, the rest kept
    kept = batch.labels[torch.tensor(real)]
    assert kept[:, 0].tolist() == [1, 0, 1, 0, 0, 1] and kept[:, 1].tolist() == [1, 0, 0, 0, 0, 0]
    assert kept[:, 2].tolist() == [3.5, 0.0, 1.0, 0.0, 0.0, 7.0] and kept[:, 3].tolist() == [1, 0, 0, 0, 0, 1]
    assert kept[:, 4].tolist() == kept[:, 1].tolist()
    report = data.report()
    errors = report["files"][str(tmp_path / "t.parquet")]["errors"]
    assert errors == [
        f"{tmp_path / 't.parquet'}:3: label buy 2 is not 0 or 1 (or set data.labels[1].threshold)",
        f"{tmp_path / 't.parquet'}:5: label minutes nan is not a finite number",
    ]
    # as an ordinal task of 3 grades, row 3's buy=2 is a grade
    data = ParquetSource(**_log(tmp_path), labels=[{"name": "stars", "column": "buy", "kind": "ordinal", "levels": 3}])
    batch = next(loader.batches(data, "train", 0, 1, 1))
    assert batch.labels.tolist() == [1, 0, 0, 2, 0, 1, 0, 0] and bool(batch.weights.all())


@pytest.mark.unit
def test_a_feature_log_without_a_tasks_column_is_refused_naming_it(tmp_path):
    from hybridrec.data import DataError
    from hybridrec.data.parquet import ParquetSource

    with pytest.raises(DataError, match=r"no column 'purchase' \(data.labels\[1\].column\)"):
        ParquetSource(**_log(tmp_path), labels=[{"name": "click"}, {"name": "buy", "column": "purchase"}])


@pytest.mark.unit
def test_a_checkpoint_of_other_tasks_does_not_fit_and_says_which():
    from hybridrec.checkpoint import layout_differences

    saved = compose_cfg(["+experiment=multitask", DEVICE])
    same = compose_cfg(
        ["+experiment=multitask", DEVICE, "data.labels=[{name:click,weight:2.0},{name:conversion,after:click}]"]
    )
    other = compose_cfg(["+experiment=multitask", DEVICE, "data.labels=[{name:click},{name:conversion}]"])
    assert layout_differences(saved, [], 13, same, [], 13) == []  # a task's weight may change on resume
    assert layout_differences(saved, [], 13, other, [], 13) == [
        "data.labels: checkpoint ['click (binary of click)', 'conversion (binary of conversion, after click)'], "
        "run ['click (binary of click)', 'conversion (binary of conversion)']"
    ]


@pytest.mark.unit
def test_the_example_logs_purchases_come_only_after_clicks(tmp_path):
    from hybridrec.data.example import generate

    generate(str(tmp_path), rows=4000, seed=0)
    table = pq.read_table(tmp_path / "train")
    click, purchase = (table.column(c).to_numpy() for c in ("click", "purchase"))
    assert (purchase <= click).all()
    assert 0.1 < purchase.sum() / click.sum() < 0.25, purchase.sum() / click.sum()  # about one click in six
