"""Criteo's binary layout converted on the device (``data.device_input``), run on the CPU: the
same batches as the CPU reader for every stored dtype, both id mappings, rows across days and
held-out runs, 1 and 2 ranks; a bad value is flagged on the device and named (file, row) by the
CPU reader when the flag is read, and a run stops there before a later save is committed."""

import os

import numpy as np
import pytest
import torch

import commands
from conftest import compose_cfg
from hybridrec.data import DataError, loader, splitmix64
from hybridrec.data.criteo import CriteoBinary
from hybridrec.data.criteo.binary_device import splitmix64 as splitmix64_torch
from hybridrec.data.criteo.binary_device import unsigned_mod

CPU = torch.device("cpu")
SIZES = [7, 1000, 2**31 - 1, 3, 100_003] + [50] * 21


def _day(folder, name, n, seed, dense=np.float32, sparse=np.int32, labels=np.int32):
    rng = np.random.default_rng(seed)
    os.makedirs(folder, exist_ok=True)
    prefix = os.path.join(folder, name)
    np.save(f"{prefix}_dense.npy", rng.lognormal(size=(n, 13)).astype(dense))
    top = min(np.iinfo(sparse).max, 2**40)
    np.save(f"{prefix}_sparse.npy", rng.integers(0, top, (n, 26), dtype=np.int64).astype(sparse))
    np.save(f"{prefix}_labels.npy", rng.integers(0, 2, (n, 1)).astype(labels))
    return prefix


def _binary(tmp_path, mapping="modulo", batch=16, **kw) -> CriteoBinary:
    return CriteoBinary(
        batch_size=batch,
        train_path=str(tmp_path / "train"),
        eval_path=str(tmp_path / "eval"),
        num_embeddings_per_feature=SIZES,
        id_mapping=mapping,
        eval_batches=None,
        seed=0,
        **kw,
    )


def _same_batches(source, world):
    for rank in range(world):
        host = list(loader.batches(source, "train", rank, world, num_batches=4))
        reader = source.device_rows(CPU)
        device = list(loader.batches(source, "train", rank, world, num_batches=4, device_rows=reader))
        reader.check()
        assert len(host) == len(device) == 4
        for a, b in zip(host, device):
            assert torch.equal(a.dense_features, b.dense_features) and a.dense_features.dtype == b.dense_features.dtype
            assert torch.equal(a.labels, b.labels) and a.labels.dtype == b.labels.dtype
            x, y = a.sparse_features, b.sparse_features
            assert x.length_per_key() == y.length_per_key()
            assert torch.equal(x.values(), y.values()) and torch.equal(x.lengths(), y.lengths())


@pytest.mark.unit
@pytest.mark.parametrize(
    "dense, sparse, labels",
    [
        (np.float32, np.int32, np.int32),
        (np.float16, np.uint32, np.bool_),
        (np.float64, np.int64, np.float32),
        (np.float32, np.uint16, np.uint8),
        (np.float32, np.uint64, np.int64),
    ],
)
@pytest.mark.parametrize("mapping", ["modulo", "hash"])
def test_the_device_path_gives_the_cpu_readers_batches(tmp_path, dense, sparse, labels, mapping):
    # two training days of 40 and 30 rows: batch 2 of 16 rows spans them
    _day(tmp_path / "train", "day_0", 40, 1, dense, sparse, labels)
    _day(tmp_path / "train", "day_1", 30, 2, dense, sparse, labels)
    _day(tmp_path / "eval", "day_2", 20, 3, dense, sparse, labels)
    source = _binary(tmp_path, mapping)
    _same_batches(source, 1)
    _same_batches(source, 2)


@pytest.mark.unit
def test_held_out_runs_are_read_the_same(tmp_path):
    _day(tmp_path / "train", "day_0", 9000, 1)
    _day(tmp_path / "eval", "day_1", 20, 3)
    _same_batches(_binary(tmp_path, batch=2048, valid_fraction=0.3), 1)


