"""Hostile input, one row per case: what a careless user or an attacker feeds hybridrec, and a
fragment of the one line it must answer with. A new config key or data source gets covered by
adding a row. Config rows run the checks made before any rank starts (in-process, no rank);
data rows write tiny files and read them with the source a run would build."""

import itertools
import os
import re

import numpy as np
import pytest

from conftest import compose_cfg
from hybridrec.data import DataError, loader
from hybridrec.data.criteo import CriteoBinary, CriteoTSV
from hybridrec.data.fetch_movielens import write_layout
from hybridrec.run.launch import oversubscribed, world_size
from hybridrec.run.validation import validate
from shared import SIZES, ml, ml_sequences, row, tables, write

CTR = ["+experiment=ctr"]

# (overrides, the message's fragment)
CONFIG_CASES = [
    # numbers that are not numbers
    ([*CTR, "optimizer.dense.lr=nan"], "optimizer.dense.lr=nan is not a finite number"),
    ([*CTR, "optimizer.sparse.lr=inf"], "optimizer.sparse.lr=inf is not a finite number"),
    ([*CTR, "data.zipf_exponent=nan"], "data.zipf_exponent=nan is not a finite number"),
    (["+experiment=movielens", "data.label_threshold=nan"], "data.label_threshold=nan is not a finite number"),
    ([*CTR, "optimizer.dense_schedule.end_factor=-inf"], "optimizer.dense_schedule.end_factor=-inf is not a finite"),
    ([*CTR, "topology.host_memory_gb=inf"], "topology.host_memory_gb=inf is not a finite number"),
    # optimizer hyperparameters out of range
    ([*CTR, "optimizer.sparse.lr=-1"], "optimizer.sparse.lr=-1.0 is out of range: it must be > 0"),
    ([*CTR, "optimizer.dense.lr=0"], "optimizer.dense.lr=0.0 is out of range: it must be > 0"),
    ([*CTR, "optimizer.sparse.eps=-1"], "optimizer.sparse.eps=-1.0 is out of range: it must be > 0"),
    ([*CTR, "optimizer=adam", "optimizer.dense.betas=[0.9,1.5]"], "optimizer.dense.betas=[0.9, 1.5] is out of range"),
    (
        [*CTR, "optimizer=adam", "optimizer.dense.weight_decay=-0.1"],
        "optimizer.dense.weight_decay=-0.1 is out of range",
    ),
    (
        [*CTR, "optimizer=sgd", "optimizer.dense.momentum=1.2"],
        "optimizer.dense.momentum=1.2 is out of range: it must be in [0, 1)",
    ),
    ([*CTR, "optimizer.sparse.weight_decay=0.1"], "optimizer.sparse.weight_decay is not applied"),
    ([*CTR, "model.embedding_l2=-0.1"], "model.embedding_l2=-0.1: a penalty >= 0"),
    (["+experiment=sequences", "model.embedding_l2=0.1"], "SASRec has none: leave it 0"),
    (["+experiment=movielens_retrieval", "model.embedding_l2=0.1"], "TwoTower has none: leave it 0"),
    ([*CTR, "optimizer.clip_grad_norm=0"], "optimizer.clip_grad_norm must be > 0"),
    (
        [*CTR, "optimizer.dense_schedule.warmup_steps=-1"],
        "optimizer.dense_schedule.warmup_steps=-1: a number of steps, must be >= 0",
    ),
    ([*CTR, "optimizer.sparse_schedule.decay_steps=-3"], "optimizer.sparse_schedule.decay_steps=-3: a number of steps"),
    ([*CTR, "optimizer=adam", "optimizer.dense.betas=[0.9]"], "optimizer.dense.betas=[0.9]: Adam's two decay rates"),
    ([*CTR, "optimizer.sparse._target_=torch.optim.Adadelta"], "cannot be fused by TorchRec"),
    (
        [*CTR, "+optimizer.dense.foo=1"],
        "optimizer.dense (torch.optim.Adagrad): got an unexpected keyword argument 'foo'",
    ),
    # counts and sizes
    ([*CTR, "train.steps=0"], "train.steps must be >= 1, got 0"),
    ([*CTR, "train.log_every=0"], "train.log_every must be >= 1"),
    ([*CTR, "train.eval_every=-1"], "train.eval_every must be >= 0"),
    ([*CTR, "train.early_stop_patience=-1"], "train.early_stop_patience=-1 counts evaluations"),
    ([*CTR, "data.batch_size=0"], "data.batch_size must be >= 1, got 0"),
    ([*CTR, "data.valid_batches=-1"], "data.valid_batches must be >= 0, got -1"),
    ([*CTR, "data.eval_batches=0"], "data.eval_batches must be >= 1, got 0"),
    ([*CTR, "data.num_workers=-1"], "data.num_workers=-1: must be >= 0"),
    ([*CTR, "data.prefetch=0"], "data.prefetch=0: batches built ahead, must be >= 1"),
    ([*CTR, "data.ids_per_feature=0"], "data.ids_per_feature=0: ids per sample of every feature, must be >= 1"),
    ([*CTR, "data.multi_hot_sizes=[1,2]"], "data.multi_hot_sizes=[1, 2]: one size >= 1 per feature"),
    ([*CTR, "data.num_embeddings_per_feature=[10,0]"], "data.num_embeddings_per_feature must be non-empty and >= 1"),
    (["+experiment=movielens_rank", "data.list_size=0"], "data.list_size must be >= 1, got 0"),
    (["+experiment=movielens_rank", "data.negatives=-2"], "data.negatives must be >= 0, got -2"),
    ([*CTR, "model.embedding_dim=0"], "model.embedding_dim must be >= 1"),
    ([*CTR, "model.over_arch_layer_sizes=[64,2]"], "model.over_arch_layer_sizes must end with 1"),
    (
        [*CTR, "model.dense_arch_layer_sizes=[64,32]"],
        "model.dense_arch_layer_sizes must end with model.embedding_dim=64",
    ),
    (
        [*CTR, "model.dense_arch_layer_sizes=[0,16]"],
        "model.dense_arch_layer_sizes=[0, 16]: an MLP's layer sizes, each >= 1",
    ),
    (
        [*CTR, "model.over_arch_layer_sizes=[0,1]"],
        "model.over_arch_layer_sizes=[0, 1]: an MLP's layer sizes, each >= 1",
    ),
    (
        [*CTR, "model=dcn", "model.dcn_low_rank_dim=0"],
        "model.dcn_low_rank_dim=0: the cross network's rank must be >= 1",
    ),
    ([*CTR, "checkpoint.keep_last=0"], "checkpoint.keep_last=0: must be >= 1"),
    ([*CTR, "checkpoint.every_n_steps=-2"], "checkpoint.every_n_steps=-2: must be >= 0"),
    ([*CTR, "checkpoint.every_n_steps=5"], "checkpoint.every_n_steps is set but checkpoint.dir is not"),
    ([*CTR, "checkpoint.keep_best=true"], "checkpoint.keep_best=true keeps the checkpoint of the best"),
    ([*CTR, "checkpoint.max_loss_ratio=0.5"], "checkpoint.max_loss_ratio=0.5 would call a loss exploded"),
    (
        [*CTR, "checkpoint.max_loss_ratio=0"],
        "must be >= 1 (5 by default), or null to check only that losses are finite",
    ),
    ([*CTR, "launcher.threads_per_rank=0"], "launcher.threads_per_rank must be >= 1"),
    ([*CTR, "launcher.collective_timeout_s=0"], "launcher.collective_timeout_s=0.0: a timeout in seconds, must be > 0"),
    ([*CTR, "launcher.health_check_timeout_s=-1"], "launcher.health_check_timeout_s=-1.0: a timeout in seconds"),
    ([*CTR, "launcher.max_restarts=-1"], "launcher.max_restarts=-1: must be >= 0"),
    (
        [*CTR, "launcher.nproc_per_node=3"],
        "data.batch_size=2048 is the global batch and must divide evenly over world_size=3",
    ),
    ([*CTR, "launcher.max_restarts=2"], "launcher.max_restarts restarts ranks from the newest checkpoint"),
    ([*CTR, "profile.enabled=true", "profile.start_step=500"], "must fit in train.steps=400"),
    ([*CTR, "mesh.shard=0"], "mesh.shard must be >= 1"),
    (
        [*CTR, "mesh.shard=3"],
        "mesh.shard=3 is read only by mesh=hsdp (its dense shard degree); mesh=fsdp would ignore it",
    ),
    ([*CTR, "mesh=ddp", "mesh.replicate=2"], "mesh.replicate=2 is read only by mesh=hsdp"),
    ([*CTR, "mesh.forward_prefetch=-1"], "mesh.forward_prefetch=-1: must be >= 0"),
    ([*CTR, "topology.host_memory_gb=-1"], "topology.host_memory_gb must be > 0"),
    ([*CTR, "+train.stepz=30"], "unknown key train.stepz (did you mean train.steps?)"),
    (
        [*CTR, "model.embedding_dim=50"],
        "model.embedding_dim=50: TorchRec's fused embedding kernels (fbgemm) take widths "
        "that are multiples of 4; use 48 or 52",
    ),
    # sequence rankers
    (
        ["+experiment=sequences", "model=dlrm"],
        "next-item training takes a sequence model (model=sasrec or hstu), a next-item source",
    ),
    (["+experiment=sequences", "loss=pointwise"], "got model=SASRec, data=MovieLensSequences, loss=BCE"),
    (["+experiment=ctr", "model=sasrec", "loss=next_item"], "data=SyntheticClickLog"),
    (
        ["+experiment=sequences", "data.max_length=300"],
        "data.max_length=300 is more history than the model has positions (model.max_length=50)",
    ),
    (["+experiment=sequences", "data.max_length=0"], "data.max_length=0: the most recent items a history keeps, >= 1"),
    (["+experiment=sequences", "data.train_negatives=-1"], "data.train_negatives=-1: ids drawn per batch"),
    (["+experiment=sequences", "model.num_blocks=0"], "model.num_blocks=0: must be >= 1"),
    (["+experiment=sequences", "model.dropout=1.5"], "model.dropout=1.5: must be in [0, 1)"),
    (["+experiment=sequences", "model.num_heads=3"], "model.embedding_dim=64 must be divisible by model.num_heads=3"),
    (
        ["+experiment=sequences", "data.negative_sampling=popularity"],
        "data.negative_sampling=popularity chooses how sampled negatives are drawn, and data.train_negatives=0 samples "
        "none",
    ),
    (
        ["+experiment=sequences", "loss.in_batch=true"],
        "loss.in_batch=true adds the batch's next items to sampled "
        "negatives, and data.train_negatives=0 scores every item",
    ),
    # continuous training
    (
        ["+experiment=continuous", "data.partitions.ready_marker=../_SUCCESS"],
        "data.partitions.ready_marker='../_SUCCESS': the name of a file inside each partition",
    ),
    (
        ["+experiment=continuous", "data.partitions.ready_marker=''"],
        "data.partitions.ready_marker='': the name of a file inside each partition",
    ),
]


