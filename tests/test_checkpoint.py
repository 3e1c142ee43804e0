"""Checkpoints: exact resume, resharding across world sizes and plans, atomic commit,
export for inference, the guards around them, and loading that never runs code."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import compose_cfg
from dist_helpers import spawn, train_and_gather
from hybridrec.data import build_source

from hybridrec.checkpoint import CheckpointError, TrainState, latest, probe_writable
from shared import BASE, TOL, assert_same_training

RUN = BASE + ["train.steps=8", "checkpoint.every_n_steps=4", "sharding=table_wise"]


def _cfg(*extra):
    return compose_cfg(RUN + list(extra))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt")
    a, b = tmp / "a", tmp / "b"
    cfgs = [
        _cfg(f"checkpoint.dir={a}"),  # uninterrupted, checkpoints at 4 and 8
        _cfg(f"checkpoint.dir={b}", "train.steps=4"),  # stops after step 4 ...
        _cfg(f"checkpoint.dir={b}"),  # ... and resumes (checkpoint.resume=auto)
        # the step-4 checkpoint of the 2-rank table-wise run, continued row-wise
        _cfg(f"checkpoint.dir={tmp / 'c'}", f"checkpoint.resume={a / 'step_00000004'}", "sharding=row_wise"),
        # the same interruption with checkpoints written in the background
        _cfg(f"checkpoint.dir={tmp / 'e'}", "train.steps=4", "checkpoint.async_save=true"),
        _cfg(f"checkpoint.dir={tmp / 'e'}", "checkpoint.async_save=true"),
    ]
    two = spawn(train_and_gather, 2, cfgs, str(tmp))
    # ... and continued on 1 rank
    one = spawn(train_and_gather, 1, [_cfg(f"checkpoint.dir={tmp / 'd'}",
                                            f"checkpoint.resume={a / 'step_00000004'}")], str(tmp))
    return tmp, two, one


@pytest.mark.dist
def test_resume_is_bit_exact(runs):
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
def test_keep_last_and_only_complete_checkpoints(runs):
    tmp, _, _ = runs
    assert sorted(os.listdir(tmp / "a")) == ["step_00000004", "step_00000008"]
    os.makedirs(tmp / "a" / "step_00000012.partial")  # a save that was interrupted
    os.makedirs(tmp / "a" / "step_00000016")  # a directory without DCP's metadata
    assert latest(str(tmp / "a")) == str(tmp / "a" / "step_00000008")


@pytest.mark.dist
def test_export_predicts_like_the_distributed_model(runs, tmp_path):
    """The exported program, fed plain tensors, scores the first eval batch as the 2-rank
    trained model did (sigmoid of its logits: loss=pointwise is calibrated)."""
    tmp, two, _ = runs
    ckpt, out = tmp / "a" / "step_00000008", tmp_path / "export"
    proc = subprocess.run([sys.executable, "-m", "hybridrec.export", f"checkpoint={ckpt}", f"out={out}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.load(open(out / "model.json"))["output"] == "probability"
    program = torch.export.load(out / "model.pt2").module()
    cfg = _cfg()
    batch = next(build_source(cfg.data, cfg.seed).batches("eval", 0, 1, 1)).batch
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
    tensors = torch.load(ckpt / "trainer_state.pt", weights_only=True)
    assert tensors["rng"].dtype == torch.uint8 and tensors["rng"].shape[0] == 2
    assert tensors["losses"].tolist() == two[0]["losses"]  # float64: the logged losses exactly


@pytest.mark.dist
def test_a_planted_pickle_is_refused_and_never_run(runs, tmp_path):
    tmp, _, _ = runs
    ckpt, marker = tmp_path / "planted", tmp_path / "ran"
    shutil.copytree(tmp / "a" / "step_00000004", ckpt)
    torch.save({"rng": _Planted(marker), "losses": torch.zeros(4)}, ckpt / "trainer_state.pt")
    export = [sys.executable, "-m", "hybridrec.export", f"checkpoint={ckpt}"]
    resume = [sys.executable, "-m", "hybridrec.train", *RUN, f"checkpoint.resume={ckpt}", f"checkpoint.dir={tmp_path}",
              f"hydra.run.dir={tmp_path / 'run'}"]
    for cmd, prefix in ((export, "hybridrec.export: "), (resume, "hybridrec: ")):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert proc.stderr.strip().splitlines()[-1].startswith(
            f"{prefix}{ckpt / 'trainer_state.pt'} is not a safe checkpoint file (it holds pickled objects"
        ), proc.stderr[-2000:]
        assert not marker.exists()
    assert not (ckpt / "export").exists()


@pytest.mark.dist
def test_old_or_broken_state_files_are_refused(runs, tmp_path):
    tmp, _, _ = runs
    ckpt, marker = tmp_path / "old", tmp_path / "ran"
    shutil.copytree(tmp / "a" / "step_00000004", ckpt)
    with open(ckpt / "trainer_state.json", "wb") as f:  # JSON cannot hold objects: only unreadable
        f.write(b"\x80\x04not json")
    with pytest.raises(CheckpointError, match="trainer_state.json is not a valid checkpoint file"):
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
    proc = subprocess.run([sys.executable, "-m", "hybridrec.train", *BASE, f"checkpoint.dir={blocker / 'ckpt'}",
                           f"hydra.run.dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "not writable" in proc.stderr


@pytest.mark.slow
def test_non_finite_loss_stops_before_a_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = subprocess.run([sys.executable, "-m", "hybridrec.train", *BASE, "train.steps=8", "train.log_every=1",
                           "optimizer=sgd", "optimizer.dense.lr=1e30", "optimizer.sparse.lr=1e30",
                           f"checkpoint.dir={ckpt}", "checkpoint.every_n_steps=1", f"hydra.run.dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, timeout=120)
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
    from torch.distributed.tensor import DTensor, Shard as DShard, distribute_tensor

    from hybridrec.checkpoint import _stage

    table = torch.arange(12.0).reshape(4, 3)
    sharded = init_from_local_shards([Shard(table.clone(), ShardMetadata([0, 0], [4, 3], "rank:0/cpu"))], 4, 3)
    state = {"model": {"dense": torch.ones(3), "table": sharded,
                       "fsdp": distribute_tensor(torch.randn(4, 2), init_device_mesh("cpu", (1,)), [DShard(0)])},
             "optim": {"step": 7, "state": [torch.zeros(2)]}}
    staged = _stage(state)
    originals = [state["model"]["dense"], sharded.local_shards()[0].tensor, state["model"]["fsdp"].to_local(),
                 state["optim"]["state"][0]]
    copies = [staged["model"]["dense"], staged["model"]["table"].local_shards()[0].tensor,
              staged["model"]["fsdp"].to_local(), staged["optim"]["state"][0]]
    for original, copy in zip(originals, copies):
        assert copy.device.type == "cpu" and torch.equal(copy, original)
        assert copy.untyped_storage().data_ptr() != original.untyped_storage().data_ptr()  # a copy, not a view
        original.add_(1.0)  # training goes on: the staged state does not move
        assert not torch.equal(copy, original)
    assert isinstance(staged["model"]["fsdp"], DTensor) and staged["model"]["fsdp"].placements == (DShard(0),)
    assert staged["model"]["table"].metadata().shards_metadata[0].placement.device() == torch.device("cpu")
    assert staged["model"]["table"].size() == torch.Size([4, 3]) and staged["optim"]["step"] == 7
