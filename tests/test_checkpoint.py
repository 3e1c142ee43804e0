"""Checkpoints: exact resume, resharding across world sizes and plans, atomic commit,
export for inference, the guards around them, and loading that never runs code."""

import json
import os
import shutil

import pytest
import torch

import commands
from conftest import compose_cfg
from dist_helpers import spawn, train_and_gather
from hybridrec.checkpoint import CheckpointError, TrainState, check_compatible, latest, probe_writable
from hybridrec.data import build_source, loader
from shared import BASE, TOL, assert_same_training, rehash
from trained import copy_of

RUN = BASE + ["train.steps=8", "checkpoint.every_n_steps=4", "sharding=table_wise"]


def _cfg(*extra):
    return compose_cfg(RUN + list(extra))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every training the module reads, in three scenarios (1 rank, 2 ranks, 1 rank): the
    2-rank runs and their resumes, and checkpoints crossing from 1 rank to 2 and back.
    ``two``: the results of ``cfgs`` below, in order; ``one``: [the 2-rank checkpoint
    continued on 1 rank, the 1-rank run]."""
    tmp = tmp_path_factory.mktemp("ckpt")
    a, b = tmp / "a", tmp / "b"
    # a 1-rank run of 4 steps, whose checkpoint the 2-rank scenario continues
    (first,) = spawn(train_and_gather, 1, [_cfg(f"checkpoint.dir={tmp / 'f'}", "train.steps=4")], str(tmp / "r1"))
    cfgs = [
        _cfg(f"checkpoint.dir={a}"),  # uninterrupted, checkpoints at 4 and 8
        _cfg(f"checkpoint.dir={b}", "train.steps=4"),  # stops after step 4 ...
        _cfg(f"checkpoint.dir={b}"),  # ... and resumes (checkpoint.resume=auto)
        # the step-4 checkpoint of the 2-rank table-wise run, continued row-wise
        _cfg(f"checkpoint.dir={tmp / 'c'}", f"checkpoint.resume={a / 'step_00000004'}", "sharding=row_wise"),
        # the same interruption with checkpoints written in the background
        _cfg(f"checkpoint.dir={tmp / 'e'}", "train.steps=4", "checkpoint.async_save=true"),
        _cfg(f"checkpoint.dir={tmp / 'e'}", "checkpoint.async_save=true"),
        # the 1-rank checkpoint continued on 2 ranks
        _cfg(f"checkpoint.dir={tmp / 'g'}", f"checkpoint.resume={tmp / 'f' / 'step_00000004'}"),
    ]
    two = spawn(train_and_gather, 2, cfgs, str(tmp / "r2"))
    # ... and the 2-rank checkpoint continued on 1 rank
    one = spawn(
        train_and_gather,
        1,
        [_cfg(f"checkpoint.dir={tmp / 'd'}", f"checkpoint.resume={a / 'step_00000004'}")],
        str(tmp / "r3"),
    )
    return tmp, two, [*one, first]


@pytest.mark.dist
def test_resume_is_bit_exact(runs):
    """The first reader of ``runs``: its setup trains the module's nine runs, once for every
    test here (the one over 20 s)."""
    _, two, _ = runs
    uninterrupted = two[0]
    for resumed in (two[2], two[5]):  # saved synchronously, and with async_save
        assert resumed["summary"]["train"]["resumed_from_step"] == 4
        assert resumed["losses"] == uninterrupted["losses"]  # bit for bit
        for key, value in uninterrupted["state"].items():
            assert torch.equal(resumed["state"][key], value), key


@pytest.mark.dist
def test_checkpoint_reshards_to_another_plan_and_world_size(runs):
    _, two, one = runs
    reference = two[0]
    for resumed in (two[3], one[0]):  # row-wise on 2 ranks, and 1 rank
        assert resumed["summary"]["train"]["resumed_from_step"] == 4
        torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(reference["losses"]), **TOL)
        assert_same_training(resumed, reference)
    assert {p["sharding_type"] for p in two[3]["summary"]["plan"].values()} == {"row_wise"}


@pytest.mark.dist
def test_a_one_rank_checkpoint_continues_on_two_ranks(runs):
    """One rank runs the dense part unwrapped (plain tensors, parallelize.dense_mode); its
    checkpoint continues under FSDP2 on 2 ranks as the uninterrupted 2-rank run trains."""
    _, two, one = runs
    first, resumed = one[1], two[6]
    assert first["summary"]["dense_parallel"] == "single"
    assert resumed["summary"]["dense_parallel"] == "fsdp"
    assert resumed["summary"]["train"]["resumed_from_step"] == 4
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(two[0]["losses"]), **TOL)
    assert_same_training(resumed, two[0])


@pytest.mark.dist
def test_keep_last_and_only_complete_checkpoints(runs, tmp_path):
    tmp, _, _ = runs
    assert sorted(os.listdir(tmp / "a")) == ["step_00000004", "step_00000008"]
    a = copy_of(tmp / "a", tmp_path)  # the other tests read the run's own
    os.makedirs(a / "step_00000012.partial")  # a save that was interrupted
    os.makedirs(a / "step_00000016")  # a directory without DCP's metadata
    assert latest(str(a)) == str(a / "step_00000008")


@pytest.mark.dist
def test_export_predicts_like_the_distributed_model(runs, tmp_path):
    """The exported program, fed plain tensors, scores the first eval batch as the 2-rank
    trained model did (sigmoid of its logits: loss=pointwise is calibrated)."""
    tmp, two, _ = runs
    ckpt, out = tmp / "a" / "step_00000008", tmp_path / "export"
    proc = commands.run("hybridrec.export", f"checkpoint={ckpt}", f"out={out}", timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.load(open(out / "model.json"))["output"] == "probability"
    program = torch.export.load(out / "model.pt2").module()
    cfg = _cfg()
    batch = next(loader.batches(build_source(cfg.data, cfg.seed), "eval", 0, 1, 1)).batch
    with torch.no_grad():
        scores = program(batch.dense_features, batch.sparse_features.values(), batch.sparse_features.lengths())
    torch.testing.assert_close(scores, torch.sigmoid(two[0]["eval_logits"]), **TOL)


class _Planted:
    """A pickled object that runs a command when unpickled: what a full torch.load would do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.dist
