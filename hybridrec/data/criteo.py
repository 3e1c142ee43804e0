"""Criteo click logs: the TSV format and TorchRec's preprocessed binary format.

TSV rows: label, 13 integer features, 26 categorical features as hex strings (8 digits in
the real logs), tab-separated, an empty field meaning missing. Integer features become
log(x + 1) with negatives clamped to 0 (the DLRM convention); missing values are 0, as in
TorchRec's own Criteo conversion. A categorical id maps into its table by modulo or by a hash.

The TSV reader reads each file (gunzipped when its name ends in .gz) in blocks of whole
lines, parses each block with PyArrow's CSV parser and validates and converts whole columns
at a time: no Python loop over fields. Bad rows are skipped and counted
(``data.bad_rows=skip``) or stop the run (``fail``) with file:line; a line that is not
UTF-8 costs that line only. A stream that breaks (truncated gzip) keeps every complete line
before the break, and the lost rest is reported with the line it starts at.

Every rank reads the files in the same order and keeps its slice of each global batch, so
global batches do not depend on the world size. That means every rank parses every row; the
binary format reads only each rank's rows (memory-mapped ranges), which is why it is the
format for large runs.
"""

from __future__ import annotations

import glob
import gzip
import logging
import os
import zlib
from typing import Iterator, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
from torchrec.datasets.criteo import BinaryCriteoUtils
from torchrec.datasets.utils import Batch

from hybridrec.data import (
    DataError,
    ReadReport,
    SparseFeature,
    check_disjoint,
    holdout,
    make_batch,
    one_hot,
    rank_rows,
    shorten,
)

log = logging.getLogger(__name__)

INT_FEATURES, CAT_FEATURES = 13, 26
COLUMNS = ["label"] + [f"int_{i}" for i in range(INT_FEATURES)] + [f"cat_{i}" for i in range(CAT_FEATURES)]
_HEX = np.full(256, 255, dtype=np.uint8)  # byte -> nibble, 255 = not a hex digit
for _i, _c in enumerate("0123456789abcdef"):
    _HEX[ord(_c)] = _HEX[ord(_c.upper())] = _i
_NIBBLE_WEIGHTS = (np.uint64(16) ** np.arange(7, -1, -1, dtype=np.uint64)).astype(np.uint64)
_COLLISION_SAMPLE = 100_000  # rows on which table collisions are estimated
_HOLDOUT_RUN = 4096  # binary format: validation rows are held out in runs of this many rows


def resolve_paths(spec: Optional[str], key: str, pattern: str = "*") -> list[str]:
    """A file, a directory (its files matching ``pattern``, sorted) or a glob."""
    if not spec:
        raise DataError(f"{key} is not set")
    if any(ch in spec for ch in "*?["):
        paths = sorted(p for p in glob.glob(spec) if os.path.isfile(p))
    elif os.path.isdir(spec):
        paths = sorted(glob.glob(os.path.join(spec, pattern)))
    else:
        paths = [spec] if os.path.isfile(spec) else []
    if not paths:
        raise DataError(f"{key}={spec}: no such file, or no file in that directory / glob")
    return paths


def criteo_tables(num_embeddings_per_feature: list[int]) -> tuple[list[SparseFeature], np.ndarray]:
    """The 26 categorical features and their table sizes, checked."""
    if len(num_embeddings_per_feature) != CAT_FEATURES:
        raise DataError(
            f"data.num_embeddings_per_feature needs {CAT_FEATURES} sizes for Criteo, "
            f"got {len(num_embeddings_per_feature)}"
        )
    features = [SparseFeature(f"cat_{i}", int(n)) for i, n in enumerate(num_embeddings_per_feature)]
    return features, np.array(num_embeddings_per_feature, dtype=np.int64)


def map_ids(raw: np.ndarray, sizes: np.ndarray, mapping: str) -> np.ndarray:
    """Raw 32-bit ids (n, F) into table rows: ``modulo`` (TorchRec's convention) or ``hash``
    (a 64-bit mix first, so that ids differing in low bits do not collide in patterns)."""
    x = raw.astype(np.uint64)
    if mapping == "hash":  # splitmix64 finalizer
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return (x % sizes.astype(np.uint64)).astype(np.int64)


