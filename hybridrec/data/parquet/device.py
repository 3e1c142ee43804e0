"""Parquet feature logs (``data=parquet``) converted on the training device (``data.device_input``).

The CPU does what only it can: it decodes the row groups (Arrow, cached as for ``read``) and
hands over each column's values as stored (no cast, no copy for a column without nulls), each
sparse feature's ids per row (``list_value_length``: the host needs them to size the batch
without reading the device) and, for string ids, their bytes. One copy through ``Staging``'s
reused pinned buffers takes them to the device, where the conversions run: labels (0/1 or a
threshold), sample weights, dense transforms (``log1p`` by ``portable``'s operations, so the
same bits), ids hashed (integers, and strings by ``hash_strings``' tabulation hash), mapped by
modulo, looked up in an integer vocabulary by sorted search, lists truncated, id weights.
The rows are ``ParquetSource.read``'s, byte for byte (tests/test_device_parquet.py).

Bad rows. What the host sees as it decodes (a null where a row needs a value, a list longer
than ``max_length``, weights that do not match their ids) sends that batch through
``read``, which pads and counts its bad rows as always. What only the values say (a label not
0 or 1, a dense value or weight not finite, an id outside its table) is checked on the device:
a bad row becomes padding there (dense, label and sample weight 0, its ids 0 of weight 1, its
number of ids unchanged, since the host has sized the batch), and a flag is set that the
trainer reads where it reads the losses. A set flag reads the batches since the last read
again on the CPU, whose reader names each bad row's file and row in the read report (or stops
the run with ``data.bad_rows=fail``); the report counted those rows good until then.

Read on the CPU instead (``device_refusal``): a partitioned log (``data.partitions``),
managed ids, and dense columns encoded as ids; string ids looked up in a vocabulary are
found on the CPU (their vocabulary is strings) and only their rows go to the device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Union

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from hybridrec.config.schema import ParquetIdMapping
from hybridrec.data import FileReport, ReadReport
from hybridrec.data.criteo.binary_device import _signed, splitmix64, unsigned_mod
from hybridrec.data.device_input import Staging, as_signed, gather_ranges, log1p, widen
from hybridrec.data.parquet.columns import _is_list, _kind, _plain_array
from hybridrec.data.parquet.config import _Dense, _Sparse
from hybridrec.data.parquet.hashing import _LENGTH_SALT, _STRING_SALT, _salt, string_bytes
from hybridrec.data.rows import Rows

if TYPE_CHECKING:
    from hybridrec.data.parquet.source import ParquetSource


def device_refusal(partitioned: bool, sparse: list[_Sparse], dense: list[_Dense]) -> Optional[str]:
    """Why a log's rows are read on the CPU even with data.device_input, or None: the one line
    a config that sets it is refused with (``checks.check_config``)."""
    if partitioned:
        return "a partitioned log (data.partitions) is read on the CPU, partition by partition"
    for f in sparse:
        if f.id_mapping == ParquetIdMapping.managed.value:
            return f"data.sparse[{f.index}].id_mapping=managed gives rows on the CPU, where the managed ids are kept"
    for i, d in enumerate(dense):
        if not d.scalar:
            return f"data.dense[{i}].encoding={d.encoding} makes its ids on the CPU"
    return None


def _numbers(column: pa.Array) -> Optional[np.ndarray]:
    """A numeric column's values as stored (None when it has a null: a bad row, which ``read``
    pads and counts). Booleans as bytes; decimals and uint64 as float64, the CPU's one cast."""
    if column.null_count:
        return None
    kind = _kind(column.type)
    if kind == "bool":
        return column.to_numpy(zero_copy_only=False).view(np.uint8)
    if kind == "decimal" or pa.types.is_uint64(column.type):
        return np.asarray(pc.cast(column, pa.float64()), dtype=np.float64)
    return column.to_numpy(zero_copy_only=False)


def _ints(parts: list[np.ndarray]) -> np.ndarray:
    """Integer ids of several ranges end to end; ranges of other widths as int64, uint64 by
    its bits (``pc.cast(safe=False)``, as the CPU's reader casts)."""
    if len({p.dtype for p in parts}) == 1:
        return parts[0] if len(parts) == 1 else np.concatenate(parts)
    return np.concatenate([p.view(np.int64) if p.dtype == np.uint64 else p.astype(np.int64) for p in parts])


def _cat(parts: list[np.ndarray]) -> np.ndarray:
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _rows_of(flagged: torch.Tensor, row_of: torch.Tensor, n: int) -> torch.Tensor:
    """The rows (bool [n]) holding a flagged id, without a data-dependent size (no host wait)."""
    return torch.zeros(n, dtype=torch.int32, device=flagged.device).index_add_(0, row_of, flagged.to(torch.int32)) > 0