@pytest.mark.unit
def test_the_64_bit_mix_and_modulo_match_numpy_on_every_bit_pattern():
    rng = np.random.default_rng(0)
    u = np.concatenate([rng.integers(0, 2**64, 5000, dtype=np.uint64), np.array([0, 1, 2**63, 2**64 - 1], np.uint64)])
    n = np.array([[7], [2**31 - 1], [2**61 + 1]], dtype=np.uint64)
    t = torch.from_numpy(u.view(np.int64).copy())
    assert torch.equal(splitmix64_torch(t), torch.from_numpy(splitmix64(u).view(np.int64)))
    got = unsigned_mod(t[None, :], torch.from_numpy(n.astype(np.int64)))
    assert torch.equal(got, torch.from_numpy((u[None, :] % n).astype(np.int64)))


@pytest.mark.unit
@pytest.mark.parametrize(
    "part, value, message",
    [
        ("labels", 2, r"day_1_labels.npy row 5: label 2 is not 0 or 1"),
        ("dense", np.nan, r"day_1_dense.npy row 5: dense value nan is not finite"),
        ("sparse", -4, r"day_1_sparse.npy row 5: id -4 is negative"),
    ],
)
def test_a_bad_value_is_flagged_on_the_device_and_named_by_the_cpu_reader(tmp_path, part, value, message):
    _day(tmp_path / "train", "day_0", 40, 1)
    prefix = _day(tmp_path / "train", "day_1", 30, 2)
    _day(tmp_path / "eval", "day_2", 20, 3)
    array = np.load(f"{prefix}_{part}.npy")
    array[5, 0] = value
    np.save(f"{prefix}_{part}.npy", array)
    source = _binary(tmp_path)
    reader = source.device_rows(CPU)
    batches = loader.batches(source, "train", 0, 1, num_batches=4, device_rows=reader)
    next(batches)  # rows 0-15: good
    reader.check()
    for _ in range(2):  # rows 16-47: day_1's row 5 is row 45
        next(batches)
    with pytest.raises(DataError, match=message):
        reader.check()


@pytest.mark.slow
def test_a_run_on_the_device_path_stops_at_the_bad_row_and_commits_no_later_save(tmp_path):
    """A run (one rank, data.device_input=true on the CPU) with a bad label in its ninth batch
    stops naming the file and row, with the same committed checkpoints as the CPU reader's run:
    step 4's (before the bad batch), not step 8's."""
    _day(tmp_path / "train", "day_0", 16 * 12, 1)
    _day(tmp_path / "eval", "day_1", 32, 3)
    labels = np.load(tmp_path / "train" / "day_0_labels.npy")
    labels[16 * 8 + 3, 0] = 7
    np.save(tmp_path / "train" / "day_0_labels.npy", labels)
    for device_input in ("true", "false"):
        ckpt = tmp_path / f"ckpt_{device_input}"
        proc = commands.run(
            "hybridrec.train",
            "data=criteo_binary",
            f"data.train_path={tmp_path / 'train'}",
            f"data.eval_path={tmp_path / 'eval'}",
            "data.batch_size=16",
            f"data.device_input={device_input}",
            "train.steps=12",
            "train.log_every=6",
            f"checkpoint.dir={ckpt}",
            "checkpoint.every_n_steps=4",
            f"hydra.run.dir={tmp_path / device_input}",
            timeout=180,
        )
        assert proc.returncode != 0
        assert (
            "hybridrec: " + str(tmp_path / "train" / "day_0_labels.npy row 131: label 7 is not 0 or 1") in proc.stderr
        )
        assert sorted(p for p in os.listdir(ckpt) if p.startswith("step_")) == ["step_00000004"], device_input


@pytest.mark.dist
def test_a_training_step_reads_nothing_back_from_the_device(tmp_path):
    """No code of hybridrec's reads a tensor's value on the host inside a training step, with
    the batches drawn on the device or built on the host (on a GPU each such read waits for the
    device). The reads left are the libraries' (TorchRec's input distribution reads its splits)."""
    from dist_helpers import host_reads_in_steps, spawn

    short = ["+experiment=ctr", "data.batch_size=1024", "train.steps=12", "train.log_every=1000"]
    short += ["data.eval_batches=1", "train.eval_every=0"]
    cfgs = [compose_cfg([*short, "data.device_input=true"]), compose_cfg(short)]
    for reads in spawn(host_reads_in_steps, 1, cfgs, str(tmp_path), 5, 10):
        assert any(where.startswith("library") for where in reads), reads  # the count sees reads
        assert not [where for where in reads if where.startswith("hybridrec")], reads
