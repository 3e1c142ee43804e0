"""Continuous training over a partitioned log: the partitions' listing and what it refuses,
progressive validation (each partition scored before it is trained on), 2 ranks as one
process, an exact resume from the middle of a partition, a run that follows the directory as
partitions arrive, and the one-line refusals of bad partitions and configs."""

import json
import os
import re
import shutil
import threading
import time

import numpy as np
import pytest
import torch

import commands
from conftest import compose_cfg
from dist_helpers import spawn, train_and_gather
from hybridrec.data import DataError
from hybridrec.data.example import day_name, generate_days
from hybridrec.data.parquet.partitions import list_partitions
from hybridrec.run.validation import validate
from shared import assert_same_training
from trained import copy_of

PATTERN = "day=%Y-%m-%d"
# The item table (managed) with 63 rows to give for the few hundred items of the small log: evictions every day
SMALL_ITEMS = ["data.sparse.1.num_embeddings=64", "data.sparse.2.num_embeddings=64"]


def _log(d, rows=2800):
    """The drifting example log, 200 rows a day (2800 rows over 14 days)."""
    generate_days(str(d), rows=rows, seed=1)
    return d


def _cfg(d, *extra):
    return compose_cfg(
        [
            "+experiment=continuous",
            f"data.train_path={d}/train",
            f"data.valid_path={d}/valid",
            f"data.eval_path={d}/eval",
            "data.batch_size=64",
            "model.embedding_dim=8",
            "model.dense_arch_layer_sizes=[16,8]",
            "model.over_arch_layer_sizes=[16,1]",
            "train.log_every=2",
            "launcher.device=cpu",
            *extra,
        ]
    )


# --------------------------------------------------------------------------- the listing
@pytest.mark.unit
def test_partitions_are_ordered_by_their_time_and_incomplete_ones_wait(tmp_path):
    for name in ("hour=2026-11-26-10", "hour=2026-11-26-9", "hour=2026-11-25-23"):
        os.makedirs(tmp_path / name)
        (tmp_path / name / "part-0.parquet").write_bytes(b"")
        (tmp_path / name / "_SUCCESS").write_bytes(b"")
    os.makedirs(tmp_path / "hour=2026-11-26-11")  # being written: no marker yet
    (tmp_path / "_temporary").mkdir()  # a writer's scratch: never a partition
    listed = list_partitions(str(tmp_path), "hour=%Y-%m-%d-%H", ready_marker="_SUCCESS")
    assert [p.name for p in listed] == ["hour=2026-11-25-23", "hour=2026-11-26-9", "hour=2026-11-26-10"]
    assert len(list_partitions(str(tmp_path), "hour=%Y-%m-%d-%H")) == 4  # no marker asked: all complete


@pytest.mark.unit
def test_a_malformed_or_duplicated_partition_is_one_line(tmp_path):
    os.makedirs(tmp_path / "day=2026-11-04")
    os.makedirs(tmp_path / "day=2026-13-45")
    with pytest.raises(
        DataError,
        match=r"day=2026-13-45: the partition name does not match "
        r"data.partitions.pattern='day=%Y-%m-%d' \(or is no real time\)",
    ):
        list_partitions(str(tmp_path), PATTERN)
    warned = set()
    assert [p.name for p in list_partitions(str(tmp_path), PATTERN, strict=False, warned=warned)] == ["day=2026-11-04"]
    assert warned == {"day=2026-13-45"}
    shutil.rmtree(tmp_path / "day=2026-13-45")
    os.makedirs(tmp_path / "day=2026-11-4")
    with pytest.raises(DataError, match=r"day=2026-11-4 and .*day=2026-11-04 name the same time"):
        list_partitions(str(tmp_path), PATTERN)


@pytest.mark.unit
@pytest.mark.parametrize(
    "override, message",
    [
        (
            ["train.schedule=continuous", "data=example_log"],
            "train.schedule=continuous trains day by day over a partitioned log: set data.partitions",
        ),
        (
            ["data.partitions.follow=true", "data.partitions.ready_marker=null"],
            "data.partitions.follow=true reads partitions while they are written",
        ),
        (["data.partitions.train_until=someday"], "data.partitions.train_until='someday' is neither a partition name"),
        (["data.partitions.pattern=d%d"], "needs %Y"),
        (["train.objective=valid.auc"], "a continuous run is judged by its progressive validation"),
        (["train.schedule=steps"], "data.sparse.1.id_mapping=managed gives rows partition by partition, as "),
        (["train.early_stop_patience=2", "train.eval_every=5"], "a continuous run ships its latest model"),
        (["data.valid_fraction=0.1", "data.valid_path=null"], "every partition is scored before it is trained on"),
    ],
)
def test_a_bad_continuous_config_is_refused_before_launch(override, message):
    cfg = compose_cfg(["+experiment=continuous", *override])
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        validate(cfg, 1)