def estimate_collisions(raw: np.ndarray, mapped: np.ndarray, names: list[str]) -> dict:
    """Per table, over a sample of rows: distinct raw ids, the distinct rows they landed on,
    and the share of those ids that share their row with another id."""
    out = {}
    for f, name in enumerate(names):
        pairs = np.unique(np.stack([mapped[:, f].astype(np.int64), raw[:, f].astype(np.int64)], axis=1), axis=0)
        ids = len(pairs)
        _, per_row = np.unique(pairs[:, 0], return_counts=True)
        if ids > len(per_row):
            out[name] = {"distinct_ids": ids, "distinct_rows": len(per_row), "sample_rows": len(raw),
                         "colliding_share": round(float(per_row[per_row > 1].sum()) / ids, 4)}
    return out


def warn_collisions(collisions: dict, names: list[str], sizes: np.ndarray) -> None:
    """A table where most ids share rows has collapsed: the model cannot tell them apart."""
    bad = {name: c for name, c in collisions.items() if c["colliding_share"] > 0.5}
    if bad:
        tables = "; ".join(
            f"t_{name}: {int(sizes[names.index(name)]):,} rows for {c['distinct_ids']:,} ids, "
            f"{c['colliding_share']:.0%} share a row" for name, c in bad.items()
        )
        first = next(iter(bad.values()))["sample_rows"]
        log.warning(
            f"data: most ids collide in {len(bad)} table(s) over the first {first:,} training rows ({tables}). "
            f"Raise data.num_embeddings_per_feature at index "
            f"{', '.join(str(names.index(n)) for n in bad)}, or use data.id_mapping=hash if ids share low bits"
        )


def validation_fraction(valid_path: Optional[str], valid_fraction: float) -> float:
    if not 0 <= valid_fraction < 1:
        raise DataError(f"data.valid_fraction must be in [0, 1), got {valid_fraction}")
    if valid_path and valid_fraction:
        raise DataError("data.valid_path and data.valid_fraction are both set: choose one source of validation rows")
    return valid_fraction


class _Rechunk:
    """Re-cuts a stream of row blocks into global batches of exactly ``size`` rows."""

    def __init__(self, size: int) -> None:
        self.size, self.parts, self.rows = size, [], 0

    def push(self, arrays: tuple[np.ndarray, ...]) -> Iterator[tuple[np.ndarray, ...]]:
        self.parts.append(arrays)
        self.rows += len(arrays[0])
        while self.rows >= self.size:
            joined = tuple(np.concatenate(cols) for cols in zip(*self.parts))
            yield tuple(a[: self.size] for a in joined)
            rest = tuple(a[self.size :] for a in joined)
            self.parts, self.rows = ([rest] if len(rest[0]) else []), len(rest[0])