def _config_id(case) -> str:
    return " ".join(o for o in case[0] if not o.startswith("+experiment"))


@pytest.mark.unit
@pytest.mark.parametrize("overrides,fragment", CONFIG_CASES, ids=[_config_id(c) for c in CONFIG_CASES])
def test_a_bad_config_value_is_named_before_launch(overrides, fragment):
    cfg = compose_cfg(overrides)
    with pytest.raises(ValueError) as e:
        validate(cfg, world_size(cfg))
    assert fragment in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.unit
def test_the_suite_covers_every_optimizer_range_and_count_key():
    """Every range the checks know has a row above: a rule added without a case fails here."""
    from hybridrec.run.validation import _DATA_COUNTS, _OPTIMIZER_RANGES

    text = " ".join(" ".join(overrides) for overrides, _ in CONFIG_CASES)
    untested = [k for k in ("lr", "eps", "betas", "weight_decay", "momentum") if f".{k}=" not in text]
    untested += [k for k in _DATA_COUNTS if k != "eval_negatives" and f"data.{k}=" not in text]
    assert not untested, untested
    assert {"lr", "eps", "betas", "weight_decay", "momentum"} <= set(_OPTIMIZER_RANGES)


@pytest.mark.unit
def test_more_ranks_or_threads_than_cores_warns_with_the_numbers():
    cores = len(os.sched_getaffinity(0))
    cfg = compose_cfg([*CTR, f"launcher.nproc_per_node={4 * cores}"])
    note = oversubscribed(cfg, env={})
    assert (
        note and f"launcher.nproc_per_node={4 * cores} ranks x 1 thread(s) each" in note and f"on {cores} cores" in note
    )
    cfg = compose_cfg([*CTR, "launcher.threads_per_rank=1000"])
    assert f"= 1000 threads on {cores} cores" in oversubscribed(cfg, env={})
    assert oversubscribed(compose_cfg(CTR), env={}) is None  # the default splits the cores
    assert oversubscribed(compose_cfg(CTR), env={"OMP_NUM_THREADS": "abc"}) is None  # not a count: torch's own default


