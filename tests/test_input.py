"""The shared input loop: batches independent of world size, workers and resume; every
evaluated row scored once; exact accounting; workers that stop cleanly."""

import json
import multiprocessing
import os
import threading

import pytest
import torch
from torchrec.datasets.criteo import BinaryCriteoUtils

import commands
from conftest import compose_cfg
from dist_helpers import spawn, train_and_summarize
from hybridrec.data import DataError, loader
from hybridrec.data.criteo import CriteoBinary, CriteoTSV
from hybridrec.data.movielens import MovieLensRank
from hybridrec.data.synthetic import SyntheticClickLog
from shared import SIZES, ml, rand_rows, row, write


def _columns(batch) -> dict[str, torch.Tensor]:
    cols = {"dense": batch.dense_features, "labels": batch.labels}
    for key in batch.sparse_features.keys():
        jt = batch.sparse_features[key]
        cols[f"{key}.values"], cols[f"{key}.lengths"] = jt.values(), jt.lengths()
    if batch.weights is not None:
        cols["weights"], cols["query"] = batch.weights, batch.query
    return cols


def global_batches(
    source, split: str, world_size: int, workers: int, n: int = None, start: int = 0, thread: bool = False
):
    """The global batches the ranks of a world size see together: per batch, each column
    concatenated over ranks (ranks that ran out contribute padding), padding rows removed."""
    per_rank = [
        list(loader.batches(source, split, r, world_size, n, start, num_workers=workers, thread=thread))
        for r in range(world_size)
    ]
    out = []
    for i in range(max(len(p) for p in per_rank)):
        parts = [p[i] if i < len(p) else loader.padding_batch(source, world_size) for p in per_rank]
        if split == "train":
            cols = [_columns(b) for b in parts]
            out.append({k: torch.cat([c[k] for c in cols]) for k in cols[0]})
        else:
            real = torch.cat([b.real for b in parts])
            cols = [_columns(b.batch) for b in parts]
            whole = {k: torch.cat([c[k] for c in cols]) for k in cols[0]}
            keep = {k: v[real] for k, v in whole.items() if not k.endswith(".values")}  # row columns
            ids = {
                k: v[torch.repeat_interleave(real, whole[k.replace(".values", ".lengths")])]
                for k, v in whole.items()
                if k.endswith(".values")
            }  # the real rows' ids
            out.append((keep, ids, int(real.sum())))
    return out


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if isinstance(x, tuple):  # evaluated: real rows and the ids of real rows
            assert x[2] == y[2]
            for k in x[0]:
                assert torch.equal(x[0][k], y[0][k]), k
            for k in x[1]:
                assert torch.equal(x[1][k], y[1][k]), k
        else:
            for k in x:
                assert torch.equal(x[k], y[k]), k


def _tsv(tmp_path, shards=4, batch=16, valid_fraction=0.0):
    train = write(tmp_path / "train.tsv", rand_rows(300, seed=1) + ["1\tbroken"])
    eval_ = write(tmp_path / "eval.tsv", rand_rows(70, seed=2))  # 4 batches and a partial one
    return CriteoTSV(
        batch_size=batch,
        train_path=train,
        eval_path=eval_,
        num_embeddings_per_feature=SIZES,
        id_mapping="modulo",
        bad_rows="skip",
        block_size_mb=1,
        eval_batches=None,
        seed=0,
        valid_fraction=valid_fraction,
        shards=shards,
    )


def _binary(tmp_path):
    for split, n in (("train", 90), ("eval", 37)):
        os.makedirs(tmp_path / split, exist_ok=True)
        tsv = write(tmp_path / split / "day_0.tsv", rand_rows(n, seed=n))
        BinaryCriteoUtils.tsv_to_npys(
            tsv, *(str(tmp_path / split / f"day_0_{p}.npy") for p in ("dense", "sparse", "labels"))
        )
    return CriteoBinary(
        batch_size=16,
        train_path=str(tmp_path / "train"),
        eval_path=str(tmp_path / "eval"),
        num_embeddings_per_feature=SIZES,
        id_mapping="modulo",
        eval_batches=None,
        seed=0,
    )