_Handed = tuple[dict[str, np.ndarray], dict[str, np.dtype], list[tuple[str, int, pa.Table]], list["_Feature"]]


class _Feature:
    """One sparse feature's host arrays over a batch's ranges."""

    def __init__(self) -> None:
        self.lengths: list[Union[np.ndarray, int]] = []  # ids per row, after truncation; k: k rows of one id
        self.constant = False  # one id in every row: no lengths to hand over (the device's ones)
        self.one_each = False  # one id in every row, whether handed over or not
        self.total = 0  # ids in all
        self.raw: list[np.ndarray] = []  # ids per row as stored (truncated features)
        self.ids: list[np.ndarray] = []  # integer ids, or vocabulary rows of strings
        self.bytes: list[np.ndarray] = []  # string ids: their bytes ...
        self.spans: list[np.ndarray] = []  # ... and lengths
        self.weights: list[np.ndarray] = []
        self.weight_counts: list[np.ndarray] = []  # weights per row as stored (truncated features)
        self.null_rows = 0  # rows kept without ids (null_ids=empty)


class ParquetOnDevice:
    """``source.read``'s training rows, converted on ``device``: call it as
    ``(split, index, lo, hi, epoch)``; ``check()`` reads the device checks' flag."""

    def __init__(self, source: "ParquetSource", device: torch.device) -> None:
        self.source, self.device = source, torch.device(device)
        self.staging = Staging(self.device)
        self.ones: Optional[torch.Tensor] = None
        self.flag = torch.zeros((), dtype=torch.bool, device=self.device)
        self.pending: list[tuple[str, int, int, int, int, Optional[ReadReport]]] = []
        salt = int(_salt(source.hash_seed))
        self.salt = _signed(salt)
        self.string_salt = _signed((salt + int(_STRING_SALT)) % 2**64)
        self.length_salt = _signed((salt + int(_LENGTH_SALT)) % 2**64)
        self.vocab: dict[int, tuple[torch.Tensor, torch.Tensor]] = {
            i: (torch.from_numpy(v.keys.copy()).to(self.device), torch.from_numpy(v.order.copy()).to(self.device))
            for i, v in source.vocabularies.items()
            if v.kind == "int"
        }
        self.sizes = {f.index: torch.tensor(f.num_embeddings, device=self.device) for f in source.sparse}

    # -- the host's part ---------------------------------------------------------------------
    def _host(self, tables: list[pa.Table]) -> Optional[tuple[dict[str, np.ndarray], list[_Feature]]]:
        """The batch's arrays as the files store them, or None when the host sees a bad row."""
        src = self.source
        numbers: dict[str, list[np.ndarray]] = {}
        features = [_Feature() for _ in src.sparse]
        named = [("label", src.label_column)] + ([("weight", src.weight_column)] if src.weight_column else [])
        named += [(f"dense{j}", d.column) for j, d in enumerate(src.dense)]
        for table in tables:
            for name, column in named:
                values = _numbers(_plain_array(table.column(column)))
                if values is None:
                    return None
                numbers.setdefault(name, []).append(values)
            for f, host in zip(src.sparse, features):
                if not self._sparse(f, table, host):
                    return None
        return {name: _cat(parts) for name, parts in numbers.items()}, features

    def _sparse(self, f: _Sparse, table: pa.Table, host: _Feature) -> bool:
        """Feature ``f``'s arrays of one range into ``host``; False when the host sees a bad row."""
        column = _plain_array(table.column(f.column))
        listed = _is_list(column.type)
        if listed:
            lengths = pc.list_value_length(column)
            lengths = np.asarray(pc.fill_null(lengths, 0) if lengths.null_count else lengths, dtype=np.int64)
            flat = _plain_array(pc.list_flatten(column))
            if flat.null_count:  # a null id in a list
                return False
            cap = f.max_length if f.truncate else None  # (truncate comes with max_length: check_config)
            kept = np.minimum(lengths, cap) if cap is not None else lengths
            if f.max_length is not None and not f.truncate and bool((lengths > f.max_length).any()):
                return False
        else:
            if column.null_count and f.null_ids == "bad":
                return False
            nulls = np.asarray(column.is_null()) if column.null_count else None
            lengths = kept = (~nulls).astype(np.int64) if nulls is not None else None
            flat = pc.drop_null(column) if nulls is not None else column
            host.null_rows += 0 if nulls is None else int(nulls.sum())
        host.lengths.append(kept if kept is not None else len(column))
        if lengths is not None:
            host.raw.append(lengths)
        if _kind(flat.type) == "int":
            host.ids.append(flat.to_numpy(zero_copy_only=False))
        elif f.id_mapping == ParquetIdMapping.vocabulary.value:  # strings: looked up on the CPU
            host.ids.append(self.source.vocabularies[f.index].rows(flat))
        else:
            body, spans = string_bytes(flat)
            host.bytes.append(body)
            host.spans.append(spans)
        if f.weights_column:
            w = _plain_array(table.column(f.weights_column))
            if listed:
                counts = pc.list_value_length(w)
                counts = np.asarray(pc.fill_null(counts, 0) if counts.null_count else counts, dtype=np.int64)
                values = _numbers(_plain_array(pc.list_flatten(w)))
                if values is None or not np.array_equal(np.minimum(counts, cap) if cap is not None else counts, kept):
                    return False
                host.weight_counts.append(counts)
            else:
                has_id = np.ones(len(w), bool) if lengths is None else lengths == 1
                if w.null_count and bool(np.asarray(w.is_null())[has_id].any()):
                    return False  # a null weight where the row has an id
                values = _numbers(pc.fill_null(w, 0) if w.null_count else w)
                assert values is not None  # (nulls filled)
                values = values if lengths is None else values[has_id]
            host.weights.append(values)
        return True

    # -- the device's part -------------------------------------------------------------------
    def __call__(self, split: str, index: int, lo: int, hi: int, epoch: int = 0) -> Rows:
        src = self.source
        counting = src._counting.get(split, epoch) == epoch
        handed = self.host_part(split, index, lo, hi)
        if handed is None:  # a bad row the host saw: read's rows (padded and counted), moved over
            return self._moved(src.read(split, epoch, index, lo, hi))
        arrays, kinds, ranges, features = handed
        names = list(arrays)
        on = dict(zip(names, self.staging.put([arrays[k] for k in names])))
        rows, bad = self._convert(on, kinds, features)
        self.flag |= bad.any()
        report = self._counted(split, index, lo, ranges, features) if counting else None
        self.pending.append((split, epoch, index, lo, hi, report))
        rows.report = report
        return rows

    def host_part(self, split: str, index: int, lo: int, hi: int) -> Optional[_Handed]:
        """What the host does for a batch: the arrays it hands over (by name), the dtypes the
        files store them in, the ranges read and each feature's host arrays; None when it sees
        a bad row (``benchmarks/device_host.py`` times it against ``read``)."""
        src = self.source
        ranges = [r for a, b, _ in src._spans(split, index, lo, hi) for r in src._ranges(split, a, b, src.columns)]
        host = self._host([t for _, _, t in ranges])
        if host is None:
            return None
        numbers, features = host
        stored = dict(numbers)  # what the host hands over, by name, in the dtypes the files store
        for i, h in enumerate(features):
            if h.ids:
                stored[f"ids{i}"] = _ints(h.ids)
            if h.weights:
                stored[f"w{i}"] = _cat(h.weights)
        kinds = {k: v.dtype for k, v in stored.items()}
        arrays = {k: as_signed(v) for k, v in stored.items()}
        for i, h in enumerate(features):
            if h.bytes:
                arrays[f"bytes{i}"], arrays[f"spans{i}"] = _cat(h.bytes), _cat(h.spans)
            h.constant = all(isinstance(k, int) for k in h.lengths)
            if h.constant:
                h.one_each, h.total = True, sum(int(k) for k in h.lengths)
            else:
                length = _cat([np.ones(k, np.int64) if isinstance(k, int) else k for k in h.lengths])
                h.one_each, h.total = bool((length == 1).all()), int(length.sum())
                arrays[f"len{i}"] = length
            if src.sparse[i].truncate:
                arrays[f"raw{i}"] = _cat(h.raw)
                if h.weight_counts:
                    arrays[f"wraw{i}"] = _cat(h.weight_counts)
        return arrays, kinds, ranges, features

    def _ones(self, n: int) -> torch.Tensor:
        """int64 ones: the lengths of a feature with one id in every row, made once per size
        on the device instead of handed over every batch."""
        if self.ones is None or len(self.ones) != n:
            self.ones = torch.ones(n, dtype=torch.int64, device=self.device)
        return self.ones

    def _number(self, t: torch.Tensor, stored: np.dtype) -> torch.Tensor:
        """float64 of a column's values (``_floats`` on the CPU: pc.cast to float64)."""
        return widen(t, stored).to(torch.float64) if stored.kind in "iub" else t.to(torch.float64)

    def _convert(
        self,
        on: dict[str, torch.Tensor],
        kinds: dict[str, np.dtype],
        features: list[_Feature],
    ) -> tuple[Rows, torch.Tensor]:
        src = self.source
        x = self._number(on["label"], kinds["label"])
        n = len(x)
        if src.threshold_value is None:
            bad = (x != 0) & (x != 1)
            labels = torch.where(bad, 0.0, x).to(torch.float32)
        else:
            bad = torch.isnan(x)
            labels = (x > src.threshold_value).to(torch.float32)
        weights = torch.ones(n, dtype=torch.float32, device=self.device)
        if src.weight_column:
            w = self._number(on["weight"], kinds["weight"])
            wrong = ~(torch.isfinite(w) & (w >= 0))
            bad = bad | wrong
            weights = torch.where(wrong, 0.0, w).to(torch.float32)
        columns = []
        for j, d in enumerate(src.dense):
            v = self._number(on[f"dense{j}"], kinds[f"dense{j}"])
            if d.transform == "log1p":
                y = log1p(torch.clamp(v, min=0.0))
            elif d.transform == "standardize":
                assert d.mean is not None and d.std is not None  # fitted at build
                y = (v - d.mean) / d.std
            else:
                y = v
            y = y.to(torch.float32)
            wrong = ~torch.isfinite(v) | ~torch.isfinite(y)
            bad = bad | wrong
            columns.append(torch.where(wrong, 0.0, y))
        dense = torch.stack(columns, 1) if columns else torch.zeros((n, 0), dtype=torch.float32, device=self.device)
        ids, weights_of, totals = [], [], []
        rows_n = torch.arange(n, device=self.device)
        for i, f in enumerate(src.sparse):
            total = features[i].total
            length = self._ones(n) if features[i].constant else on[f"len{i}"]
            values, id_w, outside = self._ids(f, on, kinds, length, total)
            row_of = rows_n if features[i].constant else torch.repeat_interleave(rows_n, length, output_size=total)
            if outside is not None:
                bad = bad | _rows_of(outside, row_of, n)
            if id_w is not None:
                nonfinite = ~torch.isfinite(id_w)
                bad = bad | _rows_of(nonfinite, row_of, n)
                id_w = torch.where(nonfinite, 1.0, id_w).to(torch.float32)
            ids.append((values, row_of))
            weights_of.append(id_w)
            totals.append(total)
        # padding: a bad row weighs nothing and looks up row 0, as read's padding does
        dense = torch.where(bad[:, None], 0.0, dense)
        labels = torch.where(bad, 0.0, labels)
        weights = torch.where(bad, 0.0, weights)
        padded = [torch.where(bad[row_of], 0, values) for values, row_of in ids]
        id_weights = None
        if src.weighted:  # every feature's, 1.0 for an unweighted one's ids
            id_weights = torch.cat(
                [
                    torch.ones(t, dtype=torch.float32, device=self.device)
                    if w is None
                    else torch.where(bad[row_of], 1.0, w)
                    for w, t, (_, row_of) in zip(weights_of, totals, ids)
                ]
            )
        one_hot = not src.weighted and all(h.one_each for h in features)
        values = torch.cat(padded) if padded else torch.zeros(0, dtype=torch.int64, device=self.device)
        rows = Rows(
            dense.contiguous(),
            values,
            None
            if one_hot
            else torch.stack([self._ones(n) if h.constant else on[f"len{i}"] for i, h in enumerate(features)]).to(
                torch.int32
            ),
            labels,
            len(src.sparse),
            {"weights": weights},
            id_weights=id_weights,
            totals=totals,
        )
        return rows, bad

    def _ids(
        self, f: _Sparse, on: dict[str, torch.Tensor], kinds: dict[str, np.dtype], length: torch.Tensor, total: int
    ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Feature ``f``'s table rows, id weights (float64, or None) and the ids outside their
        table (id_mapping=none), for the ids each row keeps."""
        i = f.index

        def kept(values: torch.Tensor, raw: str) -> torch.Tensor:
            """The first ``length`` of each row's stored ``raw`` ids (truncated lists)."""
            if not f.truncate:
                return values
            stored = on[raw]
            return gather_ranges(values, torch.cumsum(stored, 0) - stored, length, total)

        wrong = None
        if f"bytes{i}" in on:  # strings: hash_strings' tabulation hash, then the modulo
            values = unsigned_mod(kept(self._string_keys(on[f"bytes{i}"], on[f"spans{i}"]), f"raw{i}"), self.sizes[i])
        else:
            raw = kept(widen(on[f"ids{i}"], kinds[f"ids{i}"]), f"raw{i}")
            values = raw  # id_mapping=vocabulary of strings: their rows, found on the CPU
            if f.id_mapping == ParquetIdMapping.none.value:
                wrong = (raw < 0) | (raw >= f.num_embeddings)
                values = torch.where(wrong, 0, raw)
            elif f.id_mapping == ParquetIdMapping.hash.value:
                values = unsigned_mod(splitmix64(raw + self.salt), self.sizes[i])
            elif i in self.vocab:  # integers: sorted search of the vocabulary's keys
                keys, order = self.vocab[i]
                if len(keys):
                    at = torch.clamp(torch.searchsorted(keys, raw), max=len(keys) - 1)
                    values = torch.where(keys[at] == raw, order[at] + 1, 0)
                else:
                    values = torch.zeros_like(raw)
        w = kept(self._number(on[f"w{i}"], kinds[f"w{i}"]), f"wraw{i}") if f"w{i}" in on else None
        return values, w, wrong

    def _string_keys(self, body: torch.Tensor, spans: torch.Tensor) -> torch.Tensor:
        """``hash_strings`` of the strings laid end to end in ``body`` (uint8), ``spans`` long:
        each (position, byte) mixed on its own, the mixes summed per string (int64 sums wrap
        as uint64's), then mixed with the length."""
        k = len(spans)
        string_of = torch.repeat_interleave(torch.arange(k, device=self.device), spans, output_size=len(body))
        position = torch.arange(len(body), device=self.device) - (torch.cumsum(spans, 0) - spans)[string_of]
        mixed = splitmix64(((position << 8) | body.to(torch.int64)) + self.string_salt)
        sums = torch.zeros(k, dtype=torch.int64, device=self.device).index_add_(0, string_of, mixed)
        return splitmix64(sums ^ splitmix64(spans + self.length_salt))

    # -- counting and checking ---------------------------------------------------------------
    def _counted(
        self, split: str, index: int, lo: int, ranges: list[tuple[str, int, pa.Table]], features: list[_Feature]
    ) -> ReadReport:
        """What ``read`` counts of these rows when none is bad (``check`` corrects it if some were)."""
        src = self.source
        report = ReadReport()
        for path, _, table in ranges:
            report.good(path, table.num_rows)
        for f, h in zip(src.sparse, features):
            if h.null_rows:
                report.null_ids[f"{f.column} (data.sparse[{f.index}])"] = h.null_rows
        if split == "train" and lo == 0 and index == src.num_batches(split) - 1:
            report.dropped_tail_rows["train"] = src._splits[split].total - src.num_batches(split) * src.batch_size
        return report

    def check(self) -> None:
        """Read the flag (the one host-device synchronization); when a batch since the last
        check had a bad row, read those batches again on the CPU: with data.bad_rows=fail its
        reader stops the run naming the file and row; else its report replaces what these
        batches counted."""
        if not self.pending:
            return
        if bool(self.flag):
            found = 0
            for split, epoch, index, lo, hi, counted in self.pending:
                rows = self.source.read(split, epoch, index, lo, hi)  # raises with data.bad_rows=fail
                found += int((~rows.real_mask()).sum())
                if rows.report is not None and counted is not None:
                    self.source.merge_report(_less(rows.report, counted))
            if not found:
                raise AssertionError(f"the device flagged a bad row the CPU's reader accepts, in {self.pending}")
            self.flag.zero_()
        self.pending.clear()

    def _moved(self, rows: Rows) -> Rows:
        """Rows read on the CPU, on the device (a batch with a bad row the host saw)."""
        totals = rows.feature_totals().tolist()
        to = lambda t: t.to(self.device)
        maybe = lambda t: None if t is None else to(t)
        extra = {k: to(v) for k, v in rows.extra.items()}
        moved = Rows(to(rows.dense), to(rows.values), maybe(rows.lengths), to(rows.labels), rows.features, extra)
        moved.real, moved.report, moved.id_weights, moved.totals = (
            maybe(rows.real),
            rows.report,
            maybe(rows.id_weights),
            totals,
        )
        return moved


def _less(actual: ReadReport, counted: ReadReport) -> ReadReport:
    """``actual`` less ``counted``: merged, it turns what was counted into what was read."""
    out = ReadReport(files={}, dropped_tail_rows={}, collisions={}, null_ids={})
    out.merge(actual)
    for path, f in counted.files.items():
        out.files.setdefault(path, FileReport()).rows -= f.rows
    for column, rows in counted.null_ids.items():
        out.null_ids[column] = out.null_ids.get(column, 0) - rows
    for split, rows in counted.dropped_tail_rows.items():
        out.dropped_tail_rows[split] = out.dropped_tail_rows.get(split, 0) - rows
    return out