@pytest.mark.unit
def test_the_entry_point_warns_of_oversubscription_before_launch(caplog):
    """The note above, logged once by the checks a command runs before its ranks start."""
    import logging

    from hybridrec.train import check_before_launch

    with caplog.at_level(logging.WARNING, logger="hybridrec.train"):
        check_before_launch(compose_cfg([*CTR, "launcher.threads_per_rank=1000"]))
    notes = [r.getMessage() for r in caplog.records if "threads on" in r.getMessage()]
    assert len(notes) == 1 and "launcher.threads_per_rank" in notes[0], notes


@pytest.mark.unit
def test_an_output_directory_that_cannot_be_made_is_one_line(tmp_path):
    from hybridrec.run.callbacks import _check_output_dir

    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as e:
        _check_output_dir("hydra.run.dir", str(tmp_path / "file" / "run"))
    assert e.value.code == (
        f"hybridrec: hydra.run.dir={tmp_path}/file/run: cannot create the output directory "
        f"({tmp_path}/file is a file, not a directory): give another hydra.run.dir"
    )


# ----------------------------------------------------------------------------------- data
# Each writer puts a small dataset under ``d`` and returns the source reading it; the case
# reads every batch of every split, as one rank of one would.


def _tsv(d, rows, name="a.tsv", **kw):
    path = os.path.join(d, name)
    if isinstance(rows, bytes):
        open(path, "wb").write(rows)
    else:
        write(path, rows)
    other = write(os.path.join(d, "other.tsv"), [row()] * 4)
    args = dict(
        batch_size=4,
        train_path=other,
        eval_path=path,
        num_embeddings_per_feature=SIZES,
        id_mapping="modulo",
        bad_rows="fail",
        block_size_mb=1,
        eval_batches=None,
        seed=0,
    )
    return CriteoTSV(**{**args, **kw})