class CriteoTSV:
    def __init__(
        self,
        batch_size: int,
        train_path: str,
        eval_path: str,
        num_embeddings_per_feature: list[int],
        id_mapping: str,
        bad_rows: str,
        block_size_mb: int,
        eval_batches: Optional[int],
        seed: int,
        valid_path: Optional[str] = None,
        valid_fraction: float = 0.0,
    ) -> None:
        self.features, self.sizes = criteo_tables(num_embeddings_per_feature)
        self.batch_size = batch_size
        self.files = {
            "train": resolve_paths(train_path, "data.train_path"),
            "eval": resolve_paths(eval_path, "data.eval_path"),
        }
        self.seed, self.valid_fraction = seed, validation_fraction(valid_path, valid_fraction)
        if valid_path:
            self.files["valid"] = resolve_paths(valid_path, "data.valid_path")
        check_disjoint({f"data.{split}_path": paths for split, paths in self.files.items()})
        for split, paths in self.files.items():
            if all(os.path.getsize(p) == 0 for p in paths):
                raise DataError(f"data.{split}_path: every file is empty: {', '.join(paths)}")
        self.splits = ("train", "valid", "eval") if valid_path or self.valid_fraction else ("train", "eval")
        self.num_dense_features = INT_FEATURES
        self.id_mapping = getattr(id_mapping, "value", id_mapping)
        self.fail = getattr(bad_rows, "value", bad_rows) == "fail"
        self.block_size = block_size_mb * 2**20
        self.eval_batches = eval_batches
        self._report = ReadReport()
        self._counted: set[str] = set()  # splits whose files were read once: counted already

    def report(self) -> dict:
        return self._report.to_dict()

    # -- batches -----------------------------------------------------------------------
    def batches(
        self, split: str, rank: int, world_size: int, num_batches: Optional[int] = None, start: int = 0
    ) -> Iterator[Batch]:
        """Global batches ``start`` .. ``num_batches - 1`` (``start`` > 0 resumes a run: the
        batches before it are parsed, to count them exactly, but not returned).
        Train: the files in order, again and again (epochs), until ``num_batches``.
        Eval: one pass (``data.eval_batches`` caps it). A partial last global batch is
        dropped on every rank alike, and counted."""
        if num_batches is None and split != "train":
            num_batches = self.eval_batches
        rows, keys = rank_rows(self.batch_size, rank, world_size), [f.name for f in self.features]
        produced, epoch = 0, 0
        while True:
            # Count rows, bad rows and collisions on a split's first pass only: later epochs
            # and repeated evaluations read the same lines again.
            first = split not in self._counted
            chunks = _Rechunk(self.batch_size)
            for block in self._read(split, first, warn=rank == 0):
                for dense, ids, labels in chunks.push(block):
                    if produced >= start:
                        yield make_batch(dense[rows], one_hot(ids[rows]), labels[rows], keys)
                    produced += 1
                    if num_batches is not None and produced >= num_batches:
                        return
            if first:
                self._report.dropped_tail_rows[split] = chunks.rows
                self._counted.add(split)
            if produced == 0:
                raise DataError(
                    f"data.{split}_path has {chunks.rows} usable rows, fewer than one global "
                    f"batch (data.batch_size={self.batch_size})"
                )
            if split != "train":
                return
            epoch += 1

    def _read(self, split: str, count: bool, warn: bool) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        # valid_fraction: the validation rows are a seeded share of the training files' rows.
        source = "train" if split == "valid" and "valid" not in self.files else split
        held = self.valid_fraction if source == "train" else 0.0
        names, sample = [f.name for f in self.features], []
        for path in self.files[source]:
            # The training files are counted by the training pass, not again by validation.
            for dense, raw, labels, line in self._read_file(path, count and split == source):
                if held:
                    keep = holdout(self.seed, zlib.crc32(os.path.basename(path).encode()), line, held)
                    keep = keep if split == "valid" else ~keep
                    dense, raw, labels = dense[keep], raw[keep], labels[keep]
                ids = map_ids(raw, self.sizes, self.id_mapping)
                if count and split == "train" and sample is not None:
                    # The estimate grows with the sample (block by block) up to its size;
                    # the warning waits for the whole sample.
                    sample.append((raw, ids))
                    full = sum(len(r) for r, _ in sample) >= _COLLISION_SAMPLE
                    self._estimate_collisions(sample, names, warn and full)
                    sample = None if full else sample
                yield dense, ids, labels
        if sample:  # fewer training rows than the sample size
            self._estimate_collisions(sample, names, warn)

    def _estimate_collisions(self, sample: list, names: list[str], warn: bool) -> None:
        raw, ids = (np.concatenate(parts)[:_COLLISION_SAMPLE] for parts in zip(*sample))
        self._report.collisions = estimate_collisions(raw, ids, names)
        if warn:
            warn_collisions(self._report.collisions, names, self.sizes)

    # -- one file ----------------------------------------------------------------------
    def _read_file(self, path: str, count: bool) -> Iterator[tuple[np.ndarray, ...]]:
        """``read_tsv_file`` with this source's block size and bad-row mode, counting into the
        source's report (``count``) or a scratch one."""
        return read_tsv_file(path, self.block_size, self.fail, self._report if count else ReadReport())

    @staticmethod
    def _parse(text: bytes, path: str, line: int) -> tuple[pa.RecordBatch, dict[int, str]]:
        """A block of whole lines as string columns, and the in-block lines (1-based) the
        parser skipped, with the reason: a wrong number of fields, or not UTF-8."""
        errors: dict[int, str] = {}

        def wrong_field_count(row: pacsv.InvalidRow) -> str:
            if row.number not in errors:  # an undecodable line, blanked: already has its reason
                errors[row.number] = f"{row.actual_columns} fields, expected {row.expected_columns}"
            return "skip"

        def parse(data: bytes) -> pa.Table:
            return pacsv.read_csv(
                pa.py_buffer(data),
                # one parser block for the whole buffer: its rows come back in one chunk
                read_options=pacsv.ReadOptions(column_names=COLUMNS, block_size=len(data) + 1, use_threads=False),
                # an empty line is a row (of empty fields, refused by _convert): every line is
                # counted, and the parser's line numbers are the file's
                parse_options=pacsv.ParseOptions(delimiter="\t", quote_char=False, ignore_empty_lines=False,
                                                 invalid_row_handler=wrong_field_count),
                convert_options=pacsv.ConvertOptions(column_types={c: pa.string() for c in COLUMNS}),
            )

        try:
            table = parse(text)
        except pa.ArrowInvalid:
            # PyArrow refuses a whole block for one byte that is not UTF-8. Blank those lines
            # (their line numbers stay) and parse again: the slow path, on damaged blocks only.
            text, undecodable = _blank_undecodable(text)
            errors.clear()
            errors.update(undecodable)
            try:
                table = parse(text)
            except pa.ArrowInvalid as e:
                raise DataError(f"{path}:{line}: PyArrow cannot parse the block of lines from here: {e}") from None
        batches = table.combine_chunks().to_batches()
        return (batches[0] if batches else pa.RecordBatch.from_pylist([], schema=table.schema)), errors

    @staticmethod
    def _convert(block: pa.RecordBatch):
        """Validate and convert a block of string columns; returns arrays for every row, the
        mask of valid rows and a function giving the reason a row is invalid."""
        n = block.num_rows
        label = block.column("label")
        bad_label = ~np.asarray(pc.is_in(label, value_set=pa.array(["0", "1"])))
        dense = np.zeros((n, INT_FEATURES), dtype=np.int64)
        bad_int = np.zeros((n, INT_FEATURES), dtype=bool)
        for j in range(INT_FEATURES):
            col = block.column(f"int_{j}")
            try:  # fast path: the whole column is integers
                dense[:, j] = np.asarray(pc.cast(pc.if_else(pc.equal(col, ""), "0", col), pa.int64()))
            except pa.ArrowInvalid:  # find the bad cells, convert the rest
                dense[:, j], bad_int[:, j] = _integer_cells(col)
        raw = np.zeros((n, CAT_FEATURES), dtype=np.uint64)
        bad_cat = np.zeros((n, CAT_FEATURES), dtype=bool)
        for j in range(CAT_FEATURES):
            col = block.column(f"cat_{j}")
            fits = np.asarray(pc.and_(pc.less_equal(pc.binary_length(col), 8), pc.string_is_ascii(col)))
            padded = pc.utf8_lpad(pc.if_else(pa.array(fits), col, "0"), 8, "0")
            arr = padded.combine_chunks() if isinstance(padded, pa.ChunkedArray) else padded
            offsets = np.frombuffer(arr.buffers()[1], dtype=np.int32)[arr.offset : arr.offset + n + 1]
            nibbles = _HEX[np.frombuffer(arr.buffers()[2], dtype=np.uint8)[offsets[0] : offsets[-1]].reshape(n, 8)]
            bad_cat[:, j] = ~fits | (nibbles == 255).any(axis=1)
            raw[:, j] = np.where(bad_cat[:, j], 0, nibbles.astype(np.uint64) @ _NIBBLE_WEIGHTS)
        ok = ~(bad_label | bad_int.any(axis=1) | bad_cat.any(axis=1))

        def why(i: int) -> str:  # values shortened: a 3 MB field must not fill the console
            if bad_label[i] and not any(block.column(c)[i].as_py() for c in COLUMNS):
                return "empty line"
            if bad_label[i]:
                return f"label {shorten(label[i].as_py())} is not 0 or 1"
            if bad_int[i].any():
                j = int(np.argmax(bad_int[i]))
                return f"int_{j} {shorten(block.column(f'int_{j}')[i].as_py())} is not an integer"
            j = int(np.argmax(bad_cat[i]))
            return f"cat_{j} {shorten(block.column(f'cat_{j}')[i].as_py())} is not a hex id of at most 8 digits"

        features = np.log1p(np.maximum(dense, 0)).astype(np.float32)
        return features, raw, np.asarray(pc.cast(pc.if_else(pa.array(bad_label), "0", label), pa.float32())), ok, why


