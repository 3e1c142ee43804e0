"""The validation objective: declared once, returned to every Hydra sweeper, followed by
keep_best and early stopping, across a resume; a failed trial does not end a study."""

import csv
import json
import math
import shutil

import pytest
from omegaconf import OmegaConf

import commands
from conftest import compose_cfg
from hybridrec.config.objective import Selection, resolve
from hybridrec.run.errors import user_message
from hybridrec.train import check_before_launch

TINY = [
    "+experiment=ctr",
    "data.batch_size=64",
    "data.num_embeddings_per_feature=[300,200,100,50]",
    "data.ids_per_feature=2",
    "data.eval_batches=2",
    "model.embedding_dim=8",
    "model.dense_arch_layer_sizes=[16,8]",
    "model.over_arch_layer_sizes=[16,1]",
    "train.log_every=20",
]


@pytest.mark.unit
def test_auto_follows_what_the_loss_and_the_data_declare():
    assert (resolve("auto", True, None).name, resolve("auto", True, None).direction) == ("valid.logloss", "minimize")
    assert (resolve("auto", False, None).name, resolve("auto", False, None).direction) == ("valid.auc", "maximize")
    assert resolve("auto", True, 10).name == "valid.ndcg@10" and resolve("auto", True, 10).maximize
    assert resolve("valid.ne", True, None).direction == "minimize"
    with pytest.raises(ValueError, match="train.objective=eval.auc: the test split .* never chosen on"):
        resolve("eval.auc", True, None)
    with pytest.raises(ValueError, match=r"train.objective=valid.ndcg@10: it must be auto or one of valid.logloss"):
        resolve("valid.ndcg@10", True, None)
    with pytest.raises(ValueError, match="valid.logloss"):  # an uncalibrated score has no log loss
        resolve("valid.logloss", False, None)


@pytest.mark.unit
def test_the_best_so_far_and_the_evaluations_since():
    objective, selection = resolve("valid.auc", False, None), Selection()
    assert [selection.update(objective, v, step) for step, v in ((10, 0.6), (20, 0.7), (30, math.nan), (40, 0.65))] == [
        True,
        True,
        False,
        False,
    ]
    assert (selection.best_step, selection.best_value, selection.evals_since_best) == (20, 0.7, 2)
    assert Selection.from_dict(json.loads(json.dumps(selection.to_dict()))) == selection  # saved as JSON
    assert objective.worst == -math.inf and resolve("auto", True, None).worst == math.inf


@pytest.mark.unit
def test_the_shipped_optuna_sweeper_takes_the_objectives_direction():
    cfg = compose_cfg([*TINY, "hydra/sweeper=objective"], hydra_keys=True)
    assert cfg.hydra.sweeper.direction == "minimize" and cfg.hydra.sweeper._target_.endswith("OptunaSweeper")
    cfg = compose_cfg([*TINY, "hydra/sweeper=objective", "train.objective=valid.auc"], hydra_keys=True)
    assert cfg.hydra.sweeper.direction == "maximize"


@pytest.mark.unit
def test_an_objective_without_a_validation_split_is_refused_before_launch(tmp_path):
    for asked in (
        ["train.objective=valid.auc"],
        ["train.early_stop_patience=2", "train.eval_every=10"],
        ["checkpoint.keep_best=true", "train.eval_every=10", f"checkpoint.dir={tmp_path}"],
    ):
        with pytest.raises(ValueError) as refused:
            check_before_launch(compose_cfg([*TINY, "data.valid_batches=0", *asked]))
        assert user_message(refused.value).startswith(
            "hybridrec: invalid config: train.objective="
        ) and "needs a validation split, and this data has none: give it one with data.valid_batches" in user_message(
            refused.value
        )
    check_before_launch(compose_cfg([*TINY, "data.valid_batches=0"]))  # a single run: the train loss
    with pytest.raises(ValueError, match="checkpoint.keep_best=true .* needs checkpoint.dir and train.eval_every"):
        check_before_launch(compose_cfg([*TINY, "checkpoint.keep_best=true"]))


