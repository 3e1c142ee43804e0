"""ParquetSource (``data=parquet``): its config checks, building (the files' index, the
splits, fitted dense statistics, the features' estimates) and reading (random access to the
row groups of a rank's rows); the package's docstring says how rows are read and counted."""

from __future__ import annotations

import logging
import os
import threading
import zlib
from typing import Any, Callable, Iterator, Optional, cast

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from omegaconf import DictConfig

from hybridrec.config.schema import BadRows, ParquetIdMapping
from hybridrec.config.tasks import tasks_of
from hybridrec.data import DataError, ReadReport, SparseFeature, check_disjoint, holdout, numeric
from hybridrec.data.criteo import resolve_paths, validation_fraction
from hybridrec.data.parquet.checks import check_config
from hybridrec.data.parquet.columns import _NUMERIC, _Columns, _is_list, _kind, _Part
from hybridrec.data.parquet.config import _dense_list, _plain, _sparse_list, _value
from hybridrec.data.parquet.device import ParquetOnDevice, device_refusal
from hybridrec.data.parquet.fit import fit_dense
from hybridrec.data.parquet.layout import _File, _Open, _Split
from hybridrec.data.parquet.managed import ManagedIds
from hybridrec.data.parquet.partitioned import PARTITION, _Partitioned
from hybridrec.data.parquet.partitions import Partition, list_partitions
from hybridrec.data.parquet.vocabulary import Vocabulary
from hybridrec.data.raw_inputs import MANAGED_FILE, RawInputs, dense_input, sparse_input
from hybridrec.data.source import Rows, Source

log = logging.getLogger("hybridrec.data.parquet")  # the package's name: its log lines read as before the split

HOLDOUT_RUN = 4096
"""valid_fraction holds out runs of this many consecutive rows of a file: a read stays a few
contiguous ranges of a row group."""
SAMPLE_ROWS = 100_000
"""Training rows (the first ones) on which pooling factors and collisions are estimated."""
_CACHED_GROUPS = 2  # per reader: a rank's slice (or one shard's chunk) can straddle two row groups
_OPEN_FILES = 8  # open ParquetFile handles kept per process, per reader