# ------------------------------------------------------------------------------ training
# Checkpoints every 3 steps and at each partition's end, all kept: the newest checkpoint of a
# run killed mid-partition (step 6), and days 2, 3 and 4 (steps 8, 12, 16) for the export and
# its deltas.
CHECKPOINTS = ["checkpoint.every_n_steps=3", "checkpoint.keep_last=50"]


@pytest.fixture(scope="module")
def log(tmp_path_factory):
    """The small log (read only: a test that changes it works on a copy)."""
    return _log(tmp_path_factory.mktemp("log"))


@pytest.fixture(scope="module")
def runs(log, tmp_path_factory):
    """The small log trained day by day on 1 and on 2 ranks (as it is, trained on its first 7
    days only, and with a small item table), and on 1 rank with two days left empty. The
    1-rank run with the small item table checkpoints (CHECKPOINTS, into ``runs["checkpoints"]``)
    and keeps its serving export current: the run never stopped that a resumed one is compared
    with, and the checkpoints the exports and deltas are made of. One launch per world size."""
    root = tmp_path_factory.mktemp("runs")
    ck = root / "ck"
    cfgs = lambda *extra: [
        _cfg(log, "sharding=row_wise"),
        _cfg(log, "sharding=row_wise", "data.partitions.train_until=2023-11-20"),
        _cfg(log, "sharding=row_wise", *SMALL_ITEMS, *extra),
    ]
    empty = _empty_days(copy_of(log, root / "empty"))
    one = spawn(
        train_and_gather,
        1,
        [
            *cfgs(f"checkpoint.dir={ck}", *CHECKPOINTS, "checkpoint.export_deltas=true"),
            _cfg(empty),
            _cfg(log, "sharding=row_wise", *SMALL_ITEMS, "data.managed_ids.reset=false"),
        ],
        str(root / "w1"),
    )
    two = spawn(train_and_gather, 2, cfgs(), str(root / "w2"))
    return {1: one[:3], 2: two, "empty": one[3], "inherit": one[4], "checkpoints": ck}


def _empty_days(d):
    """``d`` with day 3's partition holding no Parquet file and day 5's a file of no rows."""
    import pyarrow.parquet as pq

    os.remove(d / "train" / day_name(3) / "part-00000.parquet")
    table = pq.read_table(d / "train" / day_name(5) / "part-00000.parquet")
    pq.write_table(table.slice(0, 0), d / "train" / day_name(5) / "part-00000.parquet")
    return d


@pytest.mark.dist
def test_each_partition_is_scored_before_it_is_trained_on(runs):
    """Each day is scored, then trained on (after train_until, only scored), and its managed
    item ids get rows or evict others. Over 20 s: the first test to read ``runs``, it waits for
    the module's runs of 14 days on 1 and on 2 ranks."""
    continuous, once, small = runs[1]
    f = continuous["summary"]["freshness"]["partitions"]
    assert [r["partition"] for r in f] == [day_name(d) for d in range(14)]
    # 200 rows a day in global batches of 64: 4 steps, the last padded (every row trained on)
    assert [r["step"] for r in f] == [4 * d for d in range(14)] and continuous["summary"]["steps"] == 56
    assert all(r["rows"] == 200 and r["steps"] == 4 and r["trained"] for r in f)
    assert f[0]["new_ids"]["user"] > 0 and all(r["new_ids"]["item"] >= 0 for r in f)
    objective = continuous["summary"]["objective"]
    assert objective["name"] == "progressive.auc" and objective["direction"] == "maximize"
    assert objective["value"] == pytest.approx(sum(r["eval"]["auc"] for r in f[1:]) / 13)
    # trained once on 7 days: the later days are scored by the day-7 model, none trained on
    g = once["summary"]["freshness"]["partitions"]
    assert once["summary"]["steps"] == 28 and [r["trained"] for r in g] == [True] * 7 + [False] * 7
    assert [r["step"] for r in g[7:]] == [28] * 7
    assert once["losses"] == continuous["losses"][:28]  # the same first 7 days
    # managed item ids: every id seen has a row in the big table; the small one evicts, row 0 takes the rest
    big = [r["managed_ids"]["item_table"] for r in f]
    assert all(m["misses"] == 0 and m["evicted"] == 0 for m in big) and big[0]["rows_used"] > 63
    tight = [r["managed_ids"]["item_table"] for r in small["summary"]["freshness"]["partitions"]]
    assert all(m["rows_used"] == 63 and m["misses"] > 0 for m in tight) and sum(m["evicted"] for m in tight) > 0
    # the rows evicted ids held start over for the ids given them (none in the big table)
    assert all(m["reset"] == 0 for m in big) and all(m["reset"] <= m["admitted"] for m in tight)
    assert sum(m["reset"] for m in tight) > 0


