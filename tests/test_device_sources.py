"""The next-item sources and MovieLens' ratings made on the device (``data.device_input``), run
on the CPU: the rows of ``read``, byte for byte, for every split, 1 and 2 ranks, several
batches and epochs, every ``data.train_windows``, sampled and full negatives, with and without
MovieLens' side files; the loader's batches over epochs; no value read back on the host; a
short training run whose losses are those of the CPU path. ``MovieLensRank`` has no device
path and is refused by name."""

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from conftest import compose_cfg
from hybridrec.data import loader
from hybridrec.data.fetch_movielens import write_layout
from hybridrec.data.sequences import ParquetSequences
from hybridrec.run.validation import validate
from shared import GENRE_NAMES, ml, ml_sequences, no_host_reads, same_rows, tables

CPU = torch.device("cpu")


def _same_everywhere(source, epochs=(0, 1, 2)) -> None:
    """Every split, every batch (a few epochs of training), each rank's slice of 1 and 2 ranks."""
    reader = source.device_rows(CPU)
    for split in source.splits:
        for epoch in epochs if split == "train" else (0,):
            for index in range(source.num_batches(split)):
                for world in (1, 2):
                    for rank in range(world):
                        (lo, hi), *_ = loader.plan_pieces(source, world, rank)
                        same_rows(source.read(split, epoch, index, lo, hi), reader(split, index, lo, hi, epoch=epoch))


def _same_batches(source, split: str, world: int, num_batches: int, start: int = 0) -> None:
    """The loader's batches of both paths: training passes over epochs (the reader is told which)."""
    for rank in range(world):
        host = loader.batches(source, split, rank, world, num_batches, start)
        device = loader.batches(source, split, rank, world, num_batches, start, device_rows=source.device_rows(CPU))
        pairs = list(zip(host, device, strict=True))
        assert pairs
        for a, b in pairs:
            a, b = getattr(a, "batch", a), getattr(b, "batch", b)
            for name in ("dense_features", "labels", "times", "relevance", "weights", "query", "log_q"):
                x, y = getattr(a, name, None), getattr(b, name, None)
                assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), name
            x, y = a.sparse_features, b.sparse_features
            assert x.keys() == y.keys() and x.length_per_key() == y.length_per_key()
            assert torch.equal(x.values(), y.values()) and torch.equal(x.lengths(), y.lengths())


# ------------------------------------------------------------------------------ next-item histories
def _histories(d, users=13, seed=0):
    """u.data of ``users`` users with 1 to 24 ratings each (those under 3 left out, one of
    exactly 3: a training window of one item, no transition), times with ties, in file order
    shuffled."""
    rng = np.random.default_rng(seed)
    counts = [3, 1, 24, 2, *rng.integers(3, 25, users - 4)]
    rows = [
        (u + 1, int(rng.integers(1, 40)), 4, int(rng.integers(0, 12))) for u, k in enumerate(counts) for _ in range(k)
    ]
    rows = [rows[i] for i in rng.permutation(len(rows))]
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "u.data"), "w") as f:
        f.writelines(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in rows)
    return str(d)


def _sequences(d, **kw):
    return ml_sequences(d, **{"seed": 3, **kw})


@pytest.mark.unit
@pytest.mark.parametrize("windows", ["last", "all", "overlap"])
@pytest.mark.parametrize(
    "negatives, sampling", [(0, "uniform"), (5, "uniform"), (7, "popularity")], ids=["full", "uniform", "popularity"]
)
def test_the_device_path_gives_the_next_item_rows(tmp_path, windows, negatives, sampling):
    source = _sequences(
        _histories(tmp_path), train_windows=windows, train_negatives=negatives, negative_sampling=sampling
    )
    assert source.users == 11 and source.num_batches("eval") == 3  # a last batch of 3 rows: rank 1 has 1
    assert source.train_rows == 11 if windows == "last" else source.train_rows > 2 * 11  # a few windows a user
    _same_everywhere(source)


@pytest.mark.unit
def test_a_history_longer_than_max_length_and_one_id_rows(tmp_path):
    """max_length 1: every evaluated row one history item and one target; batch 2 of 2 ranks: a
    slice of one row, whose negatives (one sampled id) make every feature one id (laid out
    without lengths, as read lays them)."""
    source = _sequences(_histories(tmp_path), batch_size=2, max_length=1, train_negatives=1, train_windows="all")
    _same_everywhere(source, epochs=(0, 4))
    assert source.device_rows(CPU)("train", 0, 1, 2, epoch=4).lengths is None


@pytest.mark.unit
def test_the_device_path_gives_the_parquet_histories_rows(tmp_path):
    rng = np.random.default_rng(1)
    lengths = [5, 0, 3, 9, 2, 14, 7, 4, 11]
    pq.write_table(
        pa.table(
            {
                "items": [rng.integers(1, 30, k).tolist() for k in lengths],
                "ts": [rng.integers(0, 5, k).astype(float).tolist() for k in lengths],
            }
        ),
        tmp_path / "h.parquet",
    )
    for times_column, windows in ((None, "all"), ("ts", "last"), ("ts", "overlap")):
        source = ParquetSequences(
            batch_size=2,
            path=str(tmp_path),
            items_column="items",
            num_items=30,
            max_length=4,
            train_negatives=3,
            negative_sampling="popularity",
            bad_rows="fail",
            eval_batches=None,
            seed=0,
            times_column=times_column,
            train_windows=windows,
        )
        _same_everywhere(source, epochs=(0, 1))


