"""Checkpoints: exact resume, resharding across world sizes and plans, atomic commit,
export for inference, and the guards around them."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import compose_cfg
from dist_helpers import launch, train_and_gather
from hydra.utils import instantiate

from hybridrec.checkpoint import latest, probe_writable
from hybridrec.export import build_model
from test_equivalence import BASE, TOL, assert_same_training

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
    two = launch(train_and_gather, 2, cfgs, str(tmp))
    # ... and continued on 1 rank
    one = launch(train_and_gather, 1, [_cfg(f"checkpoint.dir={tmp / 'd'}",
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
    tmp, two, _ = runs
    ckpt, out = tmp / "a" / "step_00000008", tmp_path / "model.pt"
    proc = subprocess.run([sys.executable, "-m", "hybridrec.export", f"checkpoint={ckpt}", f"out={out}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    model = build_model(str(ckpt))
    model.load_state_dict(torch.load(out))  # a plain state dict of full tensors
    model.eval()
    cfg = _cfg()
    batch = next(instantiate(cfg.data, seed=cfg.seed).batches("eval", 0, 1, 1))
    with torch.no_grad():
        _, (_, logits, _) = model(batch)
    torch.testing.assert_close(logits, two[0]["eval_logits"], **TOL)


def test_unwritable_checkpoint_dir_fails_before_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="not writable"):
        probe_writable(str(blocker / "ckpt"))
    proc = subprocess.run([sys.executable, "-m", "hybridrec.train", *BASE, f"checkpoint.dir={blocker / 'ckpt'}",
                           f"hydra.run.dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "not writable" in proc.stderr


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