def _train(tmp_path, name, *args):
    proc = commands.run("hybridrec.train", *TINY, *args, f"hydra.run.dir={tmp_path / name}", timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.load(open(tmp_path / name / "summary.json"))


# A run at a learning rate too high to keep improving: validation log loss is best at step 80
# (0.529), then worse at each of the next three evaluations (by 0.018 or more); patience 3
# stops it at step 110.
OVERFIT = [
    "train.eval_every=10",
    "checkpoint.keep_best=true",
    "train.early_stop_patience=3",
    "optimizer.sparse.lr=0.3",
    "optimizer.dense.lr=0.3",
]


@pytest.mark.slow
def test_keep_best_and_early_stopping_across_a_resume(tmp_path):
    """Four trainings (whole, interrupted, resumed, resumed again) of up to 110 steps, about
    25 s: early stopping needs the three evaluations after the best."""
    whole = _train(tmp_path, "whole", *OVERFIT, "train.steps=600", f"checkpoint.dir={tmp_path / 'a'}")
    o = whole["objective"]
    assert (o["name"], o["best_step"], o["stopped_early_at"]) == ("valid.logloss", 80, 110) and whole["steps"] == 110
    # the final evaluation scored the best checkpoint's weights: its validation metrics are the
    # ones logged at step 80, and the returned value is the best
    at_best = next(r for r in whole["eval_history"] if r["step"] == 80)
    assert whole["valid"] == {k: v for k, v in at_best.items() if k not in ("step", "split")}
    assert o["value"] == o["best_value"] == whole["valid"]["logloss"]
    records = [json.loads(line) for line in open(tmp_path / "whole" / "metrics.jsonl")]
    assert [r["step"] for r in records if r.get("split") == "eval"] == [80]  # the step whose weights were scored
    assert o["best_checkpoint"] == str(tmp_path / "a" / "step_00000080")
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [".lock", "step_00000080", "step_00000110"]
    # interrupted at step 90 (an evaluation without improvement: one of the three), then resumed
    _train(tmp_path, "first", *OVERFIT, "train.steps=90", f"checkpoint.dir={tmp_path / 'b'}")
    resumed = _train(tmp_path, "resumed", *OVERFIT, "train.steps=600", f"checkpoint.dir={tmp_path / 'b'}")
    assert resumed["provenance"]["resumed_from"]["step"] == 90
    assert {k: v for k, v in resumed["objective"].items() if k != "best_checkpoint"} == {
        k: v for k, v in o.items() if k != "best_checkpoint"
    }
    assert resumed["eval"] == whole["eval"]  # the same best weights, scored on the test split
    # resuming the early-stopped run trains nothing more
    again = _train(tmp_path, "again", *OVERFIT, "train.steps=600", f"checkpoint.dir={tmp_path / 'b'}")
    assert again["objective"]["stopped_early_at"] == 110 and again["eval"] == whole["eval"]


@pytest.mark.slow
def test_an_optuna_study_chooses_on_validation_and_survives_a_failed_trial(tmp_path):
    """Three trials on a grid: fused Adam (refused on CPU: the worst value), SGD and Adagrad.
    Optuna's best trial, the summary's chosen job and the best validation value agree. About
    25 s: a sweep starts its jobs' ranks with the elastic launcher, even for one rank."""
    sweep = tmp_path / "study"
    proc = commands.run(
        "hybridrec.train",
        "-m",
        *TINY,
        "train.steps=20",
        "train.eval_every=10",
        "hydra/sweeper=objective",
        "hydra/sweeper/sampler=grid",
        "hydra.sweeper.n_trials=3",
        "optimizer=choice(adam,sgd,adagrad)",
        f"hydra.sweep.dir={sweep}",
        # each job's checkpoints in its own directory: resolved before its rank starts
        "checkpoint.keep_best=true",
        "checkpoint.dir=${hydra:runtime.output_dir}/ckpt",
        "hydra.sweep.subdir=${hydra.job.num}",
        timeout=300,
    )
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    study = OmegaConf.load(sweep / "optimization_results.yaml")
    rows = list(csv.DictReader(open(sweep / "summary.csv")))
    assert sorted(r["optimizer"] for r in rows) == ["adagrad", "adam", "sgd"]
    failed = next(r for r in rows if r["optimizer"] == "adam")
    assert failed["status"] == "failed" and "no fused CPU kernel" in failed["error"]
    chosen = rows[0]
    assert chosen["chosen"] == "yes" and study.best_params["optimizer"] == chosen["optimizer"]
    assert study.best_value == float(chosen["objective"]) == min(float(r["objective"]) for r in rows if r["objective"])
    summary = json.load(open(sweep / chosen["dir"] / "summary.json"))
    assert summary["objective"]["value"] == summary["valid"]["logloss"] == study.best_value
    assert summary["objective"]["best_checkpoint"].startswith(str(sweep / chosen["dir"] / "ckpt" / "step_"))


@pytest.mark.unit
def test_keep_best_by_default_wherever_there_is_a_best_checkpoint_to_keep(tmp_path):
    """checkpoint.keep_best=null (auto): on with checkpoints and validation, off without
    either; true and false decide. Auto passes validation everywhere, continuous runs included,
    where an explicit true is still refused."""
    from hybridrec.config.objective import keeps_best
    from hybridrec.run.validation import validate

    assert keeps_best(None, checkpoints=True, validates=True) is True
    assert keeps_best(None, checkpoints=False, validates=True) is False
    assert keeps_best(None, checkpoints=True, validates=False) is False  # no eval_every, no valid split, continuous
    assert keeps_best(False, checkpoints=True, validates=True) is False
    assert keeps_best(True, checkpoints=True, validates=True) is True
    assert compose_cfg(TINY).checkpoint.keep_best is None
    validate(compose_cfg([*TINY, f"checkpoint.dir={tmp_path}"]), 1)
    with pytest.raises(ValueError, match="checkpoint.keep_best=true keeps the checkpoint of the best"):
        validate(
            compose_cfg([*TINY, "checkpoint.keep_best=true", "train.eval_every=0", f"checkpoint.dir={tmp_path}"]), 1
        )


@pytest.mark.unit
def test_references_name_a_split_and_a_metric_the_run_reports():
    from hybridrec.run.validation import validate

    ctr = compose_cfg(TINY)
    assert [(r.name, r.metric) for r in ctr.train.references] == [
        ("planted model", "valid.logloss"),
        ("planted model", "valid.auc"),
        ("planted model", "eval.auc"),
    ]
    validate(ctr, 1)
    ref = "{name: x, metric: %s, value: %s, source: s, data: hybridrec.data.synthetic.SyntheticClickLog}"
    for metric, value, message in (
        ("train.auc", 1, "must be valid.<metric> or eval.<metric>"),
        ("valid.ndcg@10", 1, "a metric this loss and data report: logloss, ne, auc"),
        ("valid.auc", "nan", r"train.references.0.value=nan is not a finite number"),
    ):
        with pytest.raises(ValueError, match=message):
            validate(compose_cfg([*TINY, f"train.references=[{ref % (metric, value)}]"]), 1)
    with pytest.raises(ValueError, match=r"train.references\[0\].value.* not set"):
        validate(compose_cfg([*TINY, "train.references=[{name: x, metric: valid.auc, source: s, data: d}]"]), 1)


RESUMABLE = ["train.eval_every=20", "train.log_every=10", "checkpoint.every_n_steps=20"]


@pytest.mark.slow
def test_a_resumed_training_reports_every_step_once_with_the_resume_marked(tmp_path):
    """A run killed after its checkpoint at step 40 (its outputs reach step 60; the checkpoint
    of step 60 is lost), resumed to step 100: metrics.jsonl, summary.json and report.png hold
    steps 1 to 100 once each, the resume marked; the throughput is the resumed run's own."""
    ck = tmp_path / "ck"
    _train(tmp_path, "killed", *RESUMABLE, "train.steps=60", f"checkpoint.dir={ck}")
    shutil.rmtree(ck / "step_00000060")  # killed between the save of step 40 and the commit of step 60
    s = _train(tmp_path, "resumed", *RESUMABLE, "train.steps=100", f"checkpoint.dir={ck}")
    records = [json.loads(line) for line in open(tmp_path / "resumed" / "metrics.jsonl")]
    resume = {"event": "resume", "step": 40, "path": str(ck / "step_00000040")}
    assert [r["step"] for r in records if "loss" in r] == list(range(10, 101, 10))
    assert [r["step"] for r in records if r.get("split") == "valid"] == [20, 40, 60, 80, 100]
    assert records.index(resume) == 6  # after the checkpoint's history (4 losses, 2 validations)
    assert s["resumes"] == [{"step": 40, "path": str(ck / "step_00000040")}]
    assert [e["step"] for e in s["eval_history"]] == [20, 40, 60, 80, 100]
    killed = [json.loads(line) for line in open(tmp_path / "killed" / "metrics.jsonl")]
    assert records[:6] == killed[:6]  # the history as it was written, up to the checkpoint
    assert s["train"]["resumed_from_step"] == 40 and s["steps"] == 100
    assert s["samples_per_second"] == pytest.approx(60 * 64 / s["wall_time_s"], rel=0.01)
    assert (tmp_path / "resumed" / "report.png").stat().st_size > 0
    # keep_best's default: the best validation's checkpoint is kept and scored
    assert s["objective"]["best_checkpoint"] == str(ck / f"step_{s['objective']['best_step']:08d}")
    assert s["references"][0]["name"] == "planted model" and s["references"][0]["run_value"] == s["valid"]["logloss"]
    # resumed once more: both resumes, in order, and still each step once
    s = _train(tmp_path, "again", *RESUMABLE, "train.steps=120", f"checkpoint.dir={ck}")
    records = [json.loads(line) for line in open(tmp_path / "again" / "metrics.jsonl")]
    assert [r["step"] for r in records if "loss" in r] == list(range(10, 121, 10))
    assert [r["step"] for r in s["resumes"]] == [40, 100]
