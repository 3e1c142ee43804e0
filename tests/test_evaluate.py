"""Scoring a saved model: ``python -m hybridrec.evaluate`` on 1 and 2 ranks against the
training run's own final evaluation, its predictions file, the config it composes from the
checkpoint, and the refusals before launch."""

import json
import os
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from omegaconf import OmegaConf

import commands
from conftest import compose_cfg
from dist_helpers import spawn, train_and_summarize
from hybridrec.checkpoint import CheckpointError, TrainState, check_checkpoint, check_fits
from hybridrec.config import DenseParallel, Device, IdMapping, evaluation_config, typed
from hybridrec.data import SparseFeature
from hybridrec.data.fetch_movielens import write_layout
from hybridrec.models.losses import BCE, Pairwise
from hybridrec.training.scoring import split_metrics, write_predictions
from shared import BASE, TOL, tables


def _evaluate_cfg(overrides):
    """The config `python -m hybridrec.evaluate <overrides>` composes (before the checkpoint's)."""
    return compose_cfg(overrides, config_name="evaluate")


def _saved(overrides):
    """A training config as a checkpoint's config.yaml reads back: plain YAML, no types."""
    return OmegaConf.create(OmegaConf.to_yaml(compose_cfg(overrides)))


# ------------------------------------------------------------------------------ unit
@pytest.mark.unit
@pytest.mark.parametrize(
    "overrides",
    [
        ["+experiment=ctr"],
        ["+experiment=movielens_rank"],
        ["+experiment=movielens_retrieval"],
        ["data=criteo", "data.train_path=a", "data.eval_path=b", "mesh=hsdp"],
        ["model=deepfm", "loss=approx_ndcg", "data=movielens_rank", "optimizer=adam"],
    ],
    ids=lambda o: o[0],
)
def test_a_saved_config_is_typed_again_as_it_was(overrides):
    cfg = compose_cfg(overrides)
    again = typed(_saved(overrides))
    assert OmegaConf.to_container(again) == OmegaConf.to_container(cfg)
    for path in ("model", "loss", "data", "mesh", "optimizer.sparse", "optimizer.dense", "sharding"):
        assert OmegaConf.get_type(OmegaConf.select(again, path)) == OmegaConf.get_type(OmegaConf.select(cfg, path)), (
            path
        )
    assert isinstance(again.mesh.dense, DenseParallel)  # an enum again, as training code reads it


@pytest.mark.unit
def test_a_saved_config_with_a_wrong_key_or_value_is_refused_by_name():
    saved = _saved(["+experiment=ctr"])
    saved.data.evl_batches = 3
    with pytest.raises(ValueError, match=r"unknown key data.evl_batches \(did you mean data.eval_batches\?\)"):
        typed(saved)
    saved = _saved(["+experiment=ctr"])
    saved.mesh.dense = "fdsp"
    with pytest.raises(ValueError, match="mesh.dense: Invalid value 'fdsp'"):
        typed(saved)


@pytest.mark.unit
def test_the_evaluation_config_is_the_checkpoints_with_the_data_changes():
    saved = _saved(
        [
            "data=criteo",
            "data.train_path=a.tsv",
            "data.eval_path=b.tsv",
            "data.eval_batches=4",
            "topology.world_size=4",
            "checkpoint.dir=ckpt",
            "launcher.nproc_per_node=4",
            "seed=7",
        ]
    )
    ev = _evaluate_cfg(
        [
            "checkpoint=ckpt/step_00000010",
            "data.eval_path=day_23.tsv",
            "data.eval_batches=null",
            "launcher.nproc_per_node=2",
        ]
    )
    cfg = evaluation_config(saved, ev, data_option=False)
    assert cfg.data.eval_path == "day_23.tsv" and cfg.data.eval_batches is None and cfg.data.train_path == "a.tsv"
    assert cfg.data.id_mapping == IdMapping.modulo and cfg.seed == 7  # the split and ids the model was trained on
    assert (
        cfg.launcher.nproc_per_node == 2
        and cfg.topology.world_size is None
        and cfg.topology.compute_device == Device.auto
    )
    assert cfg.checkpoint.dir is None and cfg.checkpoint.resume == "never"
    # data=<option>: that option's config, then its keys
    ev = _evaluate_cfg(["checkpoint=x", "data=criteo_binary", "data.train_path=t", "data.eval_path=e"])
    cfg = evaluation_config(saved, ev, data_option=True)
    assert cfg.data._target_ == "hybridrec.data.criteo.CriteoBinary" and cfg.data.eval_path == "e"
    with pytest.raises(ValueError, match=r"unknown key data.eval_pth \(did you mean data.eval_path\?\)"):
        evaluation_config(saved, _evaluate_cfg(["checkpoint=x", "data.eval_pth=y"]), data_option=False)