def test_checkpoint_state_is_json_and_plain_tensors(runs):
    tmp, two, _ = runs
    ckpt = tmp / "a" / "step_00000008"
    fields = json.load(open(ckpt / "trainer_state.json"))
    assert fields["step"] == 8 and len(fields["schedulers"]) == 2 and fields["num_dense_features"] > 0
    assert fields["data_version"] == 2  # the synthetic log's generator
    tensors = torch.load(ckpt / "trainer_state.pt", weights_only=True)
    assert tensors["rng"].dtype == torch.uint8 and tensors["rng"].shape[0] == 2
    assert tensors["losses"].tolist() == two[0]["losses"]  # float64: the logged losses exactly


@pytest.mark.dist
def test_a_planted_pickle_is_refused_and_never_run(runs, tmp_path):
    tmp, _, _ = runs
    ckpt, marker = tmp_path / "planted", tmp_path / "ran"
    shutil.copytree(tmp / "a" / "step_00000004", ckpt)
    torch.save({"rng": _Planted(marker), "losses": torch.zeros(4)}, ckpt / "trainer_state.pt")
    rehash(ckpt)  # checksums fixed up: what refuses it is the pickle check, not the checksum
    export = ["hybridrec.export", f"checkpoint={ckpt}"]
    resume = [
        "hybridrec.train",
        *RUN,
        f"checkpoint.resume={ckpt}",
        f"checkpoint.dir={tmp_path}",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    for cmd, prefix in ((export, "hybridrec.export: "), (resume, "hybridrec: ")):
        proc = commands.run(*cmd, timeout=120)
        assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert (
            proc.stderr.strip()
            .splitlines()[-1]
            .startswith(
                f"{prefix}{ckpt / 'trainer_state.pt'} is not safe to open: it holds a pickled object that would call "
                "posix.system"
            )
        ), proc.stderr[-2000:]
        assert "refused, nothing in it was run" in proc.stderr
        assert not marker.exists()
    assert not (ckpt / "export").exists()


@pytest.mark.dist
def test_old_or_broken_state_files_are_refused(runs, tmp_path):
    tmp, _, _ = runs
    ckpt, marker = tmp_path / "old", tmp_path / "ran"
    shutil.copytree(tmp / "a" / "step_00000004", ckpt)
    with open(ckpt / "trainer_state.json", "wb") as f:  # JSON cannot hold objects: only unreadable
        f.write(b"\x80\x04not json")
    with pytest.raises(CheckpointError, match="trainer_state.json is damaged: not valid JSON"):
        TrainState.from_files(str(ckpt))
    # An older hybridrec kept its state as pickled objects in trainer_state.pt alone: never opened.
    os.remove(ckpt / "trainer_state.json")
    torch.save({"step": 4, "rng": [_Planted(marker)]}, ckpt / "trainer_state.pt")
    with pytest.raises(CheckpointError, match="written by an older hybridrec"):
        TrainState.from_files(str(ckpt))
    assert not marker.exists()


@pytest.mark.slow
def test_unwritable_checkpoint_dir_fails_before_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="not writable"):
        probe_writable(str(blocker / "ckpt"))
    proc = commands.run(
        "hybridrec.train", *BASE, f"checkpoint.dir={blocker / 'ckpt'}", f"hydra.run.dir={tmp_path / 'run'}", timeout=60
    )
    assert proc.returncode != 0 and "not writable" in proc.stderr


