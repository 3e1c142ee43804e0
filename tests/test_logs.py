"""What a run prints: progress as log lines when stderr is no terminal, the libraries' INFO
held back unless hydra.verbose asks for it."""

import logging
import sys

import pytest

from hybridrec.reports.logs import QUIET, Progress, quiet_libraries, verbose_about

pytestmark = pytest.mark.unit

log = logging.getLogger("hybridrec.trainer")


def _train(progress, steps, log_every, seconds_per_step=1.0, start=0, batch=1000):
    """What Trainer.train does with its progress: advance every step, report every
    log_every steps and at the last one, with the rate and training time so far."""
    for step in range(start + 1, steps + 1):
        progress.advance(step)
        if step % log_every == 0 or step == steps:
            elapsed = (step - start) * seconds_per_step
            progress.report(step, 0.5 / step, (step - start) * batch / elapsed, elapsed)
    progress.close()


def _lines(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "hybridrec.trainer"]


def test_without_a_terminal_progress_is_one_line_per_report(caplog):
    with caplog.at_level(logging.INFO, logger="hybridrec.trainer"):
        _train(Progress(10, 0, enabled=True, logger=log, terminal=False), steps=10, log_every=3)
    assert _lines(caplog) == [
        "step 3/10  loss 0.1667  1,000 samples/s  ETA 00:07",
        "step 6/10  loss 0.0833  1,000 samples/s  ETA 00:04",
        "step 9/10  loss 0.0556  1,000 samples/s  ETA 00:01",
        "step 10/10  loss 0.0500  1,000 samples/s  ETA 00:00",
    ]


def test_progress_of_a_resumed_run_counts_from_its_first_step(caplog):
    # resumed at step 400 of 1000, 2 s per step: at step 600, 400 steps are left (800 s)
    with caplog.at_level(logging.INFO, logger="hybridrec.trainer"):
        _train(
            Progress(1000, 400, enabled=True, logger=log, terminal=False),
            steps=1000,
            log_every=300,
            seconds_per_step=2.0,
            start=400,
            batch=2048,
        )
    lines = _lines(caplog)
    assert [line.split()[1] for line in lines] == ["600/1000", "900/1000", "1000/1000"]
    assert lines[0] == "step 600/1000  loss 0.0008  1,024 samples/s  ETA 13:20"
    assert lines[1].endswith("ETA 03:20") and lines[2].endswith("ETA 00:00")


def test_on_a_terminal_the_bar_shows_progress_and_the_files_get_the_lines(tmp_path, capsys):
    root = logging.getLogger()
    console, file = logging.StreamHandler(sys.stdout), logging.FileHandler(tmp_path / "train.log")
    level = root.level
    root.addHandler(console), root.addHandler(file), root.setLevel(logging.INFO)
    try:
        progress = Progress(10, 0, enabled=True, logger=log, terminal=True)
        with progress.logging():
            _train(progress, steps=10, log_every=3)
            log.info("valid @ step 10: AUC 0.5")
    finally:
        root.removeHandler(console), root.removeHandler(file), root.setLevel(level)
        file.close()
    out = capsys.readouterr()
    assert "\r" in out.err and "10/10" in out.err and "loss=0.0500" in out.err and "samples_s=1,000" in out.err
    assert "valid @ step 10" in out.out and "step 3/10" not in out.err + out.out  # above the bar, no progress line
    assert (tmp_path / "train.log").read_text().splitlines() == [
        "step 3/10  loss 0.1667  1,000 samples/s  ETA 00:07",
        "step 6/10  loss 0.0833  1,000 samples/s  ETA 00:04",
        "step 9/10  loss 0.0556  1,000 samples/s  ETA 00:01",
        "step 10/10  loss 0.0500  1,000 samples/s  ETA 00:00",
        "valid @ step 10: AUC 0.5",
    ]


def test_other_ranks_report_nothing(caplog, capsys):
    with caplog.at_level(logging.INFO, logger="hybridrec.trainer"):
        for terminal in (False, True):
            _train(Progress(10, 0, enabled=False, logger=log, terminal=terminal), steps=10, log_every=3)
    assert _lines(caplog) == [] and capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "verbose, shown",
    [
        (False, False),
        (True, True),
        ("torchrec", True),  # a parent of the logger
        ("torchrec.distributed.planner", True),
        (["hydra", "torchrec.distributed"], True),
        ("torchrec.distributed.plan", False),  # a prefix of its name, not a parent
        ("hybridrec", False),
    ],
)
def test_hydra_verbose_names_a_logger_or_a_parent(verbose, shown):
    assert verbose_about("torchrec.distributed.planner.partitioners", verbose) == shown