def read_tsv_file(path: str, block_size: int, fail: bool, report: ReadReport) -> Iterator[tuple[np.ndarray, ...]]:
    """The file's valid rows, block by block (what CriteoTSV reads and ``hybridrec.data.convert``
    writes): (dense, raw ids, labels, index), where index is each row's position among the
    file's structurally valid rows (what the validation holdout keys on: stable for a file,
    whatever the block size). Every line is counted: kept (``rows``) or bad (``bad_rows``,
    with file:line and the reason), and a broken stream's lost rest is reported as
    ``unreadable`` from the line it starts at."""
    line, index = 1, 0  # the block's first line (1-based); valid rows before it
    blocks = _line_blocks(path, block_size)
    try:
        for text in blocks:
            lines = text.count(b"\n") + (not text.endswith(b"\n"))
            block, errors = CriteoTSV._parse(text, path, line)
            # in-block line of each parsed row: the lines the parser did not skip
            rows_at = np.setdiff1d(np.arange(1, lines + 1), list(errors), assume_unique=True)
            if len(rows_at) != block.num_rows:  # PyArrow also ends a line at a lone \r
                raise DataError(f"{path}:{line}: a carriage return inside a line within the next {lines} "
                                f"lines: not a Criteo TSV (lines end with \\n)")
            ok = np.zeros(0, dtype=bool)
            if block.num_rows:  # (a block of only bad lines has none to convert)
                dense, raw, labels, ok, why = CriteoTSV._convert(block)
                errors.update((int(rows_at[i]), why(int(i))) for i in np.flatnonzero(~ok))
            for at in sorted(errors):
                if fail:
                    raise DataError(f"{path}:{line + at - 1}: {errors[at]}")
                report.bad(path, line + at - 1, errors[at])
            report.good(path, int(ok.sum()))
            if ok.any():
                yield dense[ok], raw[ok], labels[ok], index + np.flatnonzero(ok)
            line, index = line + lines, index + block.num_rows
    except _Unreadable as e:
        reason = f"{e.kind}: {e.cause}; {e.partial:,} bytes of that line read, nothing after it"
        if fail:
            raise DataError(f"{path}:{line}: unreadable from here ({reason})") from None
        report.unreadable(path, line, reason)


