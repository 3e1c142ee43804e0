"""What users do wrong, and what goes wrong under them: each is one `hybridrec: ...` line
naming the file or key (no traceback), and no checkpoint is lost on the way. Each test is a
failure that was observed, with the outcome now expected."""

import json
import logging
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import commands
from conftest import compose_cfg
from hybridrec.checkpoint import CheckpointError, latest
from hybridrec.run.errors import user_message
from hybridrec.train import check_before_launch

# A tiny run (the equivalence tests' sizes): seconds per training.
TINY = [
    "data.batch_size=64",
    "data.num_embeddings_per_feature=[300,200,100,50]",
    "data.ids_per_feature=2",
    "data.eval_batches=2",
    "model.embedding_dim=8",
    "model.dense_arch_layer_sizes=[16,8]",
    "model.over_arch_layer_sizes=[16,1]",
    "train.log_every=4",
]


def _train(*args, timeout=180):
    return commands.run("hybridrec.train", *TINY, *args, timeout=timeout)


def _one_line_error(proc) -> str:
    """The error line of a failed run, after checking it is the only report: no traceback."""
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-5000:]
    lines = [line for line in proc.stderr.replace("\r", "\n").splitlines() if line.strip()]
    assert lines[-1].startswith("hybridrec: "), proc.stderr[-3000:]
    return lines[-1]


def _refusal(*args) -> str:
    """The line `python -m hybridrec.train <TINY> <args>` prints when it refuses to launch:
    the same check (``check_before_launch``) and the same formatting, in this process. Each
    kind of refusal is also run once through the CLI below (one line, no traceback, no rank)."""
    with pytest.raises(ValueError) as refused:
        check_before_launch(compose_cfg([*TINY, *args]))
    return user_message(refused.value)


def _mark(step_dir, run_id):
    """Make a checkpoint look written by another run."""
    path = os.path.join(step_dir, "trainer_state.json")
    fields = json.load(open(path))
    json.dump({**fields, "runs": [run_id]}, open(path, "w"))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A run's checkpoints at steps 10 and 20, then continued to 40 (resume=auto) with another
    run's older checkpoint placed in the same directory."""
    tmp = tmp_path_factory.mktemp("owned")
    d = tmp / "ckpt"
    first = _train(
        "train.steps=20", f"checkpoint.dir={d}", "checkpoint.every_n_steps=10", f"hydra.run.dir={tmp / 'run1'}"
    )
    assert first.returncode == 0, first.stderr[-3000:]
    assert sorted(os.listdir(d)) == [".lock", "step_00000010", "step_00000020"]
    shutil.copytree(d / "step_00000010", d / "step_00000005")
    _mark(d / "step_00000005", "another-run")
    second = _train(
        "train.steps=40", f"checkpoint.dir={d}", "checkpoint.every_n_steps=10", f"hydra.run.dir={tmp / 'run2'}"
    )
    assert second.returncode == 0, second.stderr[-3000:]
    return tmp, d


@pytest.mark.slow
def test_pruning_keeps_another_runs_checkpoints(ckpt):
    _, d = ckpt
    # keep_last=2 pruned the first run's 10 and 20 (the resumed run continues it), never step 5
    assert sorted(os.listdir(d)) == [".lock", "step_00000005", "step_00000030", "step_00000040"]
    runs = json.load(open(d / "step_00000040" / "trainer_state.json"))["runs"]
    assert len(runs) == 2 and runs[0] == json.load(open(d / "step_00000030" / "trainer_state.json"))["runs"][0]


@pytest.mark.slow
def test_a_directory_of_another_run_is_refused_before_launch(ckpt):
    _, d = ckpt
    line = _refusal(
        "train.steps=20",
        f"checkpoint.dir={d}",
        "checkpoint.every_n_steps=10",
        "checkpoint.resume=never",
        "checkpoint.keep_last=1",
    )
    assert line.startswith(
        f"hybridrec: checkpoint.dir={d} holds checkpoints of another run (newest: step_00000040, "
        f"step 40) and checkpoint.resume=never"
    )
    assert "another checkpoint.dir" in line and "checkpoint.resume=auto" in line and "delete" in line
    assert sorted(os.listdir(d)) == [".lock", "step_00000005", "step_00000030", "step_00000040"]  # nothing touched


@pytest.mark.slow
@pytest.mark.parametrize("resume", ["auto", "step_00000040"])
def test_resume_with_nothing_left_to_train_is_refused(ckpt, tmp_path, resume):
    _, d = ckpt
    resume = resume if resume == "auto" else str(d / resume)
    args = ["train.steps=30", f"checkpoint.dir={d}", f"checkpoint.resume={resume}"]
    # auto through the CLI, an explicit path in this process (the same check)
    line = _one_line_error(_train(*args, f"hydra.run.dir={tmp_path}")) if resume == "auto" else _refusal(*args)
    assert line == (
        f"hybridrec: checkpoint {d / 'step_00000040'} is at step 40 and train.steps=30: nothing to "
        f"train; raise train.steps (the total, e.g. train.steps=70), or start a new run in another "
        f"checkpoint.dir"
    )


