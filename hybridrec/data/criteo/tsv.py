"""The TSV reader (``data=criteo``): CriteoTSV, its shard readers (``_ShardReader``) and line
index, and the reading of a file in blocks of whole lines (gzip checks, a stream that
breaks, lines that are not UTF-8) parsed and validated a block at a time (``parse_block``,
``read_tsv_file``)."""

from __future__ import annotations

import os
import zlib
from typing import Iterator, Optional, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
from omegaconf import DictConfig

from hybridrec.config import BadRows, IdMapping
from hybridrec.data import (
    DataError,
    ReadReport,
    check_disjoint,
    holdout,
    portable,
    shorten,
)
from hybridrec.data.criteo.common import (
    CAT_FEATURES,
    COLUMNS,
    INT_FEATURES,
    criteo_tables,
    estimate_collisions,
    map_ids,
    resolve_paths,
    validation_fraction,
    warn_collisions,
)
from hybridrec.data.criteo.text import _blank_undecodable, _check_gzip, _line_blocks, _text_head, _Unreadable
from hybridrec.data.raw_inputs import RawInputs, dense_input, sparse_input
from hybridrec.data.source import Rows, Source, check_table_sizes

_HEX = np.full(256, 255, dtype=np.uint8)  # byte -> nibble, 255 = not a hex digit
for _i, _c in enumerate("0123456789abcdef"):
    _HEX[ord(_c)] = _HEX[ord(_c.upper())] = _i
_NIBBLE_WEIGHTS = (np.uint64(16) ** np.arange(7, -1, -1, dtype=np.uint64)).astype(np.uint64)
_COLLISION_SAMPLE = 100_000  # rows on which table collisions are estimated