def _synthetic(tmp_path):
    return SyntheticClickLog(
        batch_size=16,
        num_dense_features=3,
        num_embeddings_per_feature=[100, 7],
        ids_per_feature=1,
        multi_hot_sizes=[2, 3],
        zipf_exponent=1.05,
        eval_batches=3,
        seed=0,
        valid_batches=2,
    )


def _movielens(tmp_path, layout):
    return ml(layout, batch_size=16)


def _movielens_rank(tmp_path, layout):
    args = dict(
        batch_size=24,
        path=str(layout),
        label_threshold=4,
        split="random",
        eval_fraction=0.2,
        side_features=True,
        bad_rows="skip",
        eval_batches=None,
        seed=0,
    )
    return MovieLensRank(
        list_size=4, negatives=2, negative_sampling="batch", eval_items="sampled", eval_negatives=5, ranking_k=5, **args
    )


SOURCES = {"synthetic": _synthetic, "criteo_tsv": _tsv, "criteo_binary": _binary}


# The TSV and binary readers take seconds here (worker processes over several shards).
@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.slow if n.startswith("criteo") else pytest.mark.unit)
        for n in [*SOURCES, "movielens", "movielens_rank"]
    ],
)
def test_batches_are_the_same_for_any_world_size_and_worker_count(tmp_path, name, layout):
    make = SOURCES.get(name) or (lambda p: (_movielens if name == "movielens" else _movielens_rank)(p, layout))
    reference = {
        split: global_batches(make(tmp_path), split, 1, 0, 25 if split == "train" else None)
        for split in ("train", "eval")
    }
    for world_size, workers, thread in (
        (2, 0, False),
        (4, 0, False),
        (1, 2, False),
        (2, 2, False),
        (1, 0, True),
        (2, 0, True),
    ):
        if name == "movielens_rank" and world_size == 4:
            continue  # 4 lists per global batch: whole lists per rank need a world size dividing 4
        for split in ("train", "eval"):
            got = global_batches(
                make(tmp_path), split, world_size, workers, 25 if split == "train" else None, thread=thread
            )
            assert_same(got, reference[split])


@pytest.mark.unit
@pytest.mark.parametrize("name", [*SOURCES, "movielens"])
def test_resuming_mid_epoch_gives_the_same_batches(tmp_path, name, layout):
    make = SOURCES.get(name) or (lambda p: _movielens(p, layout))
    whole = global_batches(make(tmp_path), "train", 2, 0, 30)
    resumed = global_batches(make(tmp_path), "train", 2, 0, 30, start=13)  # crosses epoch ends
    assert_same(resumed, whole[13:])


@pytest.mark.unit
@pytest.mark.parametrize("name", [*SOURCES, "movielens", "movielens_rank"])
def test_evaluation_scores_every_row_once(tmp_path, name, layout):
    make = SOURCES.get(name) or (lambda p: (_movielens if name == "movielens" else _movielens_rank)(p, layout))
    source = make(tmp_path)
    expected = {"synthetic": 3 * 16, "criteo_tsv": 70, "criteo_binary": 37}.get(name)
    if name == "movielens":
        expected = len(source.split_rows["eval"])
    for world_size in (1, 2):
        got = global_batches(make(tmp_path), "eval", world_size, 0)
        rows = sum(n for _, _, n in got)
        if name == "movielens_rank":  # rows are list rows: the held-out ratings plus the negatives
            w = sum(int(cols["weights"].gt(0).sum()) for cols, _, _ in got)
            e = source.eval_rows["eval"]
            assert rows == len(e["user"]) and w == rows
        else:
            assert rows == expected


@pytest.mark.unit
@pytest.mark.parametrize("name", [*SOURCES, "movielens", "movielens_rank"])
def test_eval_rows_are_named_the_same_for_any_world_size(tmp_path, name, layout):
    """EvalBatch.rows (predictions.parquet's row column): every real row of the split once,
    named by its place in the split's global batches, so that a name and the row it names
    do not depend on the world size; padding rows are -1."""
    make = SOURCES.get(name) or (lambda p: (_movielens if name == "movielens" else _movielens_rank)(p, layout))

    def named(world_size):
        rows = {}
        for rank in range(world_size):
            for item in loader.batches(make(tmp_path), "eval", rank, world_size):
                assert (item.rows[~item.real] == -1).all()
                real = item.real
                for i, label, dense in zip(
                    item.rows[real].tolist(),
                    item.batch.labels[real].tolist(),
                    item.batch.dense_features[real, 0].tolist(),
                ):
                    assert i not in rows, (name, world_size, i)
                    rows[i] = (label, dense)
        return rows

    one = named(1)
    if name != "criteo_tsv":  # one reader: the real rows come first, 0 .. n-1 (shards leave gaps)
        assert sorted(one) == list(range(len(one)))
    for world_size in (2, 4) if name == "criteo_tsv" else (2,):
        assert named(world_size) == one, (name, world_size)