@pytest.fixture
def library_levels():
    saved = {name: logging.getLogger(name).level for name in QUIET}
    yield
    for name, level in saved.items():
        logging.getLogger(name).setLevel(level)


def test_the_planner_info_lines_are_held_back_unless_asked_for(library_levels):
    partitioner = logging.getLogger("torchrec.distributed.planner.partitioners")
    for name in QUIET:
        logging.getLogger(name).setLevel(logging.NOTSET)
    with_info_root = logging.getLogger()
    level = with_info_root.level
    with_info_root.setLevel(logging.INFO)  # Hydra's job logging: the root at INFO
    try:
        quiet_libraries(["torchrec.distributed.planner"])
        assert partitioner.isEnabledFor(logging.INFO)
        quiet_libraries(False)
        assert not partitioner.isEnabledFor(logging.INFO) and partitioner.isEnabledFor(logging.WARNING)
        assert not logging.getLogger("torchrec.distributed.planner.enumerators").isEnabledFor(logging.WARNING)
    finally:
        with_info_root.setLevel(level)


@pytest.mark.unit
def test_tensorboard_keeps_each_split_under_its_own_tag(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from hybridrec.reports.runlog import MetricsLog

    log = MetricsLog(str(tmp_path / "metrics.jsonl"), str(tmp_path / "tb"))
    log.log(step=30, loss=0.5, loss_mean=0.5)
    log.log(step=30, split="valid", eval={"auc": 0.6683})
    log.log(step=30, split="eval", eval={"auc": 0.6627})
    log.log(step=14, split="progressive", partition="day=2026-11-26", eval={"auc": 0.7}, trained=True)
    log.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    value = lambda tag: [(e.step, round(e.value, 4)) for e in events.Scalars(tag)]
    assert value("valid/auc") == [(30, 0.6683)] and value("test/auc") == [(30, 0.6627)]
    assert value("progressive/auc") == [(14, 0.7)] and value("loss") == [(30, 0.5)]
    assert "eval/auc" not in events.Tags()["scalars"] and "trained" not in events.Tags()["scalars"]


@pytest.mark.unit
def test_a_resumed_run_writes_the_checkpoints_history_then_the_resume_then_its_own(tmp_path):
    """metrics.jsonl is written anew from the history the checkpoint carries: a file left in
    the same run directory by a run killed after the checkpoint (steps 30 and 40 here) is not
    kept, so no step appears twice."""
    import json

    from hybridrec.reports.runlog import MetricsLog, evaluations, resumes

    path = tmp_path / "metrics.jsonl"
    killed = MetricsLog(str(path))
    for step in (10, 20, 30, 40):
        killed.log(step=step, loss=1.0, loss_mean=1.0)
    killed.close()
    history = [
        {"step": 10, "loss": 1.0, "loss_mean": 1.0},
        {"step": 20, "loss": 1.0, "loss_mean": 1.0},
        {"step": 20, "split": "valid", "eval": {"auc": 0.6}},
    ]
    resumed = MetricsLog(str(path))
    resumed.replay(history, 20, "/ck/step_00000020")
    resumed.log(step=30, loss=0.9, loss_mean=0.9)
    resumed.close()
    records = [json.loads(line) for line in open(path)]
    assert (
        records
        == resumed.records
        == [
            *history,
            {"event": "resume", "step": 20, "path": "/ck/step_00000020"},
            {"step": 30, "loss": 0.9, "loss_mean": 0.9},
        ]
    )
    assert resumes(records) == [{"step": 20, "path": "/ck/step_00000020"}]
    assert evaluations(records, "valid") == [{"step": 20, "split": "valid", "auc": 0.6}]
    assert MetricsLog(None).records == []  # other ranks: nothing kept, nothing saved


@pytest.mark.unit
def test_tensorboard_of_a_resumed_run_holds_each_step_once(tmp_path):
    """A restart in the same run directory: TensorBoard hides the first writer's events (from
    step 0, purge_step) and shows the history the checkpoint carried, then the new steps."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from hybridrec.reports.runlog import MetricsLog

    first = MetricsLog(str(tmp_path / "metrics.jsonl"), str(tmp_path / "tb"))
    for step in (10, 20, 30):
        first.log(step=step, loss=1.0)
    first.close()
    again = MetricsLog(str(tmp_path / "metrics.jsonl"), str(tmp_path / "tb"))
    again.replay([{"step": 10, "loss": 1.0}], 10, "/ck/step_00000010")
    again.log(step=20, loss=0.5)
    again.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(10, 1.0), (20, 0.5)]