@pytest.mark.slow
def test_a_profile_window_past_the_end_of_a_resumed_run_is_refused(ckpt):
    """profile.start_step counts from the resumed process's first step: 40 + 5 + 5 > 45."""
    _, d = ckpt
    line = _refusal("train.steps=45", f"checkpoint.dir={d}", "profile.enabled=true")
    assert line == (
        f"hybridrec: invalid config: profile.start_step=5 + profile.steps=5 must fit in the 5 steps "
        f"left after resuming {d / 'step_00000040'} at step 40: lower them, or raise train.steps "
        f"(the total) to at least 50"
    )
    check_before_launch(compose_cfg([*TINY, "train.steps=50", f"checkpoint.dir={d}", "profile.enabled=true"]))


@pytest.mark.slow
@pytest.mark.parametrize("missing", ["__0_0.distcp", "trainer_state.pt", ".metadata"])
def test_a_damaged_newest_checkpoint_is_skipped_loudly(ckpt, tmp_path, caplog, missing):
    _, d = ckpt
    copy = tmp_path / "ckpt"
    shutil.copytree(d, copy)
    os.remove(copy / "step_00000040" / missing)
    with caplog.at_level(logging.WARNING, logger="hybridrec.checkpoint"):
        assert latest(str(copy), warn=True) == str(copy / "step_00000030")
    assert f"resuming from {copy / 'step_00000030'}" in caplog.text
    assert f"{copy / 'step_00000040' / missing} is missing" in caplog.text
    # every checkpoint damaged: refused, not trained over from scratch
    for step in ("00000005", "00000030"):
        os.remove(copy / f"step_{step}" / "__0_0.distcp")
    with pytest.raises(CheckpointError, match=f"checkpoint.dir={copy} holds no loadable checkpoint"):
        latest(str(copy))


@pytest.mark.slow
def test_damaged_checkpoints_fail_before_launch_naming_the_file(ckpt, tmp_path):
    _, d = ckpt
    copy = tmp_path / "ckpt"
    shutil.copytree(d, copy)
    os.remove(copy / "step_00000040" / "__0_0.distcp")
    # an explicit path: refused
    line = _refusal(
        "train.steps=50", f"checkpoint.dir={tmp_path / 'new'}", f"checkpoint.resume={copy / 'step_00000040'}"
    )
    assert line == (
        f"hybridrec: {copy / 'step_00000040'} is damaged: {copy / 'step_00000040' / '__0_0.distcp'} "
        f"is missing (its .metadata lists it)"
    )
    # (checkpoint.resume=/nonexistent through the CLI: tests/test_config.py::test_cli_errors_are_one_line)
    assert (
        _refusal("checkpoint.resume=/nonexistent")
        == "hybridrec: checkpoint.resume=/nonexistent: no such checkpoint directory"
    )
    # auto: the previous complete checkpoint, with a warning naming the missing file
    proc = _train(
        "train.steps=50", f"checkpoint.dir={copy}", "checkpoint.every_n_steps=10", f"hydra.run.dir={tmp_path / 'c'}"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    warning = next(line for line in (proc.stdout + proc.stderr).splitlines() if "WARNING" in line)
    assert f"resuming from {copy / 'step_00000030'}" in warning and "__0_0.distcp is missing" in warning
    assert json.load(open(tmp_path / "c" / "summary.json"))["train"]["resumed_from_step"] == 30


@pytest.mark.slow
def test_a_checkpoint_of_another_model_is_one_line(ckpt, tmp_path):
    _, d = ckpt
    line = _refusal(
        "train.steps=50",
        "data.num_embeddings_per_feature=[300,200,100,60]",
        f"checkpoint.resume={d / 'step_00000040'}",
        f"checkpoint.dir={tmp_path / 'new'}",
    )
    assert line == (
        f"hybridrec: checkpoint {d / 'step_00000040'} does not fit this run (t_cat_3 rows: checkpoint 50, "
        f"run 60): resume a checkpoint of this model, or train from scratch with checkpoint.resume=never "
        f"(its config: {d / 'step_00000040' / 'config.yaml'})"
    )


@pytest.mark.slow
def test_another_model_in_the_same_checkpoint_dir_fails_before_launch(ckpt, tmp_path):
    """Two README examples with one checkpoint.dir: the second model would resume (resume=auto)
    the first one's checkpoint. Refused before any rank starts, so no elastic restart retries it."""
    _, d = ckpt
    before = sorted(os.listdir(d))
    proc = _train(
        "model=dcn",
        "train.steps=50",
        f"checkpoint.dir={d}",
        "launcher.nproc_per_node=2",
        "launcher.max_restarts=3",
        f"hydra.run.dir={tmp_path}",
    )
    line = _one_line_error(proc)
    assert line.startswith(
        f"hybridrec: checkpoint {d / 'step_00000040'} does not fit this run (model._target_: "
        f"checkpoint DLRMRanker, run DCNRanker): train this config in another checkpoint.dir"
    )
    # no launch: no rank printed its plan, none was restarted
    assert "Embedding plan" not in proc.stdout + proc.stderr and "restart" not in proc.stderr
    assert sorted(os.listdir(d)) == before


@pytest.mark.slow
def test_export_to_a_bad_path_is_one_line(ckpt):
    _, d = ckpt
    proc = commands.run(
        "hybridrec.export", f"checkpoint={d / 'step_00000040'}", "out=/nonexistent/dir/export", timeout=60
    )
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "hybridrec.export: out=/nonexistent/dir/export: /nonexistent/dir is not a writable directory"
    )