@pytest.mark.dist
def test_a_reused_row_starts_over_unless_reset_is_off(runs):
    """data.managed_ids.reset=false: the new id inherits the evicted id's row as it was. The
    two runs train alike up to the first partition that gives a row an evicted id held."""
    small, inherit = runs[1][2], runs["inherit"]
    days = small["summary"]["freshness"]["partitions"]
    first = next(d for d in days if d["managed_ids"]["item_table"]["reset"])
    assert "reset" not in inherit["summary"]["freshness"]["partitions"][0]["managed_ids"]["item_table"]
    assert inherit["losses"][: first["step"]] == small["losses"][: first["step"]]
    assert inherit["losses"][first["step"] :] != small["losses"][first["step"] :]


@pytest.mark.dist
def test_two_ranks_train_day_by_day_as_one(runs):
    for one, two in zip(runs[1], runs[2]):
        assert_same_training(one, two)
        a, b = (r["summary"]["freshness"]["partitions"] for r in (one, two))
        for x, y in zip(a, b):
            assert {k: v for k, v in x.items() if k not in ("eval", "new_ids")} == {
                k: v for k, v in y.items() if k not in ("eval", "new_ids")
            }
            assert x["eval"] == pytest.approx(y["eval"], rel=1e-5, abs=1e-6)


@pytest.mark.dist
def test_a_run_killed_in_a_partition_resumes_at_its_next_row_exactly(runs, log, tmp_path):
    """Checkpoints every 3 steps: a run whose newest checkpoint is step 6 (the middle of day 2,
    as after a kill -9 right after that save) resumes there and ends with the weights, losses
    and progressive scores of the run never stopped; so does one from step 8, the end of day
    2, with the rows day 3 reuses reset after the resume. Over 20 s: two 14-day runs."""
    a, b = runs["checkpoints"], tmp_path / "b"
    uninterrupted = runs[1][2]
    run = lambda d, ck: _cfg(d, "sharding=row_wise", *SMALL_ITEMS, f"checkpoint.dir={ck}", *CHECKPOINTS)
    shutil.copytree(a / "step_00000006", b / "step_00000006")
    state = json.loads((b / "step_00000006" / "trainer_state.json").read_text())
    assert state["stream"]["position"] == {"partition": day_name(1), "row": 128}
    # and from step 8, a day's end: the next day's reused rows are reset after the resume
    shutil.copytree(a / "step_00000008", tmp_path / "c" / "step_00000008")
    assert any(d["managed_ids"]["item_table"]["reset"] for d in uninterrupted["summary"]["freshness"]["partitions"][2:])
    both = spawn(train_and_gather, 1, [run(log, b), run(log, tmp_path / "c")], str(tmp_path / "w2"))
    for resumed, step in zip(both, (6, 8)):
        assert resumed["summary"]["train"]["resumed_from_step"] == step
        assert resumed["losses"] == uninterrupted["losses"]
        for key, value in uninterrupted["state"].items():
            assert torch.equal(resumed["state"][key], value), key
        assert resumed["summary"]["freshness"] == uninterrupted["summary"]["freshness"]
    # a partition the checkpoint trained on changed: one line, nothing trained
    shutil.rmtree(b)
    shutil.copytree(a / "step_00000006", b / "step_00000006")
    changed = copy_of(log, tmp_path / "changed")
    generate_days(str(tmp_path / "other"), rows=1400, seed=2)
    shutil.copy(
        tmp_path / "other" / "train" / day_name(0) / "part-00000.parquet",
        changed / "train" / day_name(0) / "part-00000.parquet",
    )
    with pytest.raises(
        Exception,
        match=r"partition day=2023-11-14 of .* changed since it was trained on "
        r"\(part-00000\.parquet was [\d,]+ bytes, now [\d,]+\)",
    ):
        spawn(train_and_gather, 1, [run(changed, b)], str(tmp_path / "w3"))


def _command(d, ck, run_dir, *extra):
    """`python -m hybridrec.train +experiment=continuous ...` on the log in ``d``, 4 steps a
    day, train.steps=20 (a continuous run's length is its partitions: 56 steps), checkpoints
    every 6 steps and at each day's end; forked from the preloaded command server."""
    return [
        "hybridrec.train",
        "+experiment=continuous",
        f"data.train_path={d}/train",
        f"data.valid_path={d}/valid",
        f"data.eval_path={d}/eval",
        "data.batch_size=64",
        "model.embedding_dim=8",
        "model.dense_arch_layer_sizes=[16,8]",
        "model.over_arch_layer_sizes=[16,1]",
        "launcher.device=cpu",
        "train.steps=20",
        "checkpoint.every_n_steps=6",
        "checkpoint.keep_last=50",
        f"checkpoint.dir={ck}",
        f"hydra.run.dir={run_dir}",
        *extra,
    ]