def _npy(d, dense=None, sparse=None, labels=None, raw=None):
    """A one-day .npy layout of 8 rows with one part replaced (``raw``: bytes for dense)."""
    parts = {
        "dense": np.ones((8, 13), np.float32),
        "sparse": np.ones((8, 26), np.int32),
        "labels": np.ones((8, 1), np.int32),
    }
    for name, value in (("dense", dense), ("sparse", sparse), ("labels", labels)):
        if value is not None:
            parts[name] = value
    for name, value in parts.items():
        np.save(os.path.join(d, f"day_0_{name}.npy"), value)
    if raw is not None:
        open(os.path.join(d, "day_0_dense.npy"), "wb").write(raw)
    os.makedirs(os.path.join(d, "eval"))
    for name, value in parts.items():
        np.save(
            os.path.join(d, "eval", f"day_1_{name}.npy"),
            value if raw is None or name != "dense" else np.ones((8, 13), np.float32),
        )
    return CriteoBinary(4, d, os.path.join(d, "eval"), SIZES, "modulo", None, 0)


def _gz(d, data, name="a.tsv.gz"):
    import gzip

    with gzip.open(os.path.join(d, name), "wb") as f:
        f.write(data)
    return os.path.join(d, name)


def _parquet(d, null_ids):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hybridrec.data.parquet import ParquetSource

    table = pa.table({"click": pa.array([1, 0, 1, 0], pa.int8()), "item": pa.array([1, None, 2, 3], pa.int64())})
    for split in ("train", "eval"):
        pq.write_table(table, os.path.join(d, f"{split}.parquet"))
    return ParquetSource(
        batch_size=2,
        train_path=os.path.join(d, "train.parquet"),
        eval_path=os.path.join(d, "eval.parquet"),
        label={"column": "click"},
        sparse=[{"name": "item", "column": "item", "num_embeddings": 5, "null_ids": null_ids}],
        bad_rows="fail",
        seed=0,
    )


def _with(array, index, value):
    array = array.copy()
    array[index] = value
    return array


def _ratings(d, line, bad_rows="fail"):
    t = tables()
    write_layout(t, d)
    with open(os.path.join(d, "u.data"), "a") as f:
        f.write(line + "\n")
    return ml(d, bad_rows=bad_rows)