class CriteoTSV(Source):
    per_rank_report = True  # each rank reads (and counts) its own shards
    sequential = True  # a shard is a stream of blocks

    @classmethod
    def check_config(cls, cfg: DictConfig, world_size: int) -> None:
        # The only check of data.shards: the source is built without the world size, and
        # only from a config that validation passed (train, evaluate and plan validate first).
        shards = cfg.shards
        if shards < 1 or shards % world_size or cfg.batch_size % shards:
            raise ValueError(
                f"data.shards={shards} must be a multiple of the world size ({world_size}) and divide "
                f"data.batch_size={cfg.batch_size}: each rank reads whole shards. Set data.shards to "
                f"a multiple of {world_size} (it changes the order of rows), or convert the logs with "
                f"`python -m hybridrec.data.convert` and use data=criteo_binary"
            )
        check_table_sizes(cfg)

    def __init__(
        self,
        batch_size: int,
        train_path: str,
        eval_path: str,
        num_embeddings_per_feature: list[int],
        id_mapping: IdMapping,
        bad_rows: BadRows,
        block_size_mb: int,
        eval_batches: Optional[int],
        seed: int,
        valid_path: Optional[str] = None,
        valid_fraction: float = 0.0,
        shards: int = 1,
    ) -> None:
        self.features, self.sizes = criteo_tables(num_embeddings_per_feature)
        self.batch_size = batch_size
        self.shards = shards
        self.files = {
            "train": resolve_paths(train_path, "data.train_path"),
            "eval": resolve_paths(eval_path, "data.eval_path"),
        }
        self.seed, self.valid_fraction = seed, validation_fraction(valid_path, valid_fraction)
        if valid_path:
            self.files["valid"] = resolve_paths(valid_path, "data.valid_path")
        check_disjoint({f"data.{split}_path": paths for split, paths in self.files.items()})
        for split, paths in self.files.items():
            for path in paths:
                _check_gzip(path)
            heads = {path: _text_head(path, f"data.{split}_path") for path in paths}
            if not any(heads.values()):
                raise DataError(
                    f"data.{split}_path: every file is empty (no text"
                    f"{', once decompressed' if any(p.endswith('.gz') for p in paths) else ''}): "
                    f"{', '.join(paths)}"
                )
        self.splits = ("train", "valid", "eval") if valid_path or self.valid_fraction else ("train", "eval")
        self.num_dense_features = INT_FEATURES
        self.id_mapping = IdMapping(id_mapping)
        self.fail = BadRows(bad_rows) == BadRows.fail
        self.block_size = block_size_mb * 2**20
        self.eval_batches = eval_batches
        self._report = ReadReport()
        self._counted: set[str] = set()  # splits whose files were read once: counted already
        self._counting: dict[str, bool] = {}  # whether this pass of a split counts its files
        self._readers: dict[tuple[str, int], _ShardReader] = {}
        self._lines = _LineIndex()

    def raw_inputs(self) -> RawInputs:
        """A raw row is a log line's fields: int_0 .. int_12 integers (missing: null), cat_0 ..
        cat_25 hex ids of at most 8 digits (missing: null or empty, id 0), converted as
        ``_convert`` and ``map_ids`` convert them."""
        dense = [
            dense_input(f"int_{j}", [{"op": "fill_null", "value": 0}, {"op": "clamp", "min": 0.0}, {"op": "log1p"}])
            for j in range(INT_FEATURES)
        ]
        function = "splitmix64" if self.id_mapping == IdMapping.hash else "none"
        sparse = [
            sparse_input(
                f.name,
                f.name,
                f.table_name,
                f.num_embeddings,
                f.pooling,
                {"kind": "hex", "function": function, "modulo": f.num_embeddings},
                "one id",
            )
            for f in self.features
        ]
        return RawInputs(
            "a Criteo line's fields: int_0 .. int_12 (integers or null) and cat_0 .. cat_25 (hex "
            "strings of at most 8 digits, null or empty for a missing one)",
            dense,
            sparse,
        )

    def report(self) -> dict:
        return self._report.to_dict()

    # -- the Source contract ---------------------------------------------------------------
    def num_batches(self, split: str) -> None:
        """Unknown: training cycles every shard on its own (nothing dropped); an evaluated
        split ends when its shards run dry."""
        return None

    def pieces(self, world_size: int) -> int:
        return self.shards // world_size

    def has_rows(self, split: str) -> bool:
        """Parse blocks, shard by shard, until one valid row (uncounted: a probe; what it
        found is kept for ``why_empty``)."""
        fail, self.fail = self.fail, False  # a probe reports nothing; the pass itself will
        self._probe = probe = ReadReport(max_errors=1)
        try:
            for shard in range(self.shards):
                for path, offset, line, text, broken in self.shard_blocks(split, shard):
                    if broken is None and len(self.parse_rows(split, path, offset, line, text, probe)[2]):
                        return True
            return False
        finally:
            self.fail = fail

    def why_empty(self, split: str) -> Optional[str]:
        """What the last ``has_rows`` probe of ``split`` found instead of a row."""
        files = self.files[self._file_split(split)]
        report = getattr(self, "_probe", None)
        bad = sum(f.bad_rows for f in report.files.values()) if report else 0
        if not bad:
            return f"no lines in {', '.join(files)}"
        assert report is not None  # (bad > 0 only with a probe's report)
        first = next(e for f in report.files.values() for e in f.errors)
        return f"every one of its {bad:,} lines is bad (the first: {first})"

    def begin_pass(self, split: str, epoch: int) -> None:
        # Count rows, bad rows and collisions on a split's first pass only: repeated
        # evaluations read the same lines again. Worker processes fork after this.
        self._counting[split] = split not in self._counted
        self._counted.add(split)
        self._readers = {key: r for key, r in self._readers.items() if key[0] != split}

    def merge_report(self, part: ReadReport) -> None:
        self._report.merge(part)

    def read(self, split: str, epoch: int, index: int, lo: int, hi: int) -> Rows:
        """Rows [index * m, (index + 1) * m) of shard ``lo // m``'s stream (m = batch_size /
        shards). A shard is read sequentially; a jump (resume) re-reads it from the start,
        parsing and counting the rows it skips."""
        m = self.batch_size // self.shards
        shard = lo // m
        if hi - lo != m or lo % m:
            raise AssertionError(f"rows [{lo}, {hi}) are not one shard's piece of {m} rows")  # a loader bug
        reader = self._readers.get((split, shard))
        if reader is None or reader.position > index * m:
            reader = self._readers[(split, shard)] = _ShardReader(self, split, shard, self._counting.get(split, True))
        if reader.position < index * m:
            reader.take(index * m - reader.position)
        dense, ids, labels = reader.take(m)
        rows = Rows.one_hot(dense, ids.T, labels)
        rows.report, reader.report = reader.report, ReadReport()
        return rows

    # -- shards ----------------------------------------------------------------------------
    def block_bytes(self, split: str) -> int:
        """Bytes per block of a split's files: about four blocks per shard for small inputs,
        data.block_size_mb for large ones. A function of the files and data.shards only, so
        the blocks, and with them the shards, are the same for every world size."""
        total = sum(os.path.getsize(p) for p in self.files[self._file_split(split)])
        return int(min(self.block_size, max(_MIN_BLOCK, -(-total // (4 * self.shards)))))

    def _file_split(self, split: str) -> str:
        """The split whose files ``split`` reads (valid_fraction: the training files)."""
        return "train" if split == "valid" and "valid" not in self.files else split

    def shard_blocks(
        self, split: str, shard: int
    ) -> Iterator[tuple[str, int, Optional[int], bytes, Optional["_Unreadable"]]]:
        """Shard ``shard``'s blocks of whole lines, in order: (path, byte offset of the block
        in the file's text, its first line or None when not known yet, text, and the error
        that broke the file's stream there, if it did: reported by that block's shard). Block j of the i-th file belongs to shard (i + j) mod shards.
        Plain files are read at the blocks' byte ranges only; a .gz file is decompressed
        whole by each of its readers (a gzip stream cannot be entered in the middle), and
        only the shard's blocks are parsed."""
        size = self.block_bytes(split)
        for i, path in enumerate(self.files[self._file_split(split)]):
            if path.endswith(".gz"):
                line, offset, j = 1, 0, 0
                blocks = _line_blocks(path, size)
                while True:
                    try:
                        text = next(blocks)
                    except StopIteration:
                        break
                    except _Unreadable as e:
                        if (i + j) % self.shards == shard:  # reported once: by the lost block's shard
                            yield path, offset, line, b"", e
                        break
                    if (i + j) % self.shards == shard:
                        yield path, offset, line, text, None
                    line += text.count(b"\n")
                    offset += len(text)
                    j += 1
                continue
            file_size = os.path.getsize(path)
            with open(path, "rb") as f:
                for j in range((shard - i) % self.shards, -(-file_size // size), self.shards):
                    begin, end = _line_start(f, j * size, file_size), _line_start(f, (j + 1) * size, file_size)
                    if end > begin:
                        f.seek(begin)
                        yield path, begin, None, f.read(end - begin), None

    def parse_rows(
        self, split: str, path: str, offset: int, line: Optional[int], text: bytes, report: ReadReport
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A block's valid rows (dense, table ids, labels), the validation holdout applied
        (a seeded hash of file and line offset), bad lines counted into ``report``."""
        first_line = (lambda: line) if line is not None else (lambda: self._lines.line_at(path, offset))
        dense, raw, labels, at = parse_block(text, path, first_line, self.fail, report)
        if self.valid_fraction and self._file_split(split) == "train":
            starts = offset + np.concatenate([[0], np.flatnonzero(np.frombuffer(text, np.uint8) == 10) + 1])
            keep = holdout(self.seed, zlib.crc32(os.path.basename(path).encode()), starts[at - 1], self.valid_fraction)
            keep = keep if split == "valid" else ~keep
            dense, raw, labels = dense[keep], raw[keep], labels[keep]
        return dense, raw, labels

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
                parse_options=pacsv.ParseOptions(
                    delimiter="\t", quote_char=False, ignore_empty_lines=False, invalid_row_handler=wrong_field_count
                ),
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

        features = portable.log1p(np.maximum(dense, 0)).astype(np.float32)
        return features, raw, np.asarray(pc.cast(pc.if_else(pa.array(bad_label), "0", label), pa.float32())), ok, why


_Columns = tuple[np.ndarray, np.ndarray, np.ndarray]
"""A block's valid rows: dense, table ids, labels."""

_MIN_BLOCK = 4096  # bytes: the smallest block, so that a tiny file still spreads over shards


class _ShardReader:
    """One shard of a split, read sequentially: ``take(n)`` gives its next n valid rows.
    Training cycles the shard for ever (its rows counted on the first cycle only); an
    evaluated split is one pass, and ``take`` comes up short at its end. What the reading
    counted accumulates in ``report`` until the caller takes it."""

    def __init__(self, source: "CriteoTSV", split: str, shard: int, count: bool) -> None:
        self.source, self.split, self.shard, self.count = source, split, shard, count
        self.position = 0  # rows handed out
        self.report = ReadReport()
        self.parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.buffered = 0
        self.sample: Optional[list[tuple[np.ndarray, np.ndarray]]] = (
            [] if count and split == "train" and shard == 0 else None
        )
        self.rows = self._rows()

    def take(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        while self.buffered < n:
            part = next(self.rows, None)
            if part is None:
                break
            self.parts.append(part)
            self.buffered += len(part[0])
        out, need = [], n
        while need and self.parts:  # views of the buffered blocks: only the n rows are copied
            head = self.parts[0]
            if len(head[0]) <= need:
                out.append(self.parts.pop(0))
                need -= len(head[0])
            else:
                out.append(cast(_Columns, tuple(a[:need] for a in head)))
                self.parts[0] = cast(_Columns, tuple(a[need:] for a in head))
                need = 0
        taken = n - need
        self.buffered -= taken
        self.position += taken
        if not out:
            return (
                np.zeros((0, INT_FEATURES), np.float32),
                np.zeros((0, CAT_FEATURES), np.int64),
                np.zeros(0, np.float32),
            )
        return cast(_Columns, tuple(np.concatenate(cols) for cols in zip(*out))) if len(out) > 1 else out[0]

    def _rows(self) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        src, cycle = self.source, 0
        while True:
            rows = blocks = 0
            # the training files are counted by the training pass, not again by validation
            count = self.count and cycle == 0 and src._file_split(self.split) == self.split
            scratch = ReadReport()  # (self.report is handed out and replaced between blocks)
            for path, offset, line, text, broken in src.shard_blocks(self.split, self.shard):
                blocks += 1
                if broken is not None:
                    reason = (
                        f"{broken.kind}: {broken.cause}; {broken.partial:,} bytes of that line read, nothing after it"
                    )
                    if src.fail:
                        raise DataError(f"{path}:{line}: unreadable from here ({reason})")
                    assert line is not None  # (only a .gz stream breaks, and its blocks' lines are counted)
                    (self.report if count else scratch).unreadable(path, line, reason)
                    continue
                dense, raw, labels = src.parse_rows(
                    self.split, path, offset, line, text, self.report if count else scratch
                )
                ids = map_ids(raw, src.sizes, src.id_mapping)
                if self.sample is not None:
                    self._sample(raw, ids)
                rows += len(labels)
                if len(labels):
                    yield dense, ids, labels
            if self.sample is not None:
                self.finish_sample()
            if self.split != "train":
                return
            m = src.batch_size // src.shards
            if rows < m:  # a global batch would hold one of the shard's rows twice
                # Say what the shard was dealt: no block at all means too few blocks for the
                # shards (a line longer than a block is one block), not too few rows.
                got = (
                    f"it was dealt none of the training files' blocks (whole lines of about "
                    f"{src.block_bytes(self.split):,} bytes; a longer line is one block)"
                    if not blocks
                    else f"its {blocks} block(s) of lines held {rows} valid rows"
                )
                raise DataError(
                    f"data.train_path has {rows} usable rows in shard {self.shard} of data.shards={src.shards}, "
                    f"fewer than its {m} rows of one global batch (data.batch_size={src.batch_size}): {got}; "
                    f"use more training rows, a smaller data.batch_size or fewer data.shards"
                )
            cycle += 1

    def _sample(self, raw: np.ndarray, ids: np.ndarray) -> None:
        """Keep the first rows of shard 0 (up to _COLLISION_SAMPLE) for the collision estimate."""
        assert self.sample is not None  # (called only while sampling)
        self.sample.append((raw, ids))
        if sum(len(r) for r, _ in self.sample) >= _COLLISION_SAMPLE:
            self.finish_sample()

    def finish_sample(self) -> None:
        """Estimate the tables' collisions on the sample (full, or all of shard 0's rows) once,
        and warn: estimating as the sample grows would sort it again at every block."""
        if self.sample is not None:
            names = [f.name for f in self.source.features]
            raw, ids = (np.concatenate(parts)[:_COLLISION_SAMPLE] for parts in zip(*self.sample))
            self.report.collisions = estimate_collisions(raw, ids, names)
            warn_collisions(self.report.collisions, names, self.source.sizes)
            self.sample = None


class _LineIndex:
    """Line numbers of byte offsets in plain files, for the bad rows of blocks read by byte
    range: the newlines before the offset are counted once, forward from the last offset
    asked (a reader moves forward), and only when a line number is needed."""

    def __init__(self) -> None:
        self.known: dict[str, tuple[int, int]] = {}  # path -> (offset, line at that offset)

    def line_at(self, path: str, offset: int) -> int:
        at, line = self.known.get(path, (0, 1))
        if offset < at:
            at, line = 0, 1
        with open(path, "rb") as f:
            f.seek(at)
            while at < offset:
                chunk = f.read(min(2**24, offset - at))
                if not chunk:
                    break
                line += chunk.count(b"\n")
                at += len(chunk)
        self.known[path] = (offset, line)
        return line


def _line_start(f, offset: int, size: int) -> int:
    """The first line start at or after ``offset`` in an open plain file of ``size`` bytes."""
    if offset <= 0:
        return 0
    if offset >= size:
        return size
    f.seek(offset - 1)
    at = offset - 1
    while True:
        chunk = f.read(65536)
        if not chunk:
            return size
        cut = chunk.find(b"\n")
        if cut >= 0:
            return at + cut + 1
        at += len(chunk)


def parse_block(
    text: bytes, path: str, first_line, fail: bool, report: ReadReport
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A block of whole lines: the valid rows' (dense, raw ids, labels) and their in-block
    line numbers (1-based). Every line is counted in ``report``: kept or bad (file:line and
    the reason; ``fail`` stops at the first). ``first_line()`` gives the block's first line
    in the file; it is asked only when a bad line needs its number."""
    lines = text.count(b"\n") + (not text.endswith(b"\n"))
    block, errors = CriteoTSV._parse(text, path, 0)
    # in-block line of each parsed row: the lines the parser did not skip
    rows_at = np.setdiff1d(np.arange(1, lines + 1), list(errors), assume_unique=True)
    if len(rows_at) != block.num_rows:  # PyArrow also ends a line at a lone \r
        raise DataError(
            f"{path}:{first_line()}: a carriage return inside a line within the next {lines} "
            f"lines: not a Criteo TSV (lines end with \\n)"
        )
    ok = np.zeros(0, dtype=bool)
    dense = raw = labels = None
    if block.num_rows:  # (a block of only bad lines has none to convert)
        dense, raw, labels, ok, why = CriteoTSV._convert(block)
        errors.update((int(rows_at[i]), why(int(i))) for i in np.flatnonzero(~ok))
    if errors:
        line = first_line()
        for at in sorted(errors):
            if fail:
                raise DataError(f"{path}:{line + at - 1}: {errors[at]}")
            report.bad(path, line + at - 1, errors[at])
    report.good(path, int(ok.sum()))
    if not ok.any():
        return (
            np.zeros((0, INT_FEATURES), np.float32),
            np.zeros((0, CAT_FEATURES), np.uint64),
            np.zeros(0, np.float32),
            np.zeros(0, np.int64),
        )
    assert dense is not None and raw is not None and labels is not None  # (some row ok: the block was converted)
    return dense[ok], raw[ok], labels[ok], rows_at[ok]


def read_tsv_file(path: str, block_size: int, fail: bool, report: ReadReport) -> Iterator[tuple[np.ndarray, ...]]:
    """The file's valid rows in order, block by block (what ``hybridrec.data.convert``
    writes): (dense, raw ids, labels, line). Every line is counted: kept (``rows``) or bad
    (``bad_rows``, with file:line and the reason), and a broken stream's lost rest is
    reported as ``unreadable`` from the line it starts at."""
    line = 1  # the block's first line (1-based)
    try:
        for text in _line_blocks(path, block_size):
            dense, raw, labels, at = parse_block(text, path, lambda: line, fail, report)
            if len(labels):
                yield dense, raw, labels, line + at - 1
            line += text.count(b"\n") + (not text.endswith(b"\n"))
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