class ParquetSource(_Columns, _Partitioned, Source):
    """Rows of Parquet files, read by random access (see the module docstring)."""

    per_rank_report = True  # a rank reads, and counts, only its slice of each batch
    extra_fields = ("weights",)  # the sample weight; 0 for bad rows and padding

    @classmethod
    def check_config(cls, cfg: DictConfig, world_size: int) -> None:
        check_config(cfg, world_size)

    def __init__(
        self,
        batch_size: int,
        train_path: str,
        eval_path: str,
        label: Any,
        sparse: Any,
        seed: int,
        dense: Any = (),
        weight: Optional[str] = None,
        valid_path: Optional[str] = None,
        valid_fraction: float = 0.0,
        hash_seed: int = 0,
        bad_rows: BadRows = BadRows.skip,
        eval_batches: Optional[int] = None,
        shards: Optional[int] = None,
        partitions: Any = None,
        managed_ids: Any = None,
        numeric_encoding: Any = "scalar",
        numeric_buckets: int = 16,
        labels: Any = None,
    ) -> None:
        self.batch_size, self.seed, self.eval_batches = batch_size, seed, eval_batches
        self.tasks = tasks_of(_plain(labels) if labels else None)
        self.shards = shards
        self.hash_seed = int(hash_seed)
        self.fail = _value(bad_rows) == BadRows.fail.value
        label = _plain(label)
        self.label_column, self.threshold_value = label.get("column"), label.get("threshold")
        # the label columns read: each task's (data.labels), or data.label's
        self.label_columns = [t.column for t in self.tasks] if self.tasks else [self.label_column]
        self.weight_column = weight
        self.dense = _dense_list(dense, numeric_encoding, numeric_buckets)
        self.sparse = _sparse_list(sparse)
        self.num_dense_features = sum(d.scalar for d in self.dense)
        self.valid_fraction = validation_fraction(valid_path, valid_fraction)
        specs = {"train": train_path, "eval": eval_path, **({"valid": valid_path} if valid_path else {})}
        self.partitioning = _plain(partitions) if partitions is not None else None
        self.train_root = train_path
        listed: list[Partition] = []
        if self.partitioning:  # train_path is a directory of time partitions (partitions.py)
            listed = list_partitions(train_path, self.partitioning["pattern"], self.partitioning.get("ready_marker"))
            if not any(p.files for p in listed):
                raise DataError(
                    f"data.train_path={train_path}: no partition with Parquet files (names like "
                    f"{self.partitioning['pattern']!r}"
                    + (
                        f", holding {self.partitioning['ready_marker']}"
                        if self.partitioning.get("ready_marker")
                        else ""
                    )
                    + ")"
                )
        paths = {
            split: [f for p in listed for f in p.files]
            if split == "train" and self.partitioning
            else resolve_paths(spec, f"data.{split}_path", "*.parquet")
            for split, spec in specs.items()
        }
        check_disjoint({f"data.{split}_path": p for split, p in paths.items()})
        self.splits = ("train", "valid", "eval") if valid_path or self.valid_fraction else ("train", "eval")
        self.columns = list(
            dict.fromkeys(
                self.label_columns
                + ([weight] if weight else [])
                + [d.column for d in self.dense]
                + [c for f in self.sparse for c in (f.column, f.weights_column) if c]
            )
        )
        self.vocabularies = {
            # check_config: id_mapping=vocabulary comes with a vocabulary file
            f.index: Vocabulary(cast(str, f.vocabulary), f"data.sparse[{f.index}].vocabulary")
            for f in self.sparse
            if f.id_mapping == ParquetIdMapping.vocabulary.value
        }
        for i, vocab in self.vocabularies.items():
            f = self.sparse[i]
            if f.num_embeddings < vocab.size + 1:
                raise DataError(
                    f"data.sparse[{i}].num_embeddings={f.num_embeddings} is too small for "
                    f"{f.vocabulary} ({vocab.size} ids): it needs {vocab.size + 1} rows "
                    f"(row 0 is every id not in the vocabulary)"
                )
        self._splits: dict[str, _Split] = {}
        files = {split: [self._index(p, f"data.{split}_path") for p in ps] for split, ps in paths.items()}
        for split, fs in files.items():
            self._splits[split] = self._layout(fs, None)
        self.partitions: list[dict[str, Any]] = []
        self._indexed = {f.path: f for f in files["train"]}
        self._local = threading.local()  # the managed-id version of the read in progress, per thread
        self.managed: Optional[ManagedIds] = None
        tables = {f.table_name: f.num_embeddings for f in self.sparse if f.id_mapping == ParquetIdMapping.managed.value}
        if tables:
            m = _plain(managed_ids) or {}
            self.managed = ManagedIds(
                tables, int(m.get("min_count", 1)), m.get("eviction") or "lfu", self.partition_keys
            )
        if self.partitioning:
            self.set_partitions(listed)
        if self.valid_fraction:
            self._splits["train"] = self._layout(files["train"], False)
            self._splits["valid"] = self._layout(files["train"], True)
        for split, sp in self._splits.items():
            if split.startswith(PARTITION):
                continue  # a partition without rows is a day without rows: reported, not refused
            if (sp.total < (1 if self.partitioning else batch_size)) if split == "train" else sp.total == 0:
                carved = split != "eval" and self.valid_fraction
                raise DataError(
                    f"the {split} split has {sp.total} rows"
                    + (
                        f" (data.train_path less data.valid_fraction={self.valid_fraction})"
                        if carved
                        else f" in its partitions (data.train_path={train_path}"
                        + (
                            f", up to data.partitions.train_until={self.partitioning['train_until']}"
                            if self.partitioning.get("train_until")
                            else ""
                        )
                        + ")"
                        if self.partitioning
                        else ""
                    )
                    + (
                        f": fewer than one global batch (data.batch_size={batch_size})"
                        if split == "train"
                        else ": nothing to evaluate"
                    )
                )
        self._open: Optional[_Open] = None
        self._report = ReadReport()
        self._counting: dict[str, Optional[int]] = {}  # the epoch a split's rows are counted in
        self._fitted = self._fit_dense()
        self.features = self._features()
        self._release()  # worker processes fork from here: they open their own files

    # -- building --------------------------------------------------------------------------
    def _index(self, path: str, key: str) -> _File:
        """The file's row groups and its columns, checked against the config."""
        try:
            meta = pq.read_metadata(path)
            schema = meta.schema.to_arrow_schema()
        except (OSError, pa.ArrowInvalid) as e:
            raise DataError(f"{path} ({key}): not a readable Parquet file ({str(e).splitlines()[0]})") from None
        types = {name: schema.field(name).type for name in schema.names}

        def need(column: str, what: str, ok: Callable[[pa.DataType], bool], expected: str) -> pa.DataType:
            if column not in types:
                raise DataError(f"{path}: no column {column!r} ({what}); its columns: {', '.join(schema.names)}")
            if not ok(types[column]):
                raise DataError(f"{path}: column {column!r} ({what}) is {types[column]}, expected {expected}")
            return types[column]

        numeric = lambda t: _kind(t) in _NUMERIC
        if self.tasks:
            for i, task in enumerate(self.tasks):
                need(task.column, f"data.labels[{i}].column", numeric, "numbers or booleans")
        else:
            need(self.label_column, "data.label.column", numeric, "numbers or booleans")
        if self.weight_column:
            need(self.weight_column, "data.weight", lambda t: _kind(t) in ("int", "float", "decimal"), "numbers")
        for i, d in enumerate(self.dense):
            need(d.column, f"data.dense[{i}].column", numeric, "numbers or booleans")
        for f in self.sparse:
            key_ = f"data.sparse[{f.index}].column"
            kinds = {"none": ("int",), "hash": ("int", "str"), "managed": ("int", "str")}.get(
                f.id_mapping, (self.vocabularies[f.index].kind,) if f.index in self.vocabularies else ()
            )
            element = lambda t: t.value_type if _is_list(t) else t
            t = need(
                f.column,
                key_,
                lambda t: _kind(element(t)) in kinds,
                f"{' or '.join('integers' if k == 'int' else 'strings' for k in kinds)} (or lists of them)"
                + (
                    f": the vocabulary's ids are {'integers' if kinds == ('int',) else 'strings'}"
                    if f.id_mapping == "vocabulary"
                    else ""
                ),
            )
            if f.weights_column:
                shape = _is_list(t)
                need(
                    f.weights_column,
                    f"data.sparse[{f.index}].weights_column",
                    lambda w: _is_list(w) == shape and _kind(element(w)) in ("int", "float", "decimal"),
                    "lists of numbers, like its ids" if shape else "numbers, like its ids (one per row)",
                )
            if f.max_length is not None and not _is_list(t):
                raise DataError(
                    f"{path}: data.sparse[{f.index}].max_length is set but column {f.column!r} is {t}, one id per row"
                )
        starts = np.concatenate([[0], np.cumsum([meta.row_group(g).num_rows for g in range(meta.num_row_groups)])])
        return _File(path, int(meta.num_rows), starts.astype(np.int64), zlib.crc32(os.path.basename(path).encode()))

    def _layout(self, files: list[_File], held: Optional[bool]) -> _Split:
        """The split of ``files``: every row (held None), or the runs the holdout keeps
        (held False: training) or holds out (True: validation)."""
        seg_file, seg_start, seg_count = [], [], []
        for i, f in enumerate(files):
            if held is None:
                runs = np.zeros(1, np.int64)
                starts, counts = runs, np.array([f.rows], np.int64)
            else:
                runs = np.arange(-(-f.rows // HOLDOUT_RUN), dtype=np.int64)
                keep = holdout(self.seed, f.stream, runs, self.valid_fraction) == held
                starts = runs[keep] * HOLDOUT_RUN
                counts = np.minimum(HOLDOUT_RUN, f.rows - starts)
            seg_file.append(np.full(len(starts), i, np.int64))
            seg_start.append(starts)
            seg_count.append(counts)
        cat = lambda parts: np.concatenate(parts) if parts else np.zeros(0, np.int64)
        return _Split(files, cat(seg_file), cat(seg_start), cat(seg_count))

    def _fit_dense(self) -> bool:
        """The dense entries' statistics left unset (``fit.fit_dense``), on the train split.
        Partitioned: on the first partition with rows, the data a run has when it starts;
        later days would leak into the scores of the days before them."""
        split = next((PARTITION + p["name"] for p in self.partitions if p["rows"]), "train")
        total = self._splits[split].total
        fitted = fit_dense(self.dense, lambda columns: (t for _, _, t in self._ranges(split, 0, total, columns)), total)
        if fitted is None:
            return False
        self.dense = fitted
        return True

    def fitted(self) -> dict[str, Any]:
        """The data-config keys this source computed at build, as config values: ``{"dense":
        [...]}`` (every dense entry, standardize's mean and std filled in) when some were
        fitted on the train split, else {}. Merged into the data config before launch, they
        travel with the run (ranks, run directory, a checkpoint's config.yaml), so the same
        numbers standardize serving inputs and no rank fits them again."""
        if not self._fitted:
            return {}
        # Every entry whole, its encoding resolved: the list replaces the config's, where an
        # entry that left its encoding to data.numeric_encoding would otherwise follow it.
        return {
            "dense": [
                {"column": d.column, "transform": d.transform, "mean": d.mean, "std": d.std, "encoding": d.encoding}
                | ({} if d.scalar else {"buckets": d.buckets, "knots": list(d.knots or ()), "name": d.name})
                for d in self.dense
            ]
        }

    def raw_inputs(self) -> RawInputs:
        """A raw row is a row of the log: the dense and sparse columns of the data config,
        converted as ``_Columns._convert`` converts them (the fitted standardize values, the
        hash seed, the vocabulary files, copied into the export, and the managed ids' file);
        a row training would have made padding (a null dense value, an id outside a table
        with id_mapping=none) is refused."""
        steps: dict[str, list[dict[str, Any]]] = {"log1p": [{"op": "clamp", "min": 0.0}, {"op": "log1p"}], "none": []}
        dense = [
            dense_input(
                d.column,
                steps[d.transform] if d.transform in steps else [{"op": "standardize", "mean": d.mean, "std": d.std}],
            )
            for d in self.dense
            if d.scalar
        ]
        # the layout the files have (a partitioned log's trained files may be none yet)
        files = [f for sp in self._splits.values() for f in sp.files]
        schema = pq.read_schema(files[0].path)
        sparse: list[dict[str, Any]] = []
        copies: dict[str, str] = {}
        for f in self.sparse:
            if f.id_mapping == ParquetIdMapping.none.value:
                ids: dict[str, Any] = {"kind": "row", "outside": "error"}
            elif f.id_mapping == ParquetIdMapping.hash.value:
                ids = {"kind": "hash", "function": "splitmix64", "seed": self.hash_seed, "modulo": f.num_embeddings}
            elif f.id_mapping == ParquetIdMapping.managed.value:
                ids = {
                    "kind": "managed",
                    "file": MANAGED_FILE,
                    "table": f.table_name,
                    "function": "splitmix64",
                    "seed": self.hash_seed,
                }
            else:  # features sharing a table share its vocabulary (check_config): one file per table
                ids = {"kind": "vocabulary", "file": f"vocabulary_{f.table_name}.parquet"}
                assert f.vocabulary is not None  # id_mapping=vocabulary: __init__ read its Vocabulary from it
                copies[ids["file"]] = f.vocabulary
            layout = "list" if f.max_length is not None or _is_list(schema.field(f.column).type) else "one id or list"
            sparse.append(
                sparse_input(
                    f.name,
                    f.column,
                    f.table_name,
                    f.num_embeddings,
                    f.pooling,
                    ids,
                    layout,
                    weights_column=f.weights_column,
                    max_length=f.max_length,
                    truncate=f.truncate,
                    null_rows="error" if f.null_ids == "bad" else "empty",
                )
            )
        for d in self.dense:
            if not d.scalar:  # one number per row, its ids computed from it (``hybridrec.data.numeric``)
                assert d.knots is not None  # given, or fitted at build
                ids = {"kind": "numeric", "encoding": d.encoding, "knots": list(d.knots)}
                rows = numeric.rows_of(d.encoding, list(d.knots))
                sparse.append(
                    sparse_input(d.name, d.column, d.table_name, rows, "sum", ids, "one id", null_rows="error")
                )
        read = [c for c in self.columns if c not in (*self.label_columns, self.weight_column)]
        return RawInputs(f"a row of the feature log: columns {', '.join(read)}", dense, sparse, copies=copies)

    def _features(self) -> list[SparseFeature]:
        """The features, with pooling factors (mean ids per row) and collisions estimated on
        the first SAMPLE_ROWS training rows; a table where most ids collide is warned about."""
        n = min(SAMPLE_ROWS, self._splits["train"].total)
        lengths: list[list[np.ndarray]] = [[] for _ in self.sparse]
        keys: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in self.sparse]
        for file, first, table in self._ranges("train", 0, n, self.columns):
            part = self._convert(table, [(file, first, table.num_rows)], None, sample=True)
            assert part.keys is not None  # sample=True keeps the id keys
            for f in self.sparse:
                values, length, _ = part.ids[f.index]
                lengths[f.index].append(length[part.real])
                key = part.keys[f.index]
                if key is not None:
                    keep = np.repeat(part.real, length)
                    keys[f.index].append((key[keep], values[keep]))
        collisions = {}
        for f in self.sparse:
            if not keys[f.index] or f.id_mapping == ParquetIdMapping.managed.value:
                continue  # a managed id has a row of its own or none: reported per partition instead
            raw, rows = (np.concatenate(a) for a in zip(*keys[f.index]))
            if f.id_mapping == "hash":
                pairs = np.unique(np.stack([rows.astype(np.uint64), raw]), axis=1)
                _, per_row = np.unique(pairs[0], return_counts=True)
                if pairs.shape[1] > len(per_row):
                    collisions[f.name] = {
                        "distinct_ids": int(pairs.shape[1]),
                        "distinct_rows": len(per_row),
                        "sample_rows": n,
                        "colliding_share": round(float(per_row[per_row > 1].sum()) / pairs.shape[1], 4),
                    }
            elif len(rows):  # vocabulary: every unknown id shares row 0
                collisions[f.name] = {"sample_ids": len(rows), "oov_share": round(float((rows == 0).mean()), 4)}
        self._report.collisions = collisions
        crowded = {name: c for name, c in collisions.items() if c.get("colliding_share", 0) > 0.5}
        if crowded:
            log.warning(
                "data: most ids collide in "
                + "; ".join(
                    f"{name} ({c['distinct_ids']:,} ids on {c['distinct_rows']:,} rows over the first {n:,} training rows)"
                    for name, c in crowded.items()
                )
                + ": raise their data.sparse[i].num_embeddings"
            )
        features = []
        for f in self.sparse:
            seen = np.concatenate(lengths[f.index]) if lengths[f.index] else np.zeros(0)
            pooling_factor = round(float(seen.mean()), 4) if len(seen) else 1.0
            features.append(
                SparseFeature(
                    f.name,
                    f.num_embeddings,
                    max(pooling_factor, 0.01),
                    table=f.table,
                    pooling=f.pooling,
                    weighted=f.weights_column is not None,
                )
            )
        for d in self.dense:  # encoded columns: features after data.sparse's, tables of their own
            if d.scalar:
                continue
            assert d.knots is not None  # given, or fitted at build
            two_ids = d.encoding == "piecewise_linear"  # weighted
            features.append(
                SparseFeature(
                    d.name, numeric.rows_of(d.encoding, list(d.knots)), 2.0 if two_ids else 1.0, weighted=two_ids
                )
            )
        return features

    # -- the Source contract ---------------------------------------------------------------
    def has_split(self, split: str) -> bool:
        return split in self.splits or split in self._splits

    def num_batches(self, split: str) -> int:
        """Train: full global batches (the partial last one is dropped, and counted); evaluated
        splits: every row, the last batch padded by the loader."""
        if split == "train" and self.partitioning:
            return sum(p["batches"] for p in self.partitions)
        total = self._splits[split].total
        if self.shards:  # per shard: its rows in chunks of B/S (the shortest shard bounds training)
            chunk, shortest, longest = self.batch_size // self.shards, total // self.shards, -(-total // self.shards)
            return shortest // chunk if split == "train" else -(-longest // chunk)
        return total // self.batch_size if split == "train" else -(-total // self.batch_size)

    def _spans(self, split: str, index: int, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """The split rows [a, b) that rows [lo, hi) of global batch ``index`` are, with the
        rows each range would hold before the split's end (b - a, but at the end). Without
        shards, one range. With S shards (shard s: the split's rows [s * total // S,
        (s + 1) * total // S); batch k takes its rows k*B/S .. (k+1)*B/S), one per shard the
        rank's rows cover, read in one call: a call per shard would convert every column once
        per shard, which costs more than the rows at small world sizes."""
        total = self._splits[split].total
        if not self.shards:
            return [(min(index * self.batch_size + lo, total), min(index * self.batch_size + hi, total), hi - lo)]
        chunk, out = self.batch_size // self.shards, []
        for s in range(lo // chunk, -(-hi // chunk)):
            first, end = s * total // self.shards, (s + 1) * total // self.shards
            a = first + index * chunk + max(lo - s * chunk, 0)
            b = first + index * chunk + min(hi - s * chunk, chunk)
            out.append((min(a, end), min(b, end), b - a))
        return out

    def begin_pass(self, split: str, epoch: int) -> None:
        # Count rows and bad rows on a split's first pass only (evaluations repeat; training
        # goes on into later epochs within one pass). Worker processes fork after this.
        self._counting[split] = None if split in self._counting else epoch

    def report(self) -> dict:
        return self._report.to_dict()

    def merge_report(self, part: ReadReport) -> None:
        self._report.merge(part)

    def read(self, split: str, epoch: int, index: int, lo: int, hi: int) -> Rows:
        """Rows [lo, hi) of global batch ``index``: split rows index * B + [lo, hi), fewer at
        the end of an evaluated split. The same rows every epoch (the files' order)."""
        sp = self._splits[split]
        if self.managed:
            self._local.version = self._version_of(split, index)
        # a partition's rows are counted when training reads them, not again when it is scored
        counting = self._counting.get(split, epoch) == epoch and not split.startswith(PARTITION)
        report = ReadReport() if counting else None
        if split == "train" and self.partitioning:
            rows = self._partition_rows(index, lo, hi, report)
            rows.report = report
            return rows
        spans = self._spans(split, index, lo, hi)
        if len(spans) > 1 and any(b - a < want for a, b, want in spans):
            # The end of an evaluated split, shard by shard: each shard's rows padded in place,
            # so that every row keeps its position in the global batch whoever reads it.
            rows = Rows.cat(
                [
                    self._rows(self._convert_all(list(self._ranges(split, a, b, self.columns)), report)).padded(want)
                    for a, b, want in spans
                ]
            )
        else:
            ranges = [r for a, b, _ in spans for r in self._ranges(split, a, b, self.columns)]
            rows = self._rows(self._convert_all(ranges, report))
        if counting and split == "train" and lo == 0 and index == self.num_batches(split) - 1 and not self.partitioning:
            # reported once per run: by the rank whose slice starts the batch (the report is a sum over ranks)
            assert report is not None  # counting made it
            report.dropped_tail_rows["train"] = sp.total - self.num_batches(split) * self.batch_size
        rows.report = report
        return rows

    def device_rows(self, device: torch.device) -> ParquetOnDevice:
        """The training rows converted on ``device`` (``data.device_input``; parquet/device.py)."""
        if refusal := self.device_refusal():
            raise ValueError(f"data.device_input: {refusal}")
        return ParquetOnDevice(self, device)

    def device_refusal(self) -> Optional[str]:
        """Why this log's rows are read on the CPU even on a GPU, or None."""
        return device_refusal(self.partitioning is not None, self.sparse, self.dense)

    # -- reading ---------------------------------------------------------------------------
    def _state(self) -> _Open:
        if self._open is None or self._open.pid != os.getpid():
            self._open = _Open()
        return self._open

    def _release(self) -> None:
        if self._open is not None and self._open.pid == os.getpid():
            for handle in self._open.files.values():
                handle.close()
        self._open = None

    def _ranges(self, split: str, a: int, b: int, columns: list[str]) -> Iterator[tuple[str, int, pa.Table]]:
        """Split rows [a, b) as (file, first row in it, table of ``columns``), one per row group
        range read. The decoded row groups are kept (the last few) for the next read."""
        sp = self._splits[split]
        state = self._state()
        for f, start, count in sp.pieces(a, b):
            file = sp.files[f]
            end = start + count
            g = int(np.searchsorted(file.groups, start, side="right")) - 1
            while start < end:
                group_start, group_end = int(file.groups[g]), int(file.groups[g + 1])
                take = min(end, group_end) - start
                if take > 0:
                    with state.lock:
                        table = self._group(state, file, g, columns)
                    yield file.path, start, table.slice(start - group_start, take)
                start += max(take, 0)
                g += 1

    def _group(self, state: _Open, file: _File, g: int, columns: list[str]) -> pa.Table:
        key = (file.path, g)
        cached = state.groups.get(key)
        # (the columns as a set, kept beside the table: ``column_names`` builds a new list per call)
        if cached is not None and cached[0].issuperset(columns):
            state.groups.move_to_end(key)
            return cached[1]
        handle = state.files.get(file.path)
        if handle is None:
            handle = state.files[file.path] = pq.ParquetFile(file.path)
            while len(state.files) > _OPEN_FILES * (self.shards or 1):
                state.files.popitem(last=False)[1].close()
        state.files.move_to_end(file.path)
        try:
            table = handle.read_row_group(g, columns=columns)
        except (OSError, pa.ArrowException) as e:
            raise DataError(
                f"{file.path}: row group {g} (rows {file.groups[g]}..{file.groups[g + 1] - 1}) cannot be "
                f"read: {str(e).splitlines()[0]}"
            ) from None
        state.groups[key] = (frozenset(table.column_names), table)
        # With data.shards a process reads up to S shards in turn (1 rank: all of them): room for
        # each one's groups, or the shards would evict each other's group at every batch.
        while len(state.groups) > _CACHED_GROUPS * (self.shards or 1):
            state.groups.popitem(last=False)
        return table

    def _convert_all(self, ranges: list[tuple[str, int, pa.Table]], report: Optional[ReadReport]) -> list[_Part]:
        """The ranges (file, first row, rows) converted as one table when their schemas agree:
        converting costs per column more than per row, so a slice made of several row groups,
        files or shards is converted once. Files whose schemas differ (an int32 column in one,
        int64 in another) are converted one by one."""
        if len(ranges) > 1:
            try:
                table = pa.concat_tables([t for _, _, t in ranges])
            except pa.ArrowInvalid:
                pass
            else:
                return [self._convert(table, [(f, first, t.num_rows) for f, first, t in ranges], report)]
        return [self._convert(t, [(f, first, t.num_rows)], report) for f, first, t in ranges]