def _sequences(d, **kw):
    write_layout(tables(), d)  # 30 movies
    return ml_sequences(d, **kw)


SPARSE = np.ones((8, 26), np.int32)
DATA_CASES = [
    ("criteo label 2", lambda d: _tsv(d, [row(), row(label=2)]), "a.tsv:2: label '2' is not 0 or 1"),
    (
        "criteo non-integer dense",
        lambda d: _tsv(d, [row(ints=["1.5"] + [1] * 12)]),
        "a.tsv:1: int_0 '1.5' is not an integer",
    ),
    ("criteo id not hex", lambda d: _tsv(d, [row(cats=["xyz"] * 26)]), "a.tsv:1: cat_0 'xyz' is not a hex id"),
    (
        "criteo plain text named .gz",
        lambda d: _tsv(d, [row()] * 4, name="a.tsv.gz"),
        "a.tsv.gz: named .gz but it is not gzip (it starts with b'1\\t': plain text: drop the .gz",
    ),
    (
        "criteo random bytes named .gz",
        lambda d: _tsv(d, bytes(range(256)) * 8, name="a.tsv.gz"),
        "a.tsv.gz: named .gz but it is not gzip (it starts with b'\\x00\\x01': not gzip)",
    ),
    (
        "criteo one huge bad line",
        lambda d: _tsv(
            d,
            [row()] * 4,
            bad_rows="skip",
            shards=4,
            train_path=write(os.path.join(d, "train.tsv"), [row(cats=["a" * 300_000] + ["a"] * 25)] + [row()] * 3),
        ),
        "0 usable rows in shard 0 of data.shards=4, fewer than its 1 rows of one global batch (data.batch_size=4): "
        "its 1 block(s) of lines held 0 valid rows",
    ),
    (
        "criteo empty .tsv.gz",
        lambda d: _tsv(d, [row()] * 4, train_path=_gz(d, b"")),
        "data.train_path: every file is empty (no text, once decompressed): ",
    ),
    (
        "criteo every row bad",
        lambda d: _tsv(
            d, [row()] * 4, bad_rows="skip", train_path=write(os.path.join(d, "bad.tsv"), [row(label="x")] * 6)
        ),
        "the train split has no usable rows: every one of its 6 lines is bad (the first: ",
    ),
    (
        "criteo binary named .tsv",
        lambda d: _tsv(d, bytes(range(256)) * 8),
        "a.tsv: not a text file (a NUL byte at byte 0 of its text); data.eval_path names Criteo's tab-separated logs",
    ),
    (
        "criteo binary named .tsv.gz",
        lambda d: _tsv(d, [row()] * 4, train_path=_gz(d, bytes(range(256)))),
        "a.tsv.gz: not a text file (a NUL byte at byte 0 of its text); data.train_path",
    ),
    (
        "npy label 2",
        lambda d: _npy(d, labels=_with(np.ones((8, 1), np.int32), 5, 2)),
        "day_0_labels.npy row 5: label 2 is not 0 or 1",
    ),
    (
        "npy NaN dense",
        lambda d: _npy(d, dense=_with(np.ones((8, 13), np.float32), (6, 3), np.nan)),
        "day_0_dense.npy row 6: dense value nan is not finite",
    ),
    (
        "npy infinite dense",
        lambda d: _npy(d, dense=_with(np.ones((8, 13), np.float32), (1, 0), np.inf)),
        "day_0_dense.npy row 1: dense value inf is not finite",
    ),
    (
        "npy float64 beyond float32",
        lambda d: _npy(d, dense=_with(np.ones((8, 13)), (2, 4), 1e300)),
        "day_0_dense.npy row 2: dense value 1e+300 (float64) is beyond float32's range (3.4e38)",
    ),
    (
        "parquet null id, null_ids=bad",
        lambda d: _parquet(d, "bad"),
        "train.parquet:1: item is null (data.sparse[0].null_ids=bad)",
    ),
    (
        "npy negative id",
        lambda d: _npy(d, sparse=_with(SPARSE, (2, 7), -5)),
        "day_0_sparse.npy row 2: id -5 is negative",
    ),
    (
        "npy float ids",
        lambda d: _npy(d, sparse=SPARSE.astype(np.float32)),
        "day_0_sparse.npy: dtype float32, expected integer ids",
    ),
    (
        "npy text labels",
        lambda d: _npy(d, labels=np.array([["1"]] * 8)),
        "day_0_labels.npy: dtype <U1, expected numbers",
    ),
    ("npy not a .npy", lambda d: _npy(d, raw=b"label,dense\n1,2\n"), "day_0_dense.npy: not a readable .npy file"),
    (
        "npy wrong width",
        lambda d: _npy(d, dense=np.ones((8, 12), np.float32)),
        "day_0_dense.npy: shape (8, 12), expected (rows, 13)",
    ),
    ("movielens rating 99", lambda d: _ratings(d, "3\t4\t99\t881250949"), "u.data:301: rating 99 is outside 1..5"),
    ("movielens rating 0", lambda d: _ratings(d, "3\t4\t0\t881250949"), "u.data:301: rating 0 is outside 1..5"),
    ("movielens user 0", lambda d: _ratings(d, "0\t4\t3\t881250949"), "u.data:301: user id 0 is outside 1..2147483647"),
    (
        "movielens non-integer",
        lambda d: _ratings(d, "3\t4\t4.5\t881250949"),
        "u.data:301: non-integer in an integer field",
    ),
    ("movielens missing field", lambda d: _ratings(d, "3\t4\t4"), "u.data:301: 3 fields, expected 4"),
    (
        "sequences more negatives than items",
        lambda d: _sequences(d, train_negatives=1000),
        "data.train_negatives=1000 draws more ids per batch than",
    ),
]