@pytest.mark.slow
def test_non_finite_loss_stops_before_a_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = commands.run(
        "hybridrec.train",
        *BASE,
        "train.steps=8",
        "train.log_every=1",
        "optimizer=sgd",
        "optimizer.dense.lr=1e30",
        "optimizer.sparse.lr=1e30",
        f"checkpoint.dir={ckpt}",
        "checkpoint.every_n_steps=1",
        f"hydra.run.dir={tmp_path / 'run'}",
        timeout=120,
    )
    assert proc.returncode != 0 and "non-finite loss" in proc.stderr
    step = int(proc.stderr.split("non-finite loss")[1].split("at step ")[1].split(":")[0])
    last = latest(str(ckpt))
    assert last is None or int(last.rsplit("_", 1)[1]) < step  # only checkpoints before the bad step


@pytest.fixture
def one_rank_group():
    """A world of one in this process: DTensors and ShardedTensors need a process group."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.unit
def test_async_staging_copies_every_kind_of_tensor_to_the_host(one_rank_group):
    """What the background writer saves: host copies (never views, never left on the GPU)
    of plain tensors, FSDP2's DTensors and TorchRec's ShardedTensors, layouts kept."""
    from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, init_from_local_shards
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.distributed.tensor import Shard as DShard

    from hybridrec.checkpoint.saver import _stage

    table = torch.arange(12.0).reshape(4, 3)
    sharded = init_from_local_shards([Shard(table.clone(), ShardMetadata([0, 0], [4, 3], "rank:0/cpu"))], 4, 3)
    state = {
        "model": {
            "dense": torch.ones(3),
            "table": sharded,
            "fsdp": distribute_tensor(torch.randn(4, 2), init_device_mesh("cpu", (1,)), [DShard(0)]),
        },
        "optim": {"step": 7, "state": [torch.zeros(2)]},
    }
    staged = _stage(state)
    originals = [
        state["model"]["dense"],
        sharded.local_shards()[0].tensor,
        state["model"]["fsdp"].to_local(),
        state["optim"]["state"][0],
    ]
    copies = [
        staged["model"]["dense"],
        staged["model"]["table"].local_shards()[0].tensor,
        staged["model"]["fsdp"].to_local(),
        staged["optim"]["state"][0],
    ]
    for original, copy in zip(originals, copies):
        assert copy.device.type == "cpu" and torch.equal(copy, original)
        assert copy.untyped_storage().data_ptr() != original.untyped_storage().data_ptr()  # a copy, not a view
        original.add_(1.0)  # training goes on: the staged state does not move
        assert not torch.equal(copy, original)
    assert isinstance(staged["model"]["fsdp"], DTensor) and staged["model"]["fsdp"].placements == (DShard(0),)
    assert staged["model"]["table"].metadata().shards_metadata[0].placement.device() == torch.device("cpu")
    assert staged["model"]["table"].size() == torch.Size([4, 3]) and staged["optim"]["step"] == 7


# ------------------------------------------------------------- resuming another model's checkpoint
def _saved(tmp_path, overrides, features=None, num_dense=None):
    """A checkpoint directory's config.yaml and TrainState for the run ``overrides`` describe
    (its own source's features unless given), and the path."""
    from omegaconf import OmegaConf

    cfg = compose_cfg(overrides)
    if features is None:
        source = build_source(cfg.data, cfg.seed)
        features, num_dense = [vars(f) for f in source.features], source.num_dense_features
    path = tmp_path / "step_00000010"
    path.mkdir()
    OmegaConf.save(cfg, path / "config.yaml", resolve=True)
    state = TrainState(
        step=10,
        schedulers=[],
        features=features,
        num_dense_features=num_dense,
        rng=torch.zeros(1, 8, dtype=torch.uint8),
        losses=torch.zeros(10),
        runs=["r"],
    )
    return str(path), state


def _check(path, state, overrides):
    cfg = compose_cfg(overrides)
    source = build_source(cfg.data, cfg.seed)
    check_compatible(cfg, path, state, source.features, source.num_dense_features)


@pytest.mark.unit
def test_resume_across_parallelism_and_training_settings_is_compatible(tmp_path):
    path, state = _saved(tmp_path, BASE + ["mesh=fsdp", "sharding=table_wise"])
    # another world size, mesh, sharding, pipeline, batch, learning rate, length: same weights
    _check(
        path,
        state,
        BASE
        + [
            "mesh=ddp",
            "sharding=row_wise",
            "launcher.nproc_per_node=2",
            "topology.world_size=2",
            "train.pipeline=base",
            "data.batch_size=128",
            "optimizer.dense.lr=0.5",
            "train.steps=100",
            "seed=3",
        ],
    )


@pytest.mark.unit
def test_two_tower_temperature_may_change_on_resume(tmp_path):
    features = [
        {"name": n, "num_embeddings": 10, "pooling_factor": 1.0}
        for n in ("user", "item", "age", "gender", "occupation", "zip")
    ]
    path, state = _saved(tmp_path, ["model=two_tower", "loss=sampled_softmax"], features, 13)
    cfg = compose_cfg(["model=two_tower", "loss=sampled_softmax", "model.temperature=0.05", "model.normalize=false"])
    from hybridrec.data import SparseFeature

    check_compatible(cfg, path, state, [SparseFeature(**f) for f in features], 13)
    cfg = compose_cfg(["model=two_tower", "loss=sampled_softmax", "model.tower_layer_sizes=[32,16]"])
    with pytest.raises(CheckpointError, match=r"model.tower_layer_sizes: checkpoint \[64, 32\], run \[32, 16\]"):
        check_compatible(cfg, path, state, [SparseFeature(**f) for f in features], 13)


@pytest.mark.unit
def test_another_model_is_refused_naming_every_difference(tmp_path):
    # The two-tower retrieval checkpoint of the README, resumed by the ctr experiment (same checkpoint.dir)
    features = [
        {"name": n, "num_embeddings": 100, "pooling_factor": 1.0}
        for n in ("user", "item", "age", "gender", "occupation", "zip", "genres")
    ]
    path, state = _saved(tmp_path, ["+experiment=movielens_retrieval"], features, 2)
    with pytest.raises(CheckpointError) as e:
        _check(path, state, ["+experiment=ctr", "checkpoint.dir=ckpt"])
    assert str(e.value) == (
        f"checkpoint {path} does not fit this run (model._target_: checkpoint TwoTower, run DLRMRanker; "
        f"tables: only in the checkpoint [t_user, t_item, t_age +4 more], only in the run "
        f"[t_cat_0, t_cat_1, t_cat_2 +23 more]; dense features: checkpoint 2, run 13; "
        f"loss._target_: checkpoint InBatchSoftmax, run BCE): train this config in another checkpoint.dir, or resume with the config it was saved with ({path}/config.yaml)"
    )


@pytest.mark.unit
def test_resized_tables_layers_and_optimizers_are_refused(tmp_path):
    path, state = _saved(tmp_path, BASE)
    with pytest.raises(CheckpointError) as e:
        _check(
            path,
            state,
            BASE
            + [
                "data.num_embeddings_per_feature=[300,200,100,60]",
                "model.embedding_dim=4",
                "model.dense_arch_layer_sizes=[16,4]",
                "optimizer=sgd",
                f"checkpoint.resume={path}",
            ],
        )
    assert str(e.value) == (
        f"checkpoint {path} does not fit this run (model.embedding_dim: checkpoint 8, run 4; "
        f"model.dense_arch_layer_sizes: checkpoint [16, 8], run [16, 4]; t_cat_3 rows: checkpoint 50, run 60; "
        f"optimizer.sparse._target_: checkpoint RowWiseAdagrad, run SGD; optimizer.dense._target_: checkpoint "
        f"Adagrad, run SGD): resume a checkpoint of this model, or train from scratch with checkpoint.resume=never "
        f"(its config: {path}/config.yaml)"
    )


@pytest.mark.unit
def test_the_state_carries_the_metrics_history_up_to_its_step(tmp_path):
    """The records of metrics.jsonl travel in trainer_state.json (JSON, under its checksum); a
    record after the checkpoint's step is refused: the resumed run would train it again."""
    path, state = _saved(tmp_path, BASE)
    state.losses = torch.zeros(10, dtype=torch.float64)
    state.history = [
        {"step": 10, "loss": 0.5, "loss_mean": 0.6, "lr": {"dense": 0.1}},
        {"step": 10, "split": "valid", "eval": {"auc": 0.7, "n": 64}},
        {"event": "resume", "step": 5, "path": "/ck/step_00000005"},
    ]
    state.to_files(path)
    assert TrainState.from_files(path).history == state.history
    state.history = [{"step": 11, "loss": 0.5}]  # written after the checkpoint's step
    state.to_files(path)
    with pytest.raises(
        CheckpointError,
        match=r"field 'history\[0\]' is .* expected a metrics record with a step "
        r"from 0 to 10",
    ):
        TrainState.from_files(path)


@pytest.mark.unit
def test_a_checkpoint_of_another_generator_version_is_not_resumed(tmp_path):
    """A synthetic-log checkpoint records the generator's version; one of another version (or
    one written before versions were recorded: version 1's rows) is refused in one line, since
    the same seed draws other rows. Evaluating or exporting it stays allowed."""
    from hybridrec.data.synthetic import SyntheticClickLog

    path, state = _saved(tmp_path, BASE)
    cfg = compose_cfg(BASE)
    source = build_source(cfg.data, cfg.seed)
    args = (cfg, path, state, source.features, source.num_dense_features)
    state.data_version, state.losses = SyntheticClickLog.version, torch.zeros(10, dtype=torch.float64)
    check_compatible(*args, SyntheticClickLog.version)  # the same version resumes
    state.to_files(path)
    assert TrainState.from_files(path).data_version == SyntheticClickLog.version  # recorded
    for old in (None, 1):
        state.data_version = old
        with pytest.raises(CheckpointError) as e:
            check_compatible(*args, SyntheticClickLog.version)
        assert str(e.value) == (
            f"checkpoint {path} was trained on rows of version 1 of SyntheticClickLog, and this hybridrec draws "
            f"version {SyntheticClickLog.version}: the same seed gives other rows, so the run cannot go on where it "
            f"stopped; train anew (another checkpoint.dir, or checkpoint.resume=never)"
        )
    check_compatible(*args[:-2], source.features, source.num_dense_features, None)  # files: no version to match