@pytest.mark.unit
def test_only_a_committed_complete_checkpoint_is_taken(tmp_path):
    with pytest.raises(CheckpointError, match="no such directory"):
        check_checkpoint(str(tmp_path / "nope"))
    os.makedirs(tmp_path / "ckpt" / "step_00000004.partial")
    with pytest.raises(CheckpointError, match="is not a committed checkpoint: a save that never finished"):
        check_checkpoint(str(tmp_path / "ckpt" / "step_00000004.partial"))
    os.makedirs(tmp_path / "ckpt" / "step_00000002")  # committed, but without DCP's metadata
    with pytest.raises(CheckpointError, match="is a checkpoint.dir, not one checkpoint: give one of its step_<N>"):
        check_checkpoint(str(tmp_path / "ckpt"))
    with pytest.raises(CheckpointError, match=r"is not a complete checkpoint \(.*\.metadata is missing"):
        check_checkpoint(str(tmp_path / "ckpt" / "step_00000002"))


@pytest.mark.unit
def test_data_that_does_not_fit_the_tables_is_refused():
    state = TrainState(
        step=4,
        schedulers=[],
        features=[
            {"name": "a", "num_embeddings": 10, "pooling_factor": 1.0},
            {"name": "b", "num_embeddings": 5, "pooling_factor": 1.0},
        ],
        num_dense_features=3,
        rng=torch.zeros(1, 1),
        losses=torch.zeros(4),
        runs=[],
    )
    check_fits(state, [SparseFeature("a", 10), SparseFeature("b", 5, 2.0)], 3, "ck")  # pooling may differ
    with pytest.raises(CheckpointError, match=r"sparse feature 1 is b \(6 rows\) but ck was trained with b \(5 rows\)"):
        check_fits(state, [SparseFeature("a", 10), SparseFeature("b", 6)], 3, "ck")
    with pytest.raises(CheckpointError, match=r"sparse feature 2 is c .* with nothing"):
        check_fits(state, [SparseFeature("a", 10), SparseFeature("b", 5), SparseFeature("c", 2)], 3, "ck")
    with pytest.raises(CheckpointError, match="4 dense features but ck was trained with 3"):
        check_fits(state, [SparseFeature("a", 10), SparseFeature("b", 5)], 4, "ck")


class _Ranking:
    ranking_k, threshold = 2, 1.0


class _Rows:
    ranking_k = None


@pytest.mark.unit
def test_split_metrics_follow_the_declarations():
    scores, labels = torch.tensor([2.0, -1.0, 0.5, -3.0]), torch.tensor([1.0, 0.0, 0.0, 1.0])
    calibrated = split_metrics(scores, labels, BCE(), _Rows())
    assert {"auc", "ne", "logloss", "calibration", "ctr", "accuracy", "n"} == calibrated.keys()
    ranked = split_metrics(
        scores,
        labels,
        Pairwise(list_size=2),
        _Ranking(),
        relevance=torch.tensor([2.0, 0, 1, 0]),
        query=torch.tensor([5, 5, 9, 9]),
    )
    assert "ne" not in ranked and ranked["auc"] == calibrated["auc"] and ranked["queries"] == 2
    assert ranked["ndcg@2"] == pytest.approx(1.0) and ranked["recall@2"] == 1.0  # each query's relevant row first