def _read_all(source) -> None:
    """What training checks first (a split with no usable row), then every batch of the
    evaluated splits and a first epoch of training (its stream has no end)."""
    loader.check_splits(source)
    for split in source.splits:
        for _ in itertools.islice(loader.batches(source, split, 0, 1), 4 if split == "train" else None):
            pass


@pytest.mark.unit
@pytest.mark.parametrize("make,fragment", [c[1:] for c in DATA_CASES], ids=[c[0] for c in DATA_CASES])
def test_a_bad_value_in_the_data_is_named_with_its_file_and_row(tmp_path, make, fragment):
    with pytest.raises(DataError) as e:
        _read_all(make(str(tmp_path)))
    assert fragment in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.unit
def test_a_bad_rating_costs_its_row_only_and_is_counted(tmp_path):
    data = _ratings(str(tmp_path), "3\t4\t99\t881250949", bad_rows="skip")
    report = data.report()["files"][str(tmp_path / "u.data")]
    assert report["rows"] == 300 and report["bad_rows"] == 1
    assert report["errors"] == [f"{tmp_path / 'u.data'}:301: rating 99 is outside 1..5"]
    assert len(data.user) == 300 and data.rating.max() <= 5


@pytest.mark.unit
def test_the_guide_counts_the_cases():
    guide = open(os.path.join(os.path.dirname(__file__), "..", "docs", "checkpoints.md")).read()
    counted = re.search(r"(\d+) config values and (\d+) data files", guide)
    assert counted and (int(counted[1]), int(counted[2])) == (len(CONFIG_CASES), len(DATA_CASES)), (
        f"docs/checkpoints.md: write '{len(CONFIG_CASES)} config values and {len(DATA_CASES)} data files'"
    )


@pytest.mark.unit
def test_a_parquet_null_id_is_a_row_without_ids_counted_per_feature(tmp_path):
    data = _parquet(str(tmp_path), "empty")
    batch = next(iter(loader.batches(data, "train", 0, 1, 1)))
    assert batch.sparse_features["item"].lengths().tolist() == [1, 0] and batch.weights.tolist() == [1, 1]
    assert data.report()["null_ids"] == {"item (data.sparse[0])": 1} and data.report()["bad_rows"] == 0


@pytest.mark.unit
def test_a_vocabulary_column_cannot_name_a_file_outside_out(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hybridrec.data import vocab

    pq.write_table(pa.table({"../../escaped_vocab": [1, 2, 3]}), tmp_path / "in.parquet")
    out = tmp_path / "a" / "b" / "out"
    assert vocab.main([str(tmp_path / "in.parquet"), "--column", "../../escaped_vocab", "--out", str(out)]) == 1
    assert sorted(p.name for p in tmp_path.rglob("*") if p.suffix == ".parquet") == ["in.parquet"]