@pytest.mark.slow
def test_the_tsv_reader_reads_each_line_once_over_ranks_and_workers(tmp_path):
    """Each rank parses its own shards: the lines counted over ranks and workers are the
    file's lines, once, however many passes evaluation makes."""
    totals = []
    for world_size, workers in ((1, 0), (2, 0), (2, 2), (4, 2)):
        reports = []
        for rank in range(world_size):
            source = _tsv(tmp_path)
            list(loader.batches(source, "train", rank, world_size, 40, num_workers=workers))  # > 1 cycle
            for _ in range(3):  # repeated evaluations count the eval file once
                list(loader.batches(source, "eval", rank, world_size, num_workers=workers))
            reports.append(source.report())
        files = {}
        for r in reports:
            for path, f in r["files"].items():
                files.setdefault(path, [0, 0])
                files[path][0] += f["rows"]
                files[path][1] += f["bad_rows"]
        totals.append(files)
    train, eval_ = str(tmp_path / "train.tsv"), str(tmp_path / "eval.tsv")
    for files in totals:
        assert files[train] == [300, 1] and files[eval_] == [70, 0]


@pytest.mark.unit
def test_workers_stop_at_the_end_on_error_and_when_abandoned(tmp_path):
    # this test process's pool of ranks (rank_pool) may be up already: only new children count
    before = set(multiprocessing.active_children())
    workers = lambda: set(multiprocessing.active_children()) - before
    source = _synthetic(tmp_path)
    it = loader.batches(source, "train", 0, 1, None, num_workers=2)
    try:
        next(it)
        assert len(workers()) == 2
    finally:
        it.close()  # what the trainer's generator does on Ctrl-C or an error: workers end
    assert workers() == set()
    assert len(list(loader.batches(source, "eval", 0, 1, num_workers=2))) == 3  # no hang at the end of a split
    assert workers() == set()
    write(tmp_path / "bad.tsv", [row()] * 40 + ["1\tbroken"])
    write(tmp_path / "eval.tsv", [row()] * 4)
    bad = CriteoTSV(
        batch_size=4,
        train_path=str(tmp_path / "bad.tsv"),
        eval_path=str(tmp_path / "eval.tsv"),
        num_embeddings_per_feature=SIZES,
        id_mapping="modulo",
        bad_rows="fail",
        block_size_mb=1,
        eval_batches=None,
        seed=0,
        shards=2,
    )
    with pytest.raises(DataError, match=r"bad.tsv:41: 2 fields, expected 40$"):  # one line, not a worker traceback
        list(loader.batches(bad, "train", 0, 1, 30, num_workers=2))
    assert workers() == set()


@pytest.mark.unit
def test_the_input_thread_stops_when_abandoned_and_raises_at_the_bad_batch(tmp_path):
    baseline = threading.active_count()
    it = loader.batches(_synthetic(tmp_path), "train", 0, 1, None, thread=True)
    next(it)
    assert [t.name for t in threading.enumerate()].count("hybridrec-input") == 1
    it.close()  # a run that stops early, or an error in the step
    assert threading.active_count() == baseline
    write(tmp_path / "bad.tsv", [row()] * 400 + ["1\tbroken"])  # several blocks: batches come before the error
    write(tmp_path / "eval.tsv", [row()] * 4)
    got = {}
    for thread in (False, True):
        bad = CriteoTSV(
            batch_size=4,
            train_path=str(tmp_path / "bad.tsv"),
            eval_path=str(tmp_path / "eval.tsv"),
            num_embeddings_per_feature=SIZES,
            id_mapping="modulo",
            bad_rows="fail",
            block_size_mb=1,
            eval_batches=None,
            seed=0,
            shards=1,
        )
        got[thread] = []
        with pytest.raises(DataError, match=r"bad.tsv:401: 2 fields, expected 40$"):
            for batch in loader.batches(bad, "train", 0, 1, 200, thread=thread):
                got[thread].append(batch)
    # the same good batches first, then the same one-line error, and no thread left
    assert 0 < len(got[True]) == len(got[False]) and threading.active_count() == baseline


