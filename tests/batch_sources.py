"""Every source, small, written on the fly, and a digest of the batches a rank reads from
it: what ``tests/test_batches.py`` compares with the digests recorded in
``tests/golden/batches.json``. A plain module (no tests), shared by the test and by the
command that records the digests:

    python tests/batch_sources.py --record      # writes tests/golden/batches.json

Recorded from the input pipeline before batches were built as contiguous arrays, the
synthetic sources again when their generator became version 2 (the same rows on every CPU);
any later change of a batch's content (a value, a length, a dtype, a field) changes a digest."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any, Callable

import blake3
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hybridrec.data import loader  # noqa: E402  (after the path of the tests' helpers, or the environment, is set)
from hybridrec.data.criteo import CriteoBinary, CriteoTSV  # noqa: E402  (after the path of the tests' helpers, or the environment, is set)
from hybridrec.data.fetch_movielens import write_layout  # noqa: E402  (after the path of the tests' helpers, or the environment, is set)
from hybridrec.data.parquet import ParquetSource  # noqa: E402  (after the path of the tests' helpers, or the environment, is set)
from hybridrec.data.synthetic import SyntheticClickLog  # noqa: E402  (after the path of the tests' helpers, or the environment, is set)
from shared import SIZES, ml, rand_rows, tables, write  # noqa: E402  (after the path of the tests' helpers, or the environment, is set)

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "batches.json")
WORLDS = (1, 2)
STEPS = 3  # training batches read per case (evaluated splits: every batch)


def _tsv(d: str, shards: int = 2, **kw: Any) -> CriteoTSV:
    train = write(os.path.join(d, "train.tsv"), rand_rows(300, seed=1))
    held = write(os.path.join(d, "held.tsv"), rand_rows(70, seed=2))
    return CriteoTSV(
        batch_size=16,
        train_path=train,
        eval_path=held,
        num_embeddings_per_feature=SIZES,
        id_mapping="modulo",
        bad_rows="skip",
        block_size_mb=1,
        eval_batches=None,
        seed=0,
        valid_fraction=0.2,
        shards=shards,
        **kw,
    )


def _binary(d: str) -> CriteoBinary:
    rng = np.random.default_rng(3)
    for sub, n in (("train", 200), ("eval", 45)):
        os.makedirs(os.path.join(d, sub), exist_ok=True)
        np.save(os.path.join(d, sub, "day_0_dense.npy"), rng.normal(size=(n, 13)).astype(np.float32))
        np.save(os.path.join(d, sub, "day_0_sparse.npy"), rng.integers(0, 2**31, (n, 26)).astype(np.int32))
        np.save(os.path.join(d, sub, "day_0_labels.npy"), rng.integers(0, 2, (n, 1)).astype(np.int32))
    return CriteoBinary(16, os.path.join(d, "train"), os.path.join(d, "eval"), SIZES, "modulo", None, 0)


def _parquet_table(first: int, n: int) -> pa.Table:
    r = np.arange(first, first + n)
    tags = [[int((i * 5 + j) % 20) for j in range(k)] for i, k in zip(r, (r * 7) % 4)]
    return pa.table(
        {
            "click": pa.array((r % 3 == 0).astype(np.int8)),
            "w": pa.array(((1 + r % 5) / 5).astype(np.float32)),
            "x": pa.array(r * 0.5, pa.float64()),
            "price": pa.array(np.where(r % 9 == 0, np.nan, r % 17), pa.float64()),
            "user": pa.array([f"u{i % 11}" for i in r]),
            "item": pa.array(r % 13, pa.int64()),
            "tags": pa.array(tags, pa.list_(pa.int64())),
            "tag_w": pa.array([[0.5 + j for j in range(len(t))] for t in tags], pa.list_(pa.float32())),
        }
    )


def _parquet(d: str, **kw: Any) -> ParquetSource:
    pq.write_table(_parquet_table(0, 70), os.path.join(d, "train.parquet"), row_group_size=9)
    pq.write_table(_parquet_table(100, 29), os.path.join(d, "eval.parquet"), row_group_size=7)
    pq.write_table(_parquet_table(200, 19), os.path.join(d, "valid.parquet"), row_group_size=5)
    return ParquetSource(
        batch_size=8,
        train_path=os.path.join(d, "train.parquet"),
        eval_path=os.path.join(d, "eval.parquet"),
        valid_path=os.path.join(d, "valid.parquet"),
        label={"column": "click"},
        weight="w",
        dense=[{"column": "x", "transform": "log1p"}, {"column": "price"}],
        sparse=[
            {"name": "item", "column": "item", "num_embeddings": 13},
            {"name": "user", "column": "user", "num_embeddings": 50, "id_mapping": "hash"},
            {"name": "tags", "column": "tags", "num_embeddings": 20, "weights_column": "tag_w", "pooling": "mean"},
        ],
        seed=0,
        **kw,
    )


def _parquet_one_hot(d: str) -> ParquetSource:
    pq.write_table(_parquet_table(0, 70), os.path.join(d, "train.parquet"), row_group_size=16)
    pq.write_table(_parquet_table(100, 29), os.path.join(d, "eval.parquet"))
    return ParquetSource(
        batch_size=8,
        train_path=os.path.join(d, "train.parquet"),
        eval_path=os.path.join(d, "eval.parquet"),
        label={"column": "click"},
        dense=[{"column": "x"}],
        sparse=[{"name": "item", "column": "item", "num_embeddings": 13}],
        seed=0,
    )


def _movielens(d: str, **kw: Any):
    write_layout(tables(400, seed=5), d)
    return ml(d, **kw)


def _synthetic(d: str, **kw: Any) -> SyntheticClickLog:
    args = dict(
        batch_size=32,
        num_dense_features=5,
        num_embeddings_per_feature=[300, 200, 100, 51],
        ids_per_feature=1,
        multi_hot_sizes=[],
        zipf_exponent=1.05,
        eval_batches=2,
        seed=3,
        valid_batches=1,
    )
    args.update(kw)
    return SyntheticClickLog(**args)


SOURCES: dict[str, Callable[[str], Any]] = {
    "synthetic one-hot": _synthetic,
    "synthetic multi-hot": lambda d: _synthetic(d, multi_hot_sizes=[1, 3, 2, 4], dense_distribution="lognormal"),
    "criteo tsv, 2 shards": _tsv,
    "criteo tsv, 4 shards": lambda d: _tsv(d, shards=4),
    "criteo binary": _binary,
    "parquet multi-hot weighted": _parquet,
    "parquet, 2 shards": lambda d: _parquet(d, shards=2),
    "parquet one-hot": _parquet_one_hot,
    "movielens": _movielens,
    "movielens lists": lambda d: _movielens_rank(d),
}


def _movielens_rank(d: str):
    from hybridrec.data.movielens import MovieLensRank

    write_layout(tables(400, seed=6), d)
    return MovieLensRank(
        batch_size=28,
        path=d,
        label_threshold=4,
        split="random",
        eval_fraction=0.2,
        side_features=True,
        bad_rows="skip",
        eval_batches=None,
        seed=0,
        list_size=5,
        negatives=2,
        negative_sampling="catalogue",
        eval_items="sampled",
        eval_negatives=3,
        ranking_k=5,
    )


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return f"{t.dtype}{tuple(t.shape)}".encode() + t.contiguous().numpy().tobytes()


def batch_digest(item: Any) -> str:
    """Every field of a batch (``RecBatch``, or an ``EvalBatch`` with its real mask and row
    index): dense, the KeyedJaggedTensor's keys, values, lengths and weights, labels and the
    ranking fields, dtypes and shapes included."""
    h = blake3.blake3()
    batch = getattr(item, "batch", item)
    kjt = batch.sparse_features
    h.update(repr(kjt.keys()).encode())
    for t in (batch.dense_features, kjt.values(), kjt.lengths(), batch.labels):
        h.update(_tensor_bytes(t))
    for t in (
        kjt.weights_or_none(),
        batch.relevance,
        batch.weights,
        batch.query,
        batch.log_q,
        getattr(item, "real", None),
        getattr(item, "rows", None),
    ):
        h.update(b"-" if t is None else _tensor_bytes(t))
    return h.hexdigest()


def digests(name: str, workers: int = 0) -> dict[str, str]:
    """``split/world/rank`` -> the digest of the rank's batches of that split (training:
    its first ``STEPS``), for the source ``name`` at each world size."""
    out = {}
    with tempfile.TemporaryDirectory() as d:
        source = SOURCES[name](d)
        for world in WORLDS:
            shards = getattr(source, "shards", None) or world
            if (
                source.batch_size % world
                or shards % world
                or source.pieces(world) < 1
                or source.lists
                and (source.batch_size // world) % source.list_size
            ):
                continue  # a layout the source's check_config refuses
            for rank in range(world):
                for split in source.splits:
                    steps = STEPS if split == "train" else None
                    h = blake3.blake3()
                    for item in loader.batches(source, split, rank, world, steps, num_workers=workers):
                        h.update(batch_digest(item).encode())
                    out[f"{split}/{world}/{rank}"] = h.hexdigest()
    return out


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    golden = {name: digests(name) for name in SOURCES}
    with open(GOLDEN, "w") as f:
        json.dump(golden, f, indent=1, sort_keys=True)
    print(f"{GOLDEN}: {sum(len(v) for v in golden.values())} digests of {len(golden)} sources")
