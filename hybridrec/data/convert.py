"""``python -m hybridrec.data.convert``: Criteo TSV to the binary layout ``data=criteo_binary``
reads, or Criteo TSV or that binary layout to Parquet for ``data=parquet``.

    python -m hybridrec.data.convert 'logs/day_*.gz' --out npy/ --workers 4
    python -m hybridrec.data.convert 'logs/day_*.gz' --out pq/ --format parquet
    python -m hybridrec.data.convert npy/ --out pq/ --format parquet

INPUT is a file, a directory or a glob of Criteo TSV, plain or gzip. Each input file becomes
three files in ``--out``, named after the file (``day_0.gz`` -> ``day_0_*.npy``), in TorchRec's
layout (``BinaryCriteoUtils.tsv_to_npys``):

- ``<stem>_dense.npy``  (n, 13) float32: log(x + 1), negatives clamped to 0, as the TSV reader
  computes it (TorchRec's own conversion shifts by the minimum instead);
- ``<stem>_sparse.npy`` (n, 26) int64: the raw 32-bit ids, mapped into the tables at training
  time (``data.id_mapping``), so one conversion serves any table sizes;
- ``<stem>_labels.npy`` (n, 1) int32.

Rows are parsed and validated by the TSV reader's own code (``criteo.read_tsv_file``): the
converted rows are the rows ``data=criteo`` trains on, in the same order, and bad rows are
skipped and counted the same way (``--bad-rows fail``: the first one stops the conversion,
with file:line). Files are converted in parallel, one per worker process. Each .npy is written
under a temporary name and renamed once complete, so an interrupted conversion leaves no file
that looks complete. ``<out>/convert_report.json`` holds rows, bad rows (the first few with
file:line), and where a broken file (a truncated gzip) stopped being readable.

``--format parquet`` writes ``<stem>.parquet`` per input file (TSV, or a day of the .npy
layout: ``npy/`` or ``'npy/day_*_dense.npy'``), one column per field, in row groups of
``--row-group-size`` rows:

- ``label`` int8 0/1;
- ``I1`` .. ``I13`` float32: the values the model sees, log(x + 1) with negatives clamped to
  0, as ``data=criteo`` computes them (the .npy layout holds them already; the raw counts are
  gone there), so the data config reads them with ``transform: none``;
- ``C1`` .. ``C26`` int64: table rows, mapped with ``--id-mapping`` into the tables of
  ``--num-embeddings`` as ``data=criteo`` maps them at training time, so the data config
  reads them with ``id_mapping: none``.

Beside them, ``<out>/conf/data/<--config-name>.yaml`` is the ``data=parquet`` config of those
columns (features ``cat_0`` .. ``cat_25``, the names of ``data=criteo``'s tables, so that both
sources build the same model). Train on the converted files (here days 0..9, day 23 for the
test) with

    python -m hybridrec.train --config-dir pq/conf +experiment=ctr data=criteo_parquet \
        data.train_path='pq/day_[0-9].parquet' data.eval_path=pq/day_23.parquet

(``--config-dir`` adds ``pq/conf`` to Hydra's config search path, where ``data/`` is one more
place the data options are found; it goes before the overrides, which Hydra's command line
takes as one run of arguments. ``hydra.searchpath=[file:///abs/pq/conf]``, an override, does
the same.)

Rows of a .npy input are checked as ``data=criteo_binary`` checks them (label 0 or 1, finite
dense values, non-negative ids), and a bad row is skipped and counted (``--bad-rows fail``:
the first one stops the conversion, with file and row).
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import multiprocessing as mp
import os
import signal
import sys
import time
import zlib
from typing import Any, Callable, Iterator, NoReturn, Optional

import numpy as np
from tqdm import tqdm

from hybridrec.base.atomic import replace_file
from hybridrec.config import IdMapping
from hybridrec.data import DataError, FileReport, ReadReport
from hybridrec.data.convert_writers import (
    DENSE_COLUMNS,
    NPY,
    PARQUET_SCHEMA,
    PARTS,
    ROW_GROUP_SIZE,
    SPARSE_COLUMNS,
    Refused,
    Target,
    _NpyWriter,
    _ParquetWriter,
    check_config,
    config_path,
    data_config,
    outputs,
    remove_partial,
    write_config,
    write_text,
)
from hybridrec.data.criteo import CAT_FEATURES, COLUMNS, INT_FEATURES, CriteoBinary, read_tsv_file, resolve_paths

# The output writers live in convert_writers; their names are this module's too.
__all__ = [
    "CONFIG_NAME",
    "DENSE_COLUMNS",
    "NPY",
    "PARQUET_SCHEMA",
    "PARTS",
    "REPORT",
    "ROW_GROUP_SIZE",
    "SPARSE_COLUMNS",
    "Refused",
    "Target",
    "check_config",
    "check_tsv",
    "config_path",
    "convert_file",
    "data_config",
    "main",
    "npy_days",
    "outputs",
    "parse_args",
    "plan",
    "read_npy_day",
    "remove_partial",
    "run",
    "stem",
    "write_config",
    "write_report",
]

REPORT = "convert_report.json"
_SNIFF_BYTES = 1 << 16
_DENSE = "_dense.npy"
_NPY_ROW_BYTES = 4 * INT_FEATURES + 8 * CAT_FEATURES + 4  # a row of the .npy layout, read per block
CONFIG_NAME = "criteo_parquet"


# -- one file ----------------------------------------------------------------------------
def read_npy_day(
    dense_path: str, block_size: int, fail: bool, report: ReadReport
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """A day of the .npy layout (named by its ``_dense.npy``) in blocks of rows: (dense as
    float32, raw ids, labels as float32), the types CriteoBinary gives the model. Rows are
    checked as CriteoBinary checks them; a bad row is skipped and counted under
    ``dense_path`` with its row (0-based, as NumPy indexes), or (``fail``) stops the
    conversion."""
    prefix = dense_path[: -len(_DENSE)]
    parts = {part: np.load(f"{prefix}_{part}.npy", mmap_mode="r") for part in ("dense", "sparse", "labels")}
    total = len(parts["dense"])
    step = max(1, block_size // _NPY_ROW_BYTES)
    report.good(dense_path, 0)  # an entry even for a day of no rows
    for lo in range(0, total, step):
        dense = np.asarray(parts["dense"][lo : lo + step], dtype=np.float32)
        raw = np.asarray(parts["sparse"][lo : lo + step])
        labels = np.asarray(parts["labels"][lo : lo + step]).reshape(-1)
        # (name, bad-row mask, reason of row i); Any: numpy's stubs type the masks as maybe scalars
        checks: tuple[tuple[str, Any, Callable[[Any], str]], ...] = (
            ("labels", (labels != 0) & (labels != 1), lambda i: f"label {labels[i]:g} is not 0 or 1"),
            (
                "dense",
                ~np.isfinite(dense).all(axis=1),
                lambda i: f"dense value {dense[i][~np.isfinite(dense[i])][0]} is not finite",
            ),
            (
                "sparse",
                (raw < 0).any(axis=1) if raw.dtype.kind == "i" else np.zeros(len(raw), bool),
                lambda i: f"id {raw[i][raw[i] < 0][0]} is negative",
            ),
        )
        ok = ~np.any([bad for _, bad, _ in checks], axis=0)
        for i in np.flatnonzero(~ok):  # in row order, each row with its first fault
            part, _, why = next(c for c in checks if c[1][i])
            if fail:
                raise DataError(f"{prefix}_{part}.npy row {lo + i}: {why(i)}")
            report.bad(dense_path, lo + int(i), f"{part}: {why(i)}")
        report.good(dense_path, int(ok.sum()))
        yield dense[ok], raw[ok], labels[ok].astype(np.float32)


def convert_file(
    path: str,
    prefix: str,
    block_size: int,
    fail: bool,
    progress: Callable[[int], None] = lambda rows: None,
    target: Target = NPY,
) -> dict[str, Any]:
    """``path`` (Criteo TSV, or a day of the .npy layout named by its ``_dense.npy``) into
    ``outputs(prefix, target)``; returns the file's report (rows, bad_rows, errors,
    unreadable). A DataError (``fail``: the first bad row) leaves no output file."""
    report = ReadReport()
    writers: list[Any] = []
    if path.endswith(_DENSE):
        rows = read_npy_day(path, block_size, fail, report)
    else:
        rows = ((dense, raw, labels) for dense, raw, labels, _ in read_tsv_file(path, block_size, fail, report))
    try:
        if target.format == "parquet":
            writers.append(_ParquetWriter(outputs(prefix, target)[0], target))
        else:
            for (_part, dtype, width), name in zip(PARTS, outputs(prefix)):
                writers.append(_NpyWriter(name, dtype, width))
        for dense, raw, labels in rows:
            if target.format == "parquet":
                writers[0].append(dense, raw, labels)
            else:
                for writer, block in zip(writers, (dense, raw, labels)):
                    writer.append(block)
            progress(len(labels))
        for writer in writers:
            writer.finish()
    except BaseException:
        for writer in writers:
            writer.discard()
        raise
    # Dense last: CriteoBinary finds a day by its _dense.npy, so no day ever shows with a
    # part missing, even if the conversion stops between two renames.
    for writer in writers[1:] + writers[:1]:
        writer.commit()
    return vars(report.files.get(path, FileReport()))  # (an empty file has no entry)


_rows_done: Optional[Any] = None  # a worker's shared row counter (a multiprocessing Value)


def _worker_context() -> Any:
    """Where the workers come from: forked from a server process that imported this module
    once ("forkserver", preloaded), so no worker imports torch again (seconds each). Not
    forked from this process: it runs threads (tqdm's monitor; a test runner's or an
    embedding application's), and a child forked while one of them holds a lock waits on
    it forever."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    mp.set_forkserver_preload([__name__])  # no effect once this process's server runs
    return mp.get_context("forkserver")


def _init_worker(rows_done: Any) -> None:
    global _rows_done
    _rows_done = rows_done
    # Ctrl-C is the main process's to handle: it stops the workers and removes their partial
    # files (a worker would only die with a traceback of its own).
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _count(rows: int) -> None:
    assert _rows_done is not None  # (set by _init_worker in every worker)
    with _rows_done.get_lock():
        _rows_done.value += rows


def _convert_in_worker(path: str, prefix: str, block_size: int, fail: bool, target: Target) -> dict[str, Any]:
    return convert_file(path, prefix, block_size, fail, _count, target)


# -- the inputs, checked -----------------------------------------------------------------
def stem(path: str) -> str:
    """``day_0.gz`` / ``day_0`` / ``train.txt`` / ``a.tsv.gz`` -> ``day_0`` / ``day_0`` / ``train`` / ``a``."""
    name = os.path.basename(path)
    name = name[: -len(".gz")] if name.endswith(".gz") else name
    for ext in (".tsv", ".txt"):
        if name.endswith(ext) and len(name) > len(ext):
            return name[: -len(ext)]
    return name


def check_tsv(path: str) -> None:
    """Refuse a file that is not Criteo TSV text: not gzip although named .gz, binary, or none
    of its first lines has the 40 tab-separated fields. Only the start is looked at: bad
    rows further on are the reader's to count, as in training."""
    try:
        with gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb") as f:
            head = f.read(_SNIFF_BYTES)
    except gzip.BadGzipFile as e:
        raise Refused(f"{path}: named .gz but not gzip ({e})") from None
    except (EOFError, zlib.error):
        return  # a damaged gzip: converted up to the break and reported, as training reads it
    except OSError as e:
        raise Refused(f"{path}: cannot read it ({e.strerror or e})") from None
    lines = head.split(b"\n")
    if len(head) == _SNIFF_BYTES:
        lines = lines[:-1]  # the last line may be cut short
    if not head or not lines:  # empty (no rows, as the reader sees it), or a first line > 64 KiB
        return
    if b"\0" in head or not any(line.count(b"\t") == len(COLUMNS) - 1 for line in lines):
        hint = " (gzip data: name it .gz)" if head.startswith(b"\x1f\x8b") else ""
        raise Refused(
            f"{path}: not a Criteo TSV: no line of {len(COLUMNS)} tab-separated fields in its "
            f"first {len(head):,} bytes{hint}"
        )


def npy_days(spec: str) -> Optional[list[str]]:
    """The ``_dense.npy`` files of the days INPUT names when it names the .npy layout (a
    directory holding ``*_dense.npy``, or files and globs of the layout's parts), else None:
    INPUT is TSV."""
    if os.path.isdir(spec):
        return sorted(glob.glob(os.path.join(glob.escape(spec), "*" + _DENSE))) or None
    try:
        paths = resolve_paths(spec, "INPUT")
    except DataError:
        return None  # the TSV check names the missing input
    days = [p for p in paths if p.endswith(_DENSE)]
    if not days:
        return None
    other = [p for p in paths if not p.endswith((_DENSE, "_sparse.npy", "_labels.npy"))]
    if other:
        raise Refused(
            f"INPUT {spec} names days of the .npy layout ({days[0]}) and {other[0]}, which is not "
            f"one: convert TSV and .npy days separately"
        )
    return days


def plan(spec: str, out: str, overwrite: bool, target: Target = NPY) -> list[tuple[str, str]]:
    """(input file, output prefix) per file, or Refused."""
    days = npy_days(spec)
    if days is not None:
        if target.format != "parquet":
            raise Refused(f"INPUT {spec} is the .npy layout already: --format parquet converts it to Parquet")
        for dense in days:
            try:
                CriteoBinary._days(dense, "INPUT")  # the three parts exist, agree and have usable dtypes
            except DataError as e:
                raise Refused(str(e)) from None
        paths, names = days, [os.path.basename(p)[: -len(_DENSE)] for p in days]
    else:
        try:
            paths = resolve_paths(spec, "INPUT")
        except DataError as e:
            raise Refused(str(e)) from None
        names = [stem(p) for p in paths]
    if os.path.exists(out) and not os.path.isdir(out):
        raise Refused(f"--out {out}: exists and is not a directory")
    seen: dict[str, str]
    jobs, seen = [], {}
    for path, name in zip(paths, names):
        if name in seen:
            raise Refused(
                f"{seen[name]} and {path} would both be written to "
                f"{os.path.join(out, name)}{'.parquet' if target.format == 'parquet' else '_*.npy'}"
            )
        seen[name] = path
        if days is None:
            check_tsv(path)
        jobs.append((path, os.path.join(out, name)))
    existing = [p for _, prefix in jobs for p in outputs(prefix, target) if os.path.exists(p)]
    if existing and not overwrite:
        more = f" (and {len(existing) - 1} more output files)" if len(existing) > 1 else ""
        raise Refused(f"{existing[0]} exists{more}: pass --overwrite to replace")
    return jobs


# -- running -----------------------------------------------------------------------------
def run(
    jobs: list[tuple[str, str]], workers: int, block_size: int, fail: bool, done: dict[str, dict], target: Target = NPY
) -> None:
    """Convert every job, filling ``done`` (input -> report) as files complete. On an error
    (``fail``: a bad row) the other files stop at once and leave no partial file."""
    bar = tqdm(desc="convert", unit=" rows", unit_scale=True, disable=None, file=sys.stderr)
    bar.set_postfix_str(f"files 0/{len(jobs)}")
    try:
        if workers == 1:
            for path, prefix in jobs:
                done[path] = convert_file(path, prefix, block_size, fail, bar.update, target)
                bar.set_postfix_str(f"files {len(done)}/{len(jobs)}")
            return
        ctx = _worker_context()
        rows_done = ctx.Value("q", 0)
        with ctx.Pool(workers, initializer=_init_worker, initargs=(rows_done,)) as pool:
            pending = {
                path: (prefix, pool.apply_async(_convert_in_worker, (path, prefix, block_size, fail, target)))
                for path, prefix in jobs
            }
            try:
                while pending:
                    for path, (_prefix, result) in list(pending.items()):
                        if result.ready():
                            done[path] = result.get()  # a worker's error is raised here
                            del pending[path]
                    bar.update(rows_done.value - bar.n)
                    bar.set_postfix_str(f"files {len(done)}/{len(jobs)}")
                    if pending:
                        next(iter(pending.values()))[1].wait(0.2)
                # every file is done: the workers exit on their own (the with-block's terminate
                # would SIGTERM them, cutting short what a process does at exit)
                pool.close()
                pool.join()
            except BaseException:
                pool.terminate()  # the running workers are killed: their partial files are removed here
                for prefix, _ in pending.values():
                    for name in outputs(prefix, target):
                        remove_partial(name)
                raise
    finally:
        bar.close()


def write_report(
    out: str, jobs: list[tuple[str, str]], done: dict[str, dict], seconds: float, failed: Optional[str]
) -> dict:
    """``<out>/convert_report.json``, merged with the one already there: converting day by
    day into one directory keeps a report of every file in it."""
    path = os.path.join(out, REPORT)
    files: dict[str, dict] = {}
    try:
        with open(path) as f:
            files = dict(json.load(f)["files"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    for src, prefix in jobs:
        if src in done:
            files[src] = {**done[src], "output": prefix}
    report = {
        "rows": sum(f["rows"] for f in files.values()),
        "bad_rows": sum(f["bad_rows"] for f in files.values()),
        "unreadable": [f["unreadable"] for f in files.values() if f["unreadable"]],
        "files": files,
        "last_run": {
            "input_files": len(jobs),
            "converted": len(done),
            "seconds": round(seconds, 3),
            "rows": sum(done[src]["rows"] for src in done),
            "failed": failed,
        },
    }
    replace_file(path, lambda temp: write_text(temp, json.dumps(report, indent=1)))
    return report


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: must be at least 1")
    return value


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text}: not integers separated by commas") from None
    if len(sizes) == 1:
        sizes *= CAT_FEATURES
    if len(sizes) != CAT_FEATURES or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text}: one size >= 1 for every table, or {CAT_FEATURES} of them")
    return sizes


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m hybridrec.data.convert",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "input",
        metavar="INPUT",
        help="Criteo TSV (a file, a directory or a glob; plain or .gz) or, for --format parquet, "
        "days of the .npy layout (a directory of *_dense.npy, or files or a glob of them)",
    )
    parser.add_argument("--out", required=True, help="directory of the output files (created)")
    parser.add_argument(
        "--format",
        choices=("npy", "parquet"),
        default="npy",
        help="TorchRec's .npy layout (default; data=criteo_binary) or Parquet (data=parquet)",
    )
    parser.add_argument(
        "--num-embeddings",
        type=_sizes,
        default=None,
        metavar="N[,N...]",
        help=f"--format parquet: rows of the {CAT_FEATURES} tables the ids are mapped into, "
        "or one size for all (default: data=criteo's, Criteo Kaggle's capped at 100k)",
    )
    parser.add_argument(
        "--id-mapping",
        choices=[m.value for m in IdMapping],
        default=None,
        help="--format parquet: how a raw id becomes a table row, as data.id_mapping of data=criteo (default: modulo)",
    )
    parser.add_argument(
        "--row-group-size",
        type=_positive,
        default=ROW_GROUP_SIZE,
        help=f"--format parquet: rows per Parquet row group (default: {ROW_GROUP_SIZE})",
    )
    parser.add_argument(
        "--config-name",
        default=CONFIG_NAME,
        help=f"--format parquet: the data config written to <out>/conf/data/<name>.yaml (default: {CONFIG_NAME})",
    )
    parser.add_argument(
        "--workers",
        type=_positive,
        default=min(4, os.cpu_count() or 1),
        help="worker processes, one file each (default: min(4, CPUs))",
    )
    parser.add_argument(
        "--bad-rows",
        choices=("skip", "fail"),
        default="skip",
        help="skip and count bad rows (default), or stop at the first",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace output files that exist")
    parser.add_argument(
        "--block-size-mb",
        type=_positive,
        default=16,
        help="MiB of text parsed per block, per worker (memory, not results)",
    )
    return parser.parse_args(argv)


def _stop(message: str, code: int) -> NoReturn:
    print(f"hybridrec: {message}", file=sys.stderr)
    sys.exit(code)


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    parquet = args.format == "parquet"
    target = NPY
    try:
        if parquet:
            target = Target(
                "parquet", args.num_embeddings or NPY.sizes, IdMapping(args.id_mapping or "modulo"), args.row_group_size
            )
            if not args.config_name.replace("_", "").replace("-", "").isalnum():
                raise Refused(f"--config-name {args.config_name}: letters, digits, _ and - only (a Hydra option name)")
        else:
            given = [
                f"--{k.replace('_', '-')}"
                for k in ("num_embeddings", "id_mapping", "config_name")
                if getattr(args, k) not in (None, CONFIG_NAME)
            ]
            if given or args.row_group_size != ROW_GROUP_SIZE:
                raise Refused(
                    f"{(given or ['--row-group-size'])[0]} applies to --format parquet: the .npy layout "
                    f"keeps the raw ids, mapped at training time by data.id_mapping"
                )
        jobs = plan(args.input, args.out, args.overwrite, target)
        if parquet:
            check_config(args.out, args.config_name, target, args.overwrite)
        os.makedirs(args.out, exist_ok=True)
        config = write_config(args.out, args.config_name, target) if parquet else None
    except Refused as e:
        _stop(str(e), 2)
    except OSError as e:
        _stop(f"--out {args.out}: {e.strerror or e}", 2)
    done: dict[str, dict] = {}
    start = time.perf_counter()
    try:
        run(jobs, min(args.workers, len(jobs)), args.block_size_mb * 2**20, args.bad_rows == "fail", done, target)
    except KeyboardInterrupt:
        write_report(args.out, jobs, done, time.perf_counter() - start, "interrupted")
        _stop(f"interrupted: {len(done)} of {len(jobs)} files converted, no partial file left", 130)
    except DataError as e:  # --bad-rows fail, or a file that is not TSV after all
        write_report(args.out, jobs, done, time.perf_counter() - start, str(e))
        _stop(f"{e} ({len(done)} of {len(jobs)} files converted, nothing written for the rest)", 1)
    seconds = time.perf_counter() - start
    write_report(args.out, jobs, done, seconds, None)
    rows, bad = sum(f["rows"] for f in done.values()), sum(f["bad_rows"] for f in done.values())
    broken = sum(1 for f in done.values() if f["unreadable"])
    notes = f"{bad:,} bad rows skipped" + (f", {broken} file(s) unreadable past a break" if broken else "")
    print(
        f"hybridrec: converted {len(jobs)} file(s), {rows:,} rows ({notes}) in {seconds:.1f} s "
        f"({rows / max(seconds, 1e-9):,.0f} rows/s) into {args.out} (report: {os.path.join(args.out, REPORT)})"
    )
    if config:
        print(
            f"hybridrec: data config {config}: train with python -m hybridrec.train --config-dir "
            f"{os.path.dirname(os.path.dirname(config))} data={args.config_name} data.train_path=... "
            f"data.eval_path=... (--config-dir before the overrides)"
        )


if __name__ == "__main__":
    main()