# data=criteo at a size that trains in seconds: 6 steps of 64 rows, each file in 2 shards
CRITEO = ["data=criteo", "data.batch_size=64", "data.shards=2", "train.steps=6", "train.log_every=3"]


def _train(tmp_path, name, *overrides, ranks=1):
    run = tmp_path / name
    proc = commands.run(
        "hybridrec.train", *CRITEO, f"launcher.nproc_per_node={ranks}", f"hydra.run.dir={run}", *overrides, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.load(open(run / "summary.json"))


@pytest.mark.dist
def test_a_small_eval_set_is_scored_whole_on_1_and_2_ranks(tmp_path):
    """30 eval rows, fewer than one global batch of 64; bad rows in both files; two workers;
    evaluations every 2 steps do not multiply the eval file's counts. Two commands (about
    20 s: the elastic launcher starts the 2 ranks), not the pool of ranks: its ranks are
    daemon processes, which cannot start data workers."""
    train = write(tmp_path / "train.tsv", rand_rows(400, seed=1) + ["1\tbroken"] * 3)
    eval_ = write(tmp_path / "eval.tsv", rand_rows(30, seed=2) + ["x"])
    common = [f"data.train_path={train}", f"data.eval_path={eval_}", "data.num_workers=2", "train.eval_every=2"]
    one, two = _train(tmp_path, "one", *common), _train(tmp_path, "two", *common, ranks=2)
    for s in (one, two):
        assert s["eval"]["n"] == 30
        assert s["data"]["files"][train]["rows"] == 400 and s["data"]["files"][train]["bad_rows"] == 3
        assert s["data"]["files"][eval_]["rows"] == 30 and s["data"]["files"][eval_]["bad_rows"] == 1
    for key in ("auc", "ne", "logloss"):
        assert abs(one["eval"][key] - two["eval"][key]) < 1e-6, key


@pytest.mark.dist
def test_the_input_thread_trains_the_same_run(tmp_path):
    """2 ranks, batches built on a background thread or on the training thread: the same
    losses at every step, the same scores and the same counts of rows and bad rows."""
    train = write(tmp_path / "train.tsv", rand_rows(400, seed=1) + ["1\tbroken"] * 3)
    eval_ = write(tmp_path / "eval.tsv", rand_rows(30, seed=2) + ["x"])
    common = [*CRITEO, f"data.train_path={train}", f"data.eval_path={eval_}", "train.eval_every=2", "train.log_every=1"]
    threads = ("true", "false")
    # both runs in one scenario on the pool's 2 ranks: run i writes into runs/i
    results = spawn(
        train_and_summarize,
        2,
        [compose_cfg([*common, f"data.input_thread={t}"]) for t in threads],
        str(tmp_path / "runs"),
    )
    runs = {t: r["summary"] for t, r in zip(threads, results)}
    losses = {
        t: [json.loads(line).get("loss") for line in open(tmp_path / "runs" / str(i) / "metrics.jsonl")]
        for i, t in enumerate(threads)
    }
    assert losses["true"] == losses["false"] and len([x for x in losses["true"] if x is not None]) == 6
    assert runs["true"]["eval"] == runs["false"]["eval"] and runs["true"]["data"] == runs["false"]["data"]


@pytest.mark.slow
def test_an_empty_eval_set_fails_before_training(tmp_path):
    train = write(tmp_path / "train.tsv", rand_rows(200, seed=1))
    eval_ = write(tmp_path / "eval.tsv", ["x"] * 3)  # lines, none of them a row
    run = tmp_path / "run"
    proc = commands.run(
        "hybridrec.train",
        "data=criteo",
        f"data.train_path={train}",
        f"data.eval_path={eval_}",
        "data.batch_size=64",
        "data.shards=2",
        "train.steps=4",
        f"hydra.run.dir={run}",
        timeout=300,
    )
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1].startswith("hybridrec: ") and "eval" in proc.stderr
    assert not (run / "metrics.jsonl").exists() or not open(run / "metrics.jsonl").read()  # no step trained