@pytest.mark.unit
@pytest.mark.parametrize("world", [1, 2])
def test_the_loader_gives_the_next_item_batches_across_epochs(tmp_path, world):
    source = _sequences(_histories(tmp_path), train_windows="all", train_negatives=5)
    per_epoch = source.num_batches("train")
    _same_batches(source, "train", world, 2 * per_epoch + 2, start=per_epoch - 1)  # three epochs
    _same_batches(source, "eval", world, None)


# ---------------------------------------------------------------------------------- MovieLens' ratings
def _layout(path, one_genre=False):
    t = tables()
    if one_genre:  # every movie of exactly one genre: batches laid out one-hot, as read lays them
        for k, item in enumerate(t["items"]):
            item.update({name: int(g == k % len(GENRE_NAMES)) for g, name in enumerate(GENRE_NAMES)})
    write_layout(t, str(path))
    return path


@pytest.mark.unit
@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"side_features": False},
        {"valid_fraction": 0.25, "split": "time"},
        {"batch_size": 24, "valid_fraction": 0.1},
    ],
    ids=["side", "no-side", "valid-time", "partial-batches"],
)
def test_the_device_path_gives_the_movielens_rows(tmp_path, kw):
    source = ml(_layout(tmp_path / "ml"), **kw)
    _same_everywhere(source)


@pytest.mark.unit
def test_movies_of_one_genre_each_are_laid_out_one_hot_on_both_paths(tmp_path):
    source = ml(_layout(tmp_path / "ml", one_genre=True))
    assert source.read("train", 0, 0, 0, 20).lengths is None
    _same_everywhere(source, epochs=(0,))


@pytest.mark.unit
@pytest.mark.parametrize("world", [1, 2])
def test_the_loader_gives_the_movielens_batches_across_epochs(tmp_path, world):
    source = ml(_layout(tmp_path / "ml"), valid_fraction=0.1)
    per_epoch = source.num_batches("train")
    _same_batches(source, "train", world, per_epoch + 3, start=per_epoch - 2)
    _same_batches(source, "valid", world, None)


# ---------------------------------------------------------------------------------------- the contract


@pytest.mark.unit
def test_the_device_readers_read_no_value_back(tmp_path, monkeypatch):
    """On a GPU each such read would make the host wait for the device: every size the
    readers and the batch's KJT need comes from the host's index arrays."""
    sequences = _sequences(_histories(tmp_path / "seq"), train_windows="all", train_negatives=5)
    ratings = ml(_layout(tmp_path / "ml"))
    readers = [(s, s.device_rows(CPU)) for s in (sequences, ratings)]

    with no_host_reads(monkeypatch):
        for source, reader in readers:
            for split, epoch, index in (("train", 0, 0), ("train", 1, 1), ("eval", 0, 1)):
                reader(split, index, 0, source.batch_size, epoch=epoch).batch(source.keys)


@pytest.mark.unit
@pytest.mark.parametrize(
    "experiment, source",
    [("movielens_rank", "MovieLensRank"), ("movielens_retrieval", "MovieLensRank")],
)
def test_device_input_is_refused_by_name_for_a_source_without_it(experiment, source):
    with pytest.raises(ValueError, match=f"data.device_input=true: {source} reads its rows on the CPU"):
        validate(compose_cfg([f"+experiment={experiment}", "data.device_input=true"]), 1)


@pytest.mark.unit
@pytest.mark.parametrize("experiment", ["sequences", "movielens"])
def test_device_input_is_accepted_for_the_ratings_and_histories(experiment):
    validate(compose_cfg([f"+experiment={experiment}", "data.device_input=true"]), 1)


@pytest.mark.dist
def test_a_short_run_trains_the_same_losses_on_the_device_path(tmp_path):
    """One rank (the loader's device path on the CPU): the same losses, step by step."""
    from dist_helpers import spawn, train_and_gather

    write_layout(tables(400, seed=3), str(tmp_path / "ml"))
    short = [f"data.path={tmp_path / 'ml'}", "train.steps=3", "train.log_every=1", "train.eval_every=0"]
    short += ["train.early_stop_patience=0", "data.eval_batches=1", "launcher.device=cpu"]
    sequences = ["+experiment=sequences", "data.batch_size=8", "data.max_length=6", "model.max_length=6"]
    sequences += ["model.embedding_dim=8", "model.num_blocks=1", "model.num_heads=2", "data.train_windows=all"]
    movielens = ["+experiment=movielens", "data.batch_size=32", "model.embedding_dim=8"]
    movielens += ["model.dense_arch_layer_sizes=[16,8]", "model.deep_layer_sizes=[16]"]  # its DeepFM, penalized
    cfgs = [
        compose_cfg([*experiment, *short, f"data.device_input={on}"])
        for experiment in (sequences, movielens)
        for on in ("false", "true")
    ]
    runs = spawn(train_and_gather, 1, cfgs, str(tmp_path / "runs"))
    for off, on in (runs[:2], runs[2:]):
        assert len(off["losses"]) == 3 and off["losses"] == on["losses"]