# ------------------------------------------------------------------ disk full while saving
def _small_filesystem(path) -> bool:
    """A 160 KiB tmpfs at ``path``: room for one tiny checkpoint, not two (needs root)."""
    os.makedirs(path)
    return (
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=160k", "tmpfs", str(path)], capture_output=True).returncode
        == 0
    )


_ENOSPC_AT_STEP_20 = """
import errno, sys
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemWriter
original = FileSystemWriter.write_data
def write_data(self, plan, planner):
    if "step_00000020" in str(self.path):
        raise OSError(errno.ENOSPC, "No space left on device")
    return original(self, plan, planner)
FileSystemWriter.write_data = write_data
import runpy
sys.argv = ["hybridrec.train", *sys.argv[1:]]
runpy.run_module("hybridrec.train", run_name="__main__")
"""


@pytest.mark.slow
def test_disk_full_while_saving_is_one_line_and_keeps_the_previous_checkpoint(tmp_path):
    d = tmp_path / "small"
    mounted = _small_filesystem(d)
    args = [
        *TINY,
        "train.steps=20",
        f"checkpoint.dir={d}",
        "checkpoint.every_n_steps=10",
        "checkpoint.keep_last=1",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    try:
        if mounted:  # a real full disk
            proc = commands.run("hybridrec.train", *args, timeout=180)
        else:  # no mount permission: the storage writer fails as a full disk does (a script, not a
            # module: a new interpreter that patches the writer, then runs the command)
            proc = subprocess.run(
                [sys.executable, "-c", _ENOSPC_AT_STEP_20, *args], capture_output=True, text=True, timeout=180
            )
        line = _one_line_error(proc)
        assert line.startswith(
            "hybridrec: checkpoint save at step 20 failed: no space left on device (OSError: "
            "[Errno 28] No space left on device;"
        )
        assert f"removed the partial save {d / 'step_00000020.partial'}" in line
        assert f"the previous checkpoint {d / 'step_00000010'} is intact" in line
        assert sorted(os.listdir(d)) == [".lock", "step_00000010"]
        assert latest(str(d)) == str(d / "step_00000010")  # loadable: every file it lists is there
    finally:
        if mounted:
            subprocess.run(["umount", str(d)], check=False)


# ------------------------------------------------------------------ data errors inside the ranks
def _criteo(path, rows, bad_line=None):
    rng = np.random.default_rng(0)
    lines = []
    for _ in range(rows):
        cats = [f"{v:08x}" for v in rng.integers(0, 2**32, 26)]
        lines.append("\t".join(["1"] + [str(v) for v in rng.integers(0, 50, 13)] + cats))
    if bad_line:
        lines[bad_line - 1] = lines[bad_line - 1].replace("\t", "\t12x", 1)  # label, then a non-integer
    path.write_text("\n".join(lines) + "\n")
    return str(path)


# data=criteo at the tiny run's sizes (26 tables)
CRITEO = [
    "data=criteo",
    "data.batch_size=64",
    f"data.num_embeddings_per_feature=[{','.join(['50'] * 26)}]",
    "data.eval_batches=1",
    "data.bad_rows=fail",
    "model.embedding_dim=8",
    "model.dense_arch_layer_sizes=[16,8]",
    "model.over_arch_layer_sizes=[16,1]",
    "train.steps=8",
    "train.log_every=4",
]


@pytest.mark.parametrize(
    "case,ranks",
    [
        pytest.param("bad_row", 1, marks=pytest.mark.slow),
        pytest.param("bad_row", 2, marks=pytest.mark.dist),
        pytest.param("too_small", 1, marks=pytest.mark.slow),
    ],
)
def test_data_errors_inside_the_ranks_are_one_line(tmp_path, case, ranks):
    """A bad row reaches one rank only (its shard): the others are stopped, quietly. With a
    restart budget, the job still ends at the first attempt: restarted ranks would read the
    same row."""
    train = _criteo(
        tmp_path / "train.tsv", 300 if case == "bad_row" else 40, bad_line=150 if case == "bad_row" else None
    )
    test = _criteo(tmp_path / "test.tsv", 64)
    shards = ["data.shards=1"] if case == "too_small" else []
    restarts = ["launcher.max_restarts=2", f"checkpoint.dir={tmp_path / 'ckpt'}"] if ranks > 1 else []
    proc = commands.run(
        "hybridrec.train",
        *CRITEO,
        *shards,
        *restarts,
        f"data.train_path={train}",
        f"data.eval_path={test}",
        f"launcher.nproc_per_node={ranks}",
        f"hydra.run.dir={tmp_path / 'run'}",
        timeout=240,
    )
    # one attempt: rank 0 reports its plan once per start of the ranks
    assert (proc.stdout + proc.stderr).count("Embedding plan") == 1, proc.stdout + proc.stderr
    expected = {
        "bad_row": f"hybridrec: {train}:150: int_0 '12x1",
        "too_small": "hybridrec: data.train_path has 40 usable rows in shard 0 of data.shards=1, fewer "
        "than its 64 rows of one global batch (data.batch_size=64)",
    }[case]
    assert _one_line_error(proc).startswith(expected)
    assert "[rank" not in proc.stderr and "ChildFailedError" not in proc.stderr


@pytest.mark.slow
def test_full_error_shows_the_traceback(tmp_path):
    train = _criteo(tmp_path / "train.tsv", 300, bad_line=150)
    test = _criteo(tmp_path / "test.tsv", 64)
    proc = commands.run(
        "hybridrec.train",
        *CRITEO,
        f"data.train_path={train}",
        f"data.eval_path={test}",
        f"hydra.run.dir={tmp_path / 'run'}",
        timeout=120,
        env={**os.environ, "HYDRA_FULL_ERROR": "1"},
    )
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "hybridrec.data.DataError" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "override, line",
    [
        (
            "train.stpes=100",
            "hybridrec: invalid config: unknown key train.stpes (did you mean train.steps?): the keys of "
            "train are steps, schedule,",
        ),
        (
            "sharding=rowwise",
            "hybridrec: invalid config: sharding=rowwise is not an option of sharding (did you mean "
            "sharding=row_wise?): the options are auto,",
        ),
        (  # case aside
            "model=DLRM",
            "hybridrec: invalid config: model=DLRM is not an option of model (did you mean model=dlrm?)",
        ),
        (  # a path where an override goes (Hydra's own line: "missing EQUAL at '<EOF>'")
            "README.md",
            "hybridrec: README.md is not key=value: to resume from it, give checkpoint.resume=README.md "
            "(python -m hybridrec.train --help lists them)",
        ),
        ("trainsteps", "hybridrec: trainsteps is not key=value: every argument is an override, key=value or "),
    ],
)
def test_a_mistyped_key_or_option_is_named_before_hydra_advises_appending_it(override, line):
    proc = commands.run("hybridrec.train", override, timeout=120)
    assert _one_line_error(proc).startswith(line)
    assert "+train" not in proc.stderr and "Config search path" not in proc.stderr


@pytest.mark.dist
def test_a_ranks_job_error_reaches_its_caller_as_itself(tmp_path):
    """In a rank (``hybridrec.run.rank.run``, outside the launcher): a bug keeps its type and
    traceback, a killed worker is the one-line ``Killed``, a user's error propagates as it is, the
    device out of memory is one line with the settings that lower it;
    the job runs with ``launcher.threads_per_rank`` intra-op threads."""
    from dist_helpers import rank_outcomes, spawn

    cfg = compose_cfg(["+experiment=ctr", *TINY, "launcher.threads_per_rank=2"])
    assert spawn(rank_outcomes, 1, cfg, str(tmp_path)) == [
        ("RuntimeError", "a bug in the job", 2),
        ("Killed", "rank 0's DataLoader worker was killed by SIGKILL", 2),
        ("DataError", "train.csv:3: a bad row", 2),
        (
            "OutOfMemory",
            "rank 0: the device ran out of memory (CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.1 GiB "
            "total)); the last committed checkpoint is kept, nothing after it was saved. Lower data.batch_size or "
            "data.prefetch, or spread the tables over more devices (python -m hybridrec.plan prints the planner's "
            "memory per device)",
            2,
        ),
    ]