@pytest.mark.unit
def test_the_predictions_file_is_parquet_with_its_meaning(tmp_path):
    cols = {
        "row": torch.tensor([0, 1, 2]),
        "label": torch.tensor([1.0, 0.0, 1.0]),
        "score": torch.tensor([0.0, -2.0, 3.0]),
        "query": torch.tensor([4, 4, 6]),
        "relevance": torch.tensor([5.0, 0.0, 4.0]),
    }
    assert write_predictions(str(tmp_path / "p.parquet"), cols, calibrated=True) == 3
    table = pq.read_table(tmp_path / "p.parquet")
    assert table.column_names == ["row", "label", "score", "probability", "query", "relevance"]
    assert table.column("probability").to_pylist() == pytest.approx([0.5, 0.11920292, 0.95257413])
    assert b"logit" in table.schema.metadata[b"hybridrec.score"]
    write_predictions(str(tmp_path / "q.parquet"), cols, calibrated=False)
    table = pq.read_table(tmp_path / "q.parquet")
    assert "probability" not in table.column_names and b"not a probability" in table.schema.metadata[b"hybridrec.score"]


# ------------------------------------------------------------------------------ dist
RANK = [
    "+experiment=movielens_rank",
    "data.list_size=4",
    "data.negatives=2",
    "data.batch_size=24",
    "data.eval_negatives=5",
    "train.steps=6",
    "train.log_every=3",
    "loss=pairwise",
    "model.embedding_dim=8",
    "model.dense_arch_layer_sizes=[16,8]",
    "model.over_arch_layer_sizes=[16,1]",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny DLRM (synthetic clicks) and a tiny ranking model (MovieLens-shaped lists),
    trained in one 1-rank launch with a checkpoint at the end: name -> (checkpoint, summary)."""
    tmp = tmp_path_factory.mktemp("trained")
    write_layout(tables(n_ratings=400), str(tmp / "ml"))
    runs = {"clicks": BASE, "ranking": [*RANK, f"data.path={tmp / 'ml'}"]}
    cfgs = [compose_cfg([*o, f"checkpoint.dir={tmp / name}"]) for name, o in runs.items()]
    results = spawn(train_and_summarize, 1, cfgs, str(tmp / "runs"))
    return {
        name: (tmp / name / f"step_{cfg.train.steps:08d}", r["summary"])
        for (name, cfg), r in zip(zip(runs, cfgs), results)
    }


def _evaluate(checkpoint, out, *args):
    proc = commands.run("hybridrec.evaluate", f"checkpoint={checkpoint}", *args, f"hydra.run.dir={out}", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.load(open(out / "metrics.json")), pq.read_table(out / "predictions.parquet").to_pydict(), proc


@pytest.mark.dist
def test_a_checkpoint_scores_as_training_scored_it_on_1_and_2_ranks(trained, tmp_path):
    """Two evaluations, one launching 2 ranks, and the setup of ``trained`` (the module's two
    trainings): the module's slowest test."""
    checkpoint, summary = trained["clicks"]
    # given as its checkpoint.dir: the newest checkpoint that verifies as a load does; the newer
    # ones passed over, each with its reason: one with a flipped byte in a shard (complete, so
    # only its checksums tell) and one without DCP's metadata
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint.parent, ckpt)
    flipped = ckpt / "step_00000009"
    shutil.copytree(ckpt / checkpoint.name, flipped)
    shard = sorted(flipped.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    os.makedirs(ckpt / "step_00000010")
    one, p1, proc = _evaluate(ckpt, tmp_path / "one")
    said = proc.stdout + proc.stderr
    assert (
        f"its newest loadable checkpoint, {ckpt / checkpoint.name} (newer, not loadable: "
        f"{ckpt / 'step_00000010'} is not a complete checkpoint" in said
    )
    assert f"{flipped} is damaged: {shard} does not match the checksum recorded when it was saved" in said
    export = commands.run("hybridrec.export", f"checkpoint={ckpt}", f"out={tmp_path / 'export'}", timeout=300)
    assert export.returncode == 0 and f"its newest loadable checkpoint, {ckpt / checkpoint.name}" in export.stdout, (
        export.stderr[-2000:]
    )
    two, p2, _ = _evaluate(checkpoint, tmp_path / "two", "launcher.nproc_per_node=2")
    final = summary["eval"]  # the training run's own final evaluation, of the same weights
    assert one["eval"] == final and one["checkpoint"]["step"] == 8 and one["split"] == "eval"
    assert two["world_size"] == 2 and two["eval"].keys() == final.keys() and two["eval"]["n"] == final["n"]
    for key, value in final.items():
        assert two["eval"][key] == pytest.approx(value, rel=1e-5), key
    # the console line is training's, metrics formatted by format_eval
    assert "eval @ step 8" in proc.stdout and f"n {final['n']:,}" in proc.stdout
    for p in (p1, p2):  # every row of the eval set once, named the same for any world size
        assert len(p["row"]) == final["n"] and sorted(set(p["row"])) == p["row"] == list(range(final["n"]))
    assert p1["label"] == p2["label"]
    torch.testing.assert_close(torch.tensor(p2["score"]), torch.tensor(p1["score"]), **TOL)
    probability = torch.sigmoid(torch.tensor(p1["score"]))
    torch.testing.assert_close(torch.tensor(p1["probability"]), probability)
    labels = np.array(p1["label"])  # the file's rows are the rows the metrics counted
    assert labels.mean() == pytest.approx(final["ctr"])


@pytest.mark.dist
def test_a_ranking_checkpoint_gets_per_query_metrics_and_query_ids(trained, tmp_path):
    checkpoint, summary = trained["ranking"]
    result, p, _ = _evaluate(checkpoint, tmp_path / "rank", "launcher.nproc_per_node=2")
    final = result["eval"]
    assert final.keys() == summary["eval"].keys() and "ndcg@10" in final and "ne" not in final
    for key, value in summary["eval"].items():
        # step functions of the scores: one swapped near-tie (fp32 noise of the 2-rank
        # lookups) moves them by ~1e-3 on these 180 rows (as tests/test_ranking.py)
        assert final[key] == pytest.approx(value, abs=2e-3), key
    assert len(p["row"]) == len(set(p["row"])) == final["n"] and "probability" not in p
    assert len(set(p["query"])) == final["queries"] and min(p["relevance"]) >= 0


@pytest.mark.slow
def test_refusals_before_launch_are_one_line(tmp_path):
    """No checkpoint given, a checkpoint.dir without a loadable checkpoint: one line each, no rank."""
    os.makedirs(tmp_path / "ckpt" / "step_00000002")
    for args, message in (
        ([], "hybridrec: checkpoint is not set: give checkpoint=<dir>"),
        ([f"checkpoint={tmp_path / 'ckpt'}"], "holds no loadable checkpoint"),
    ):
        proc = commands.run("hybridrec.evaluate", *args, f"hydra.run.dir={tmp_path / 'run'}", timeout=120)
        last = proc.stderr.strip().splitlines()[-1]
        assert proc.returncode != 0 and "Traceback" not in proc.stderr and message in last, proc.stderr[-2000:]


@pytest.mark.unit
def test_a_checkpoint_dir_stands_for_its_newest_loadable_checkpoint(tmp_path):
    """evaluate and export take a run's checkpoint.dir for its newest loadable checkpoint
    (with real checkpoints: test_a_checkpoint_scores_as_training_scored_it_on_1_and_2_ranks)."""
    from hybridrec.checkpoint import resolve_checkpoint

    step = str(tmp_path / "ckpt" / "step_00000002")
    assert resolve_checkpoint(step) == (step, "")  # a step directory is taken as given
    assert resolve_checkpoint(str(tmp_path / "nope")) == (str(tmp_path / "nope"), "")  # check_checkpoint refuses it
    os.makedirs(step)  # committed, but without DCP's metadata: not loadable
    with pytest.raises(CheckpointError, match="holds no loadable checkpoint"):
        resolve_checkpoint(str(tmp_path / "ckpt"))
    # a run's output directory (what Hydra writes): where its checkpoints are, or that it has none
    run = tmp_path / "run"
    os.makedirs(run / ".hydra")
    (run / ".hydra" / "config.yaml").write_text(f"checkpoint:\n  dir: {tmp_path / 'ckpt'}\n")
    with pytest.raises(
        CheckpointError,
        match=rf"checkpoint={run} is a run's output directory, not a checkpoint: its "
        rf"checkpoints are in {tmp_path / 'ckpt'}: give checkpoint={tmp_path / 'ckpt'}$",
    ):
        resolve_checkpoint(str(run))
    (run / ".hydra" / "config.yaml").write_text("checkpoint:\n  dir: null\n")
    with pytest.raises(CheckpointError, match="that run saved no checkpoint"):
        resolve_checkpoint(str(run))
    # the guides say what the code does
    serving = open(os.path.join(os.path.dirname(__file__), "..", "docs", "serving.md")).read()
    assert "A `checkpoint.dir` stands for its newest loadable checkpoint" in serving