def _finished(proc, run_dir):
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return json.loads((run_dir / "summary.json").read_text())


def _same_run(a, b):
    """Two continuous runs' summaries train and score alike: train loss, every day's
    progressive AUC, the objective and the test split."""
    assert a["train_loss"] == b["train_loss"]
    assert [(p["partition"], p.get("eval", {}).get("auc")) for p in a["freshness"]["partitions"]] == [
        (p["partition"], p.get("eval", {}).get("auc")) for p in b["freshness"]["partitions"]
    ]
    assert a["objective"] == b["objective"] and a["eval"] == b["eval"]


@pytest.fixture(scope="module")
def uninterrupted(log, tmp_path_factory):
    """``_command`` on the whole log, never stopped: the summary a stopped and resumed run ends with."""
    root = tmp_path_factory.mktemp("uninterrupted")
    return _finished(commands.run(*_command(log, root / "ck", root / "run")), root / "run")


@pytest.mark.dist
def test_a_run_killed_past_train_steps_resumes_with_the_command_that_started_it(log, uninterrupted, tmp_path):
    """kill -9 after its step-30 checkpoint (train.steps=20), then the same command: it
    resumes there and ends as the run never stopped. Over 20 s: three runs of 14 days."""
    ck, run_dir = tmp_path / "ck", tmp_path / "run"
    args = _command(log, ck, run_dir)
    command = commands.start(*args)
    deadline = time.monotonic() + 120
    while not (ck / "step_00000030" / "trainer_state.json").exists():
        assert time.monotonic() < deadline, "no step-30 checkpoint within 120 s"
        time.sleep(0.02)
    command.kill()
    killed = command.wait(timeout=60)
    assert killed.returncode == -9, "the run ended before it was killed: " + killed.stderr[-2000:]
    summary = _finished(commands.run(*args), run_dir)
    assert summary["train"]["resumed_from_step"] >= 30
    _same_run(summary, uninterrupted)


@pytest.mark.dist
def test_a_day_without_its_marker_stops_the_run_before_it_or_is_skipped_for_good(log, uninterrupted, tmp_path):
    """Day 5 lacks its ready marker while later days are complete: the run stops after day 4
    in one line (status 1, the day-4 checkpoint kept); once the marker arrives the same
    command trains on from day 5, as the run never stopped. A trained day whose ids were
    rewritten (same rows) is refused on resume by its content digest. With
    data.partitions.skip_unready=true, the day is skipped and recorded. The first day without
    its marker is refused. Over 20 s: five runs."""
    d = copy_of(log, tmp_path / "gap")
    marker = d / "train" / day_name(5) / "_SUCCESS"
    marker.unlink()
    ck, run_dir = tmp_path / "ck", tmp_path / "run"
    args = _command(d, ck, run_dir)
    stopped = commands.run(*args)
    assert stopped.returncode == 1 and "Traceback" not in stopped.stderr, stopped.stderr[-3000:]
    assert stopped.stderr.strip().splitlines()[-1] == (
        f"hybridrec: partition {day_name(5)} of {d}/train has no _SUCCESS (still being written, or lost) and later "
        f"partitions are complete: the run stopped before it, after {day_name(4)} (its checkpoint is kept). "
        "data.partitions.follow=true waits for it; data.partitions.skip_unready=true trains past it for good"
    )
    assert max(os.listdir(ck)) == "step_00000020"  # days 0-4, 4 steps each
    # a day it trained on, its item ids rewritten (same row count): refused by its digest
    edited = copy_of(d, tmp_path / "edited")
    (edited / "train" / day_name(5) / "_SUCCESS").write_text("")
    path = edited / "train" / day_name(1) / "part-00000.parquet"
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    pq.write_table(
        table.set_column(table.schema.get_field_index("item_id"), "item_id", pc.add(table["item_id"], 1)), path
    )
    other = copy_of(ck, tmp_path / "other")
    refused = commands.run(*_command(edited, other, tmp_path / "refused"))
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert re.search(
        rf"hybridrec: partition {day_name(1)} of .* changed since it was trained on "
        r"\(part-00000\.parquet was [\d,]+ bytes, now [\d,]+\)",
        refused.stderr,
    ), refused.stderr[-2000:]
    assert sorted(os.listdir(other)) == sorted(os.listdir(ck))  # nothing trained, nothing written
    # the marker arrives: the same command trains on, as the run never stopped
    marker.write_text("")
    summary = _finished(commands.run(*args), run_dir)
    assert summary["train"]["resumed_from_step"] == 20
    assert summary["freshness"]["skipped"] == []
    _same_run(summary, uninterrupted)
    # skipped for good when asked, and recorded
    marker.unlink()
    skipped = _finished(
        commands.run(*_command(d, tmp_path / "ck2", tmp_path / "run2", "data.partitions.skip_unready=true")),
        tmp_path / "run2",
    )
    assert skipped["freshness"]["skipped"] == [{"partition": day_name(5), "missing": "_SUCCESS"}]
    assert [p["partition"] for p in skipped["freshness"]["partitions"]] == [day_name(x) for x in range(14) if x != 5]
    # the first day without its marker: nothing can be trained, one line
    first = copy_of(log, tmp_path / "first")
    (first / "train" / day_name(0) / "_SUCCESS").unlink()
    refused = commands.run(*_command(first, tmp_path / "ck3", tmp_path / "run3"))
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert (
        refused.stderr.strip()
        .splitlines()[-1]
        .startswith(f"hybridrec: partition {day_name(0)} of {first}/train, the first, has no _SUCCESS")
    ), refused.stderr[-2000:]