def _integer_cells(col: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """Each cell's int64 value (0 when empty or bad) and whether it is bad, by the rule of the
    fast path, a cast to int64: the verdict on a cell never depends on the other cells of its
    column. Cells that surely fit are converted by column; the rest that PyArrow might accept
    (19+ digits, 0x...) are cast one by one."""
    n = len(col)
    plain = np.asarray(pc.match_substring_regex(col, r"^(-?[0-9]{1,18})?$"))  # or empty
    maybe = np.asarray(pc.match_substring_regex(col, r"^-?(0[xX][0-9a-fA-F]+|[0-9]+)$")) & ~plain
    nonempty = np.asarray(pc.binary_length(col)) > 0
    values = np.asarray(pc.cast(pc.if_else(pa.array(plain & nonempty), col, "0"), pa.int64())).copy()
    good = plain.copy()
    for i in np.flatnonzero(maybe):
        try:
            values[i] = pc.cast(pa.array([col[int(i)].as_py()]), pa.int64())[0].as_py()
            good[i] = True
        except pa.ArrowInvalid:  # out of int64's range
            pass
    return values, ~good


class _Unreadable(Exception):
    """A file's stream broke after the blocks already yielded; ``partial`` bytes of the next
    line had been read."""

    def __init__(self, kind: str, cause: BaseException, partial: int) -> None:
        super().__init__(kind)
        self.kind, self.cause, self.partial = kind, cause, partial


def _line_blocks(path: str, size: int) -> Iterator[bytes]:
    """The file's text, decompressed, in blocks of whole lines of about ``size`` bytes (a
    longer line is one block). When the stream breaks (truncated or corrupt gzip, an I/O
    error), every complete line before the break is yielded, then ``_Unreadable`` raised."""
    gz = path.endswith(".gz")
    parts: list[bytes] = []
    held, error = 0, None
    # Python's gzip hands out what it decompressed before a truncation (read1: one step at a
    # time, so no read spans the break); PyArrow's stream loses its whole last read.
    with gzip.open(path, "rb") if gz else pa.input_stream(path, compression="detect") as f:
        read = f.read1 if gz else f.read
        while True:
            try:
                chunk = read(size)
            except (EOFError, OSError, zlib.error, pa.ArrowInvalid) as e:
                error = e
                break
            if not chunk:
                break
            parts.append(chunk)
            held += len(chunk)
            if held >= size and b"\n" in chunk:
                data = b"".join(parts)
                cut = data.rfind(b"\n") + 1
                yield data[:cut]
                parts, held = [data[cut:]], len(data) - cut
    data = b"".join(parts)
    cut = len(data) if error is None else data.rfind(b"\n") + 1  # at a clean end, the last line may lack its newline
    if cut:
        yield data[:cut]
    if error is not None:
        kind = ("truncated gzip" if isinstance(error, EOFError) else
                "corrupt gzip" if gz and isinstance(error, (zlib.error, gzip.BadGzipFile)) else "read error")
        raise _Unreadable(kind, error, len(data) - cut)


def _blank_undecodable(text: bytes) -> tuple[bytes, dict[int, str]]:
    """``text`` with every line that is not UTF-8 replaced by a placeholder, and those lines
    (1-based) with the reason. Replaced, not removed, so the parser's line numbers still
    match the file's."""
    lines = text.split(b"\n")
    bad = {}
    for i, line in enumerate(lines):
        try:
            line.decode("utf-8")
        except UnicodeDecodeError as e:
            bad[i + 1] = f"not UTF-8 text (byte 0x{line[e.start]:02x} at column {e.start + 1})"
            lines[i] = b"-"  # one field: the parser skips it as a row of the wrong shape
    return b"\n".join(lines), bad


class CriteoBinary:
    """TorchRec's preprocessed Criteo format: ``X_dense.npy`` (n, 13) float32, already
    log-transformed, ``X_sparse.npy`` (n, 26) raw ids, ``X_labels.npy`` (n, 1), as written by
    ``torchrec.datasets.criteo.BinaryCriteoUtils.tsv_to_npys``. Each rank reads only its own
    rows of each global batch (``BinaryCriteoUtils.load_npy_range``, memory-mapped)."""

    def __init__(
        self,
        batch_size: int,
        train_path: str,
        eval_path: str,
        num_embeddings_per_feature: list[int],
        id_mapping: str,
        eval_batches: Optional[int],
        seed: int,
        valid_path: Optional[str] = None,
        valid_fraction: float = 0.0,
    ) -> None:
        self.features, self.sizes = criteo_tables(num_embeddings_per_feature)
        self.batch_size = batch_size
        specs = {"train": train_path, "eval": eval_path, **({"valid": valid_path} if valid_path else {})}
        self.days = {split: self._days(spec, f"data.{split}_path") for split, spec in specs.items()}
        check_disjoint({f"data.{split}_path": [f"{p}_dense.npy" for p, _ in days] for split, days in self.days.items()})
        fraction = validation_fraction(valid_path, valid_fraction)
        self.splits = ("train", "valid", "eval") if valid_path or fraction else ("train", "eval")
        # Rows of each split as segments (first row, count) of its days laid end to end.
        # valid_fraction holds out a seeded share of the training rows in runs of
        # _HOLDOUT_RUN rows, so that every read stays a few contiguous memory-mapped ranges.
        self.segments = {split: [(0, sum(rows for _, rows in days))] for split, days in self.days.items()}
        if fraction:
            total = self.segments["train"][0][1]
            runs = np.arange(-(-total // _HOLDOUT_RUN))
            held = holdout(seed, 0, runs, fraction)
            self.days["valid"] = self.days["train"]
            for split, mask in (("train", ~held), ("valid", held)):
                self.segments[split] = [(int(r) * _HOLDOUT_RUN, min(_HOLDOUT_RUN, total - int(r) * _HOLDOUT_RUN))
                                        for r in runs[mask]]
        self.num_dense_features = INT_FEATURES
        self.id_mapping = getattr(id_mapping, "value", id_mapping)
        self.eval_batches = eval_batches
        self._report = ReadReport()
        for split, days in self.days.items():
            for prefix, rows in days:
                if prefix not in self._report.files:  # validation may be a share of the training files
                    self._report.good(prefix, rows)
            if sum(n for _, n in self.segments[split]) < batch_size:
                raise DataError(f"data.{split}_path has fewer rows than one global batch ({batch_size})")

    @staticmethod
    def _days(spec: str, key: str) -> list[tuple[str, int]]:
        """(prefix, rows) per day, checked: the three files exist and agree."""
        days = []
        for dense in resolve_paths(spec, key, pattern="*_dense.npy"):
            prefix = dense[: -len("_dense.npy")]
            shapes = {}
            for part, width in (("dense", INT_FEATURES), ("sparse", CAT_FEATURES), ("labels", 1)):
                path = f"{prefix}_{part}.npy"
                if not os.path.isfile(path):
                    raise DataError(f"{key}: {path} is missing (day {os.path.basename(prefix)})")
                shape = BinaryCriteoUtils.get_shape_from_npy(path)
                if len(shape) != 2 or shape[1] != width:
                    raise DataError(f"{path}: shape {shape}, expected (rows, {width})")
                shapes[part] = shape[0]
            if len(set(shapes.values())) != 1:
                raise DataError(f"{prefix}: dense, sparse and labels disagree on rows: {shapes}")
            days.append((prefix, shapes["dense"]))
        return days

    def report(self) -> dict:
        return self._report.to_dict()

    def batches(
        self, split: str, rank: int, world_size: int, num_batches: Optional[int] = None, start: int = 0
    ) -> Iterator[Batch]:
        if num_batches is None and split != "train":
            num_batches = self.eval_batches
        days, segments = self.days[split], self.segments[split]
        total = sum(n for _, n in segments)
        full = total // self.batch_size
        self._report.dropped_tail_rows[split] = total - full * self.batch_size
        rows = rank_rows(self.batch_size, rank, world_size)
        keys = [f.name for f in self.features]
        produced = start
        while True:
            for b in range(start % full if produced == start else 0, full):
                first_row = b * self.batch_size + rows.start
                dense, sparse, labels = (self._rows(days, segments, part, first_row, rows.stop - rows.start)
                                         for part in ("dense", "sparse", "labels"))
                ids = map_ids(sparse, self.sizes, self.id_mapping)
                yield make_batch(dense, one_hot(ids), labels.reshape(-1), keys)
                produced += 1
                if num_batches is not None and produced >= num_batches:
                    return
            if split != "train":
                return

    @classmethod
    def _rows(cls, days: list[tuple[str, int]], segments: list[tuple[int, int]], part: str, start: int,
              count: int) -> np.ndarray:
        """Rows [start, start + count) of a split whose rows are ``segments`` of the days."""
        out, offset = [], 0
        for first, n in segments:
            if count and start < offset + n:
                lo = max(start - offset, 0)
                take = min(n - lo, count)
                out.append(cls._range(days, part, first + lo, take))
                start, count = start + take, count - take
            offset += n
        return np.concatenate(out)

    @staticmethod
    def _range(days: list[tuple[str, int]], part: str, start: int, count: int) -> np.ndarray:
        """Rows [start, start + count) of the concatenated days, read as memory-mapped ranges."""
        out, offset = [], 0
        for prefix, rows in days:
            if count and start < offset + rows:
                lo = max(start - offset, 0)
                take = min(rows - lo, count)
                out.append(BinaryCriteoUtils.load_npy_range(f"{prefix}_{part}.npy", lo, take, mmap_mode=True))
                start, count = start + take, count - take
            offset += rows
        return np.concatenate(out)