@pytest.mark.slow
def test_a_following_run_trains_on_partitions_as_they_arrive(tmp_path):
    """A run that follows its directory (python -m hybridrec.train, one process): a day that
    completes while it waits is trained on; one that arrives with an earlier date, and a
    malformed name, are each warned about in one line and left out; it stops once no
    partition arrived for stop_after_idle_s. Over 20 s: 12 days of training, then the waits
    it is about (a day arriving, then stop_after_idle_s without one)."""
    d = _log(tmp_path / "log")
    later = tmp_path / "later"
    for day in (12, 13):  # held back: they arrive while the run waits
        shutil.move(str(d / "train" / day_name(day)), str(later / day_name(day)))
    early = d / "train" / day_name(5)
    shutil.move(str(early), str(later / "early"))
    run_dir = tmp_path / "run"
    args = [
        "+experiment=continuous",
        f"hydra.run.dir={run_dir}",
        f"data.train_path={d}/train",
        f"data.valid_path={d}/valid",
        f"data.eval_path={d}/eval",
        "data.batch_size=64",
        "model.embedding_dim=8",
        "model.dense_arch_layer_sizes=[16,8]",
        "launcher.device=cpu",
        "data.partitions.follow=true",
        "data.partitions.poll_s=0.5",
        "data.partitions.stop_after_idle_s=6",
    ]
    command = commands.start("hybridrec.train", *args, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ended = threading.Event()

    def following():  # the run's log says it waits for partitions (train.log: what the console shows)
        log_file = run_dir / "train.log"
        return log_file.exists() and "following" in log_file.read_text(errors="replace")

    def arrive():
        deadline = time.time() + 120
        while time.time() < deadline and not following():
            if ended.is_set():
                return
            time.sleep(0.2)
        shutil.copytree(later / day_name(12), d / "train" / day_name(12), ignore=shutil.ignore_patterns("_SUCCESS"))
        time.sleep(1.5)  # incomplete for a few polls: not read
        (d / "train" / day_name(12) / "_SUCCESS").write_bytes(b"")
        shutil.copytree(later / "early", d / "train" / day_name(5))  # out of order: after day 12 was listed
        os.makedirs(d / "train" / "day=2023-13-01")  # malformed: warned, left out

    mover = threading.Thread(target=arrive)
    mover.start()
    try:
        proc = command.wait(timeout=300)
    finally:
        ended.set()
        mover.join()
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    names = [r["partition"] for r in summary["freshness"]["partitions"]]
    assert names == [day_name(x) for x in (0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 12)]
    assert summary["steps"] == 12 * 4
    assert f"partition {day_name(5)} arrived after" in out and "left out" in out
    assert "day=2023-13-01: the partition name does not match" in out
    assert "Traceback" not in out


@pytest.mark.dist
def test_an_export_plus_its_deltas_is_the_full_export_bit_for_bit(runs, tmp_path):
    """Checkpoints after days 2, 3 and 4: the day-2 export with the deltas to day 3 and day 4
    holds the bytes of the day-4 export and scores as it does; a delta applied to another
    export, twice, or damaged is refused in one line."""
    from hybridrec.serving import delta
    from hybridrec.serving.export import export

    ck = runs["checkpoints"]  # read only: exports and deltas are written under tmp_path
    step = lambda n: str(ck / f"step_{n:08d}")
    base, full = tmp_path / "base", tmp_path / "full"
    export(step(8), str(base))
    export(step(16), str(full))
    first, _ = delta.write(step(12), str(base))
    second, _ = delta.write(step(16), str(base))
    assert [os.path.basename(p) for p in delta.deltas_of(str(base))] == ["delta_00001.pt", "delta_00002.pt"]
    # the managed item ids' rows travel with the export: those of day 2, the last one step 8 trained on
    import pyarrow.parquet as pq

    ids = pq.read_table(base / "managed_ids.parquet").to_pydict()
    spec = json.loads((base / "model.json").read_text())["managed_ids"]
    assert spec["partition"] == day_name(1) and set(ids["table"]) == {"item_table"}
    assert len(ids["row"]) == len(set(ids["row"])) == spec["rows_used"]["item_table"] and 0 not in ids["row"]
    d1 = delta.read(first)
    # only the rows day 3 looked up changed: a fraction of the user table
    rows = d1["rows"]["model.model.sparse_arch.embedding_bag_collection.embedding_bags.t_user.weight"]
    assert 0 < len(rows) < 1000
    patched, reference = delta.load(str(base)), torch.export.load(str(full / "model.pt2")).module()
    a, b = patched.state_dict(), reference.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    n = 5
    inputs = (
        torch.rand(n, 3),
        torch.zeros(n * 4, dtype=torch.int64),
        torch.ones(n * 4, dtype=torch.int32),
        torch.ones(n * 4),
    )
    assert torch.equal(patched(*inputs), reference(*inputs))
    with pytest.raises(delta.DeltaError, match="nothing changed"):
        delta.write(step(16), str(base))
    # checkpoint.export_deltas: the run kept ck/serving current, an export then a delta per day,
    # which end at the weights and managed ids of the last checkpoint
    serving = ck / "serving"
    assert len(delta.deltas_of(str(serving))) == 13
    export(step(56), str(tmp_path / "last"))
    a, b = (
        delta.load(str(serving)).state_dict(),
        torch.export.load(str(tmp_path / "last" / "model.pt2")).module().state_dict(),
    )
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert pq.read_table(serving / "deltas" / "managed_ids_00013.parquet").equals(
        pq.read_table(tmp_path / "last" / "managed_ids.parquet")
    )
    # the deltas of one export put beside another's: the first is refused, nothing applied
    os.makedirs(full / "deltas")
    shutil.copy(first, full / "deltas" / "delta_00001.pt")
    with pytest.raises(delta.DeltaError, match=r"delta_00001.pt was made for other weights \(base \w+, step 8\)"):
        delta.load(str(full))
    # damaged: a changed value, or a file that is not a delta
    shutil.rmtree(full / "deltas")
    broken = delta.read(second)
    name = next(iter(broken["dense"]))
    broken["dense"][name] = broken["dense"][name] + 1
    torch.save(broken, second)
    with pytest.raises(delta.DeltaError, match="delta_00002.pt is damaged: the weights it gives are not those"):
        delta.load(str(base))
    with open(second, "wb") as f:
        f.write(b"not a zip")
    with pytest.raises(delta.DeltaError, match="delta_00002.pt is damaged or not a delta"):
        delta.load(str(base))


# ---------------------------------------------------------------------------- managed ids
def _managed(parts, capacity, min_count=1, eviction="lfu"):
    from hybridrec.data.parquet.managed import ManagedIds

    return ManagedIds({"t": capacity}, min_count, eviction, lambda p: {"t": np.array(parts[p], np.uint64)})


@pytest.mark.unit
def test_managed_ids_get_a_row_of_their_own_in_the_partition_they_reach_min_count():
    m = _managed([[5, 5, 7], [7, 9], [9, 9, 11]], capacity=10, min_count=2)
    rows = lambda p, keys: m.rows("t", np.array(keys, np.uint64), p).tolist()
    assert rows(0, [5, 7, 9]) == [1, 0, 0]  # 5 seen twice on day 0; 7 once: no row yet (row 0)
    assert rows(1, [5, 7, 9]) == [1, 2, 0]  # 7 reaches 2 on day 1
    assert rows(2, [5, 7, 9, 11]) == [1, 2, 3, 0]  # rows never change hands with room to spare
    assert m.stats("t", 2, np.array([9, 9, 11], np.uint64)) == {
        "rows_used": 3,
        "rows": 10,
        "hits": 2,
        "misses": 1,
        "admitted": 1,
        "evicted": 0,
    }


@pytest.mark.unit
@pytest.mark.parametrize("eviction, day2", [("lfu", [1, 2, 0, 0]), ("lru", [0, 2, 1, 0])])
def test_a_full_table_evicts_the_lowest_ranked_id_and_never_gives_row_0(eviction, day2):
    # 2 rows to give (3 rows: row 0 + 2). Day 0: id 1 three times, 2 once; day 1: 3 twice (it ranks
    # above 2 either way); day 2: 4 once. lfu keeps 1 (3 times) and 3 (twice); lru keeps the ids seen
    # last, 4 (day 2) and 3 (day 1), and 4 takes the row 1 held.
    m = _managed([[1, 1, 1, 2], [3, 3], [4]], capacity=3, eviction=eviction)
    assert m.rows("t", np.array([1, 2], np.uint64), 0).tolist() == [1, 2]
    assert m.rows("t", np.array([1, 3, 2], np.uint64), 1).tolist() == [1, 2, 0]  # 3 took 2's row
    assert m.rows("t", np.array([1, 3, 4, 2], np.uint64), 2).tolist() == day2
    v = m.version("t", 2)
    assert 0 not in v.rows.tolist() and len(set(v.rows.tolist())) == len(v.rows)
    # the rows that changed hands, to be reset: 2's on day 1; on day 2 only lru gives 1's to 4
    assert [m.version("t", p).reused.tolist() for p in range(3)] == [[], [2], [] if eviction == "lfu" else [1]]


@pytest.mark.unit
def test_managed_versions_are_a_pure_function_of_the_partitions():
    rng = np.random.default_rng(0)
    parts = [rng.zipf(1.5, 500).astype(np.uint64) for _ in range(6)]
    a, b = _managed(parts, capacity=40), _managed(parts, capacity=40)
    b.version("t", 5)  # made in one go, or step by step: the same rows
    for p in range(6):
        keys = np.unique(np.concatenate(parts))
        assert a.rows("t", keys, p).tolist() == b.rows("t", keys, p).tolist()
    a.reset()
    assert a.rows("t", keys, 5).tolist() == b.rows("t", keys, 5).tolist()


@pytest.mark.unit
def test_a_partition_linked_to_another_is_refused(tmp_path):
    os.makedirs(tmp_path / "day=2026-11-04")
    (tmp_path / "day=2026-11-04" / "part-0.parquet").write_bytes(b"")
    os.symlink(tmp_path / "day=2026-11-04", tmp_path / "day=2026-11-05")
    with pytest.raises(
        DataError,
        match=r"day=2026-11-05/part-0.parquet is also .*day=2026-11-04/part-0.parquet: "
        r"two partitions hold the same file",
    ):
        list_partitions(str(tmp_path), PATTERN)


@pytest.mark.dist
def test_an_empty_partition_is_a_day_without_rows(runs):
    """A day whose partition holds no Parquet file, and one whose file has no rows: each is
    scored as 0 rows, trains no step, and the days around it train as before."""
    run = runs["empty"]  # trained on the log of _empty_days
    f = run["summary"]["freshness"]["partitions"]
    assert [r["partition"] for r in f] == [day_name(x) for x in range(14)]
    assert [(r["rows"], r["steps"], "eval" in r) for r in (f[3], f[5])] == [(0, 0, False), (0, 0, False)]
    assert run["summary"]["steps"] == 12 * 4 and [r["step"] for r in f][2:7] == [8, 12, 12, 16, 16]


def _rank0_stream(root, state, **spec):
    """The rank-0 side of a continuous run's stream over ``root`` (no source, no process
    group): what ``Stream.start`` and ``follow`` broadcast to every rank."""
    from hybridrec.training.continuous import Stream

    stream = Stream.__new__(Stream)
    stream.root, stream.state, stream.rank = str(root), state, 0
    stream.spec = {"pattern": PATTERN, **spec}
    stream._warned, stream._digest = set(), {}
    return stream


@pytest.mark.unit
def test_a_partition_trained_on_that_changed_or_went_away_is_refused_by_rank_0(tmp_path, monkeypatch):
    """A resumed run's stream checks the partitions it read before against the checkpoint's
    record: each way they can differ is one line naming the partition and what changed."""
    from hybridrec.training.continuous import Stream, progressive_metric

    for day in ("day=2026-11-04", "day=2026-11-05"):
        os.makedirs(tmp_path / day)
        (tmp_path / day / "part-0.parquet").write_bytes(b"rows of " + day.encode())
    kept, digests, held_back, skipped = _rank0_stream(tmp_path, {})._choose(strict=True)
    assert [p.name for p in kept] == ["day=2026-11-04", "day=2026-11-05"] and held_back is None and skipped == []
    # what a checkpoint taken in day 05 records: both were read (scored), 04 trained on
    state = lambda: {
        "freshness": [{"partition": "day=2026-11-04"}, {"partition": "day=2026-11-05"}],
        "partitions": [{"name": n, "digest": digests[n]} for n in digests],
    }
    assert _rank0_stream(tmp_path, state())._choose(strict=True)[1] == digests  # as it was: goes on

    day = tmp_path / "day=2026-11-05"
    (day / "part-0.parquet").write_bytes(b"rows of day=2026-11-05, rewritten")
    assert re.fullmatch(
        r"partition day=2026-11-05 of .* changed since it was trained on \(part-0.parquet was 22 "
        r"bytes, now 33\): a resumed run must read .*",
        _rank0_stream(tmp_path, state())._choose(True),
    )
    (day / "part-0.parquet").write_bytes(b"ROWS OF DAY=2026-11-05")  # same size, other bytes
    assert "(its files' bytes differ from the digest recorded then)" in _rank0_stream(tmp_path, state())._choose(True)
    os.rename(day / "part-0.parquet", day / "part-1.parquet")
    assert "(part-0.parquet is gone)" in _rank0_stream(tmp_path, state())._choose(True)
    (day / "part-0.parquet").write_bytes(b"rows of day=2026-11-05")
    assert "(part-1.parquet is new)" in _rank0_stream(tmp_path, state())._choose(True)
    os.remove(day / "part-1.parquet")
    import hybridrec.training.continuous as continuous

    def gone_while_hashed(p):  # a file removed between the listing and its hash
        os.remove(p.files[0])
        return digest(p)

    digest = continuous.partition_digest
    monkeypatch.setattr(continuous, "partition_digest", gone_while_hashed)
    assert re.fullmatch(
        rf"{tmp_path}: No such file or directory \(.*day=2026-11-04/part-0.parquet\) while reading "
        r"the partitions",
        _rank0_stream(tmp_path, state())._choose(True),
    )
    monkeypatch.undo()
    shutil.rmtree(day)
    assert re.fullmatch(
        r"partition day=2026-11-05 of .*, trained on before the checkpoint, is gone: a resumed run "
        r"must read the partitions it trained on. .*",
        _rank0_stream(tmp_path, state())._choose(True),
    )
    os.makedirs(tmp_path / "day=2026-13-45")  # strict listing: a malformed name is rank 0's refusal too
    assert "day=2026-13-45: the partition name does not match" in _rank0_stream(tmp_path, {})._choose(strict=True)

    with pytest.raises(DataError, match="train.schedule=continuous needs a partitioned log"):
        Stream(object(), {}, 0)
    assert [progressive_metric(o) for o in ("auto", "progressive.ne", "progressive.logloss")] == [
        "auc",
        "ne",
        "logloss",
    ]


@pytest.mark.dist
@pytest.mark.parametrize("world,shardings", [(1, ("table_wise", "data_parallel")), (2, ("row_wise", "column_wise"))])
def test_rows_reset_start_over_in_every_kind_of_shard(log, tmp_path, world, shardings):
    """reset_rows sets the given rows of a trained table back to the values a fresh model has
    and their optimizer state to a fresh one, in table-wise, data-parallel, row-wise and
    column-wise shards (two column shards of 32: their row-wise optimizer states are stacked);
    every other row keeps its trained values."""
    import torch

    from dist_helpers import reset_and_gather

    rows = [1, 5, 40, 63]
    wide = ["model.embedding_dim=64", "model.dense_arch_layer_sizes=[16,64]"]
    split = "sharding.tables=[{match:item_table,sharding_types:[column_wise],min_partition:32}]"
    cfgs = [
        _cfg(
            log,
            *SMALL_ITEMS,
            "data.managed_ids.reset=false",
            *([*wide, split] if s == "column_wise" else [f"sharding={s}"]),
        )
        for s in shardings
    ]
    for sharding, r in zip(shardings, spawn(reset_and_gather, world, cfgs, str(tmp_path), rows)):
        assert "weight" in r["reset"] and len(r["reset"]) >= 2, (sharding, r["reset"].keys())
        if sharding != "table_wise":  # split in two (data-parallel: a replica per rank, one here)
            assert len(r["reset"]["weight"]) == (1 if sharding == "data_parallel" else 2), sharding
        for name, shards in r["reset"].items():
            changed = False
            for i, (row0, after) in enumerate(shards):
                trained = r["trained"][name][i][1]
                mine = [x - row0 for x in rows if row0 <= x < row0 + after.size(0)]
                others = [x for x in range(after.size(0)) if x not in mine]
                assert torch.equal(after[others], trained[others]), (sharding, name)
                changed |= not torch.equal(after[mine], trained[mine])  # they had trained
                if name in r["fresh"]:
                    assert torch.equal(after[mine], r["fresh"][name][i][1][mine]), (sharding, name)
                else:  # a plain optimizer's state, made at the first step: as it starts
                    assert torch.all(after[mine] == 0), (sharding, name)
            assert changed, (sharding, name)
