"""``python -m hybridrec.data.convert``: Criteo TSV to the binary layout ``data=criteo_binary`` reads.

    python -m hybridrec.data.convert 'logs/day_*.gz' --out npy/ --workers 4

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
"""

from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing as mp
import os
import signal
import sys
import time
import zlib
from typing import Any, Callable, NoReturn, Optional

import numpy as np
from tqdm import tqdm

from hybridrec.data import DataError, FileReport, ReadReport
from hybridrec.data.criteo import CAT_FEATURES, COLUMNS, INT_FEATURES, read_tsv_file, resolve_paths

REPORT = "convert_report.json"
# Part, dtype, columns. The dtypes are those TorchRec's tsv_to_npys writes, so that its own
# tools read the files too.
PARTS = (("dense", np.float32, INT_FEATURES), ("sparse", np.int64, CAT_FEATURES), ("labels", np.int32, 1))
_PARTIAL = ".partial"  # not *_dense.npy: a directory glob of days never picks up an unfinished file
_SNIFF_BYTES = 1 << 16


class Refused(Exception):
    """Input or output the converter refuses before converting anything (exit code 2)."""


# -- one file ----------------------------------------------------------------------------
class _NpyWriter:
    """An .npy file written block by block, in one pass, never holding more than a block.

    The row count is known only at the end (bad rows are dropped), so the header is written
    first with 0 rows and rewritten in place with the real count once the rows are in. NumPy
    pads the header of a row-major array so that its length does not depend on the row count
    (room for 21 digits), and the length is checked. The alternatives cost more: open_memmap
    needs the count up front (a counting pass parses every file twice, since only the parser
    knows which rows are valid), and accumulating a file's blocks holds the whole file in
    memory (~260 bytes per row, ~50 GB for a 200M-row day of the 1TB logs)."""

    def __init__(self, path: str, dtype: Any, width: int) -> None:
        self.path, self.partial = path, path + _PARTIAL
        self.dtype, self.width, self.rows = np.dtype(dtype), width, 0
        self.file = open(self.partial, "wb")
        self.header = self._write_header()

    def _write_header(self) -> int:
        np.lib.format.write_array_header_1_0(
            self.file, {"descr": self.dtype.str, "fortran_order": False, "shape": (self.rows, self.width)}
        )
        return self.file.tell()

    def append(self, block: np.ndarray) -> None:
        block = np.ascontiguousarray(block, dtype=self.dtype).reshape(-1, self.width)
        self.file.write(block.data)
        self.rows += len(block)

    def finish(self) -> None:
        """The real row count in the header, and the bytes on disk (before the rename that
        makes the file look complete)."""
        end = self.file.tell()
        self.file.seek(0)
        if self._write_header() != self.header:
            raise RuntimeError(f"{self.path}: the .npy header changed length with the row count")
        self.file.seek(end)
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()

    def commit(self) -> None:
        os.replace(self.partial, self.path)

    def discard(self) -> None:
        self.file.close()
        remove_partial(self.path)


def outputs(prefix: str) -> list[str]:
    return [f"{prefix}_{part}.npy" for part, _, _ in PARTS]


def remove_partial(path: str) -> None:
    try:
        os.remove(path + _PARTIAL)
    except FileNotFoundError:
        pass


def convert_file(path: str, prefix: str, block_size: int, fail: bool,
                 progress: Callable[[int], None] = lambda rows: None) -> dict[str, Any]:
    """``path`` (Criteo TSV) into ``<prefix>_{dense,sparse,labels}.npy``; returns the file's
    report (rows, bad_rows, errors, unreadable). A DataError (``fail``: the first bad row)
    leaves none of the three files."""
    report = ReadReport()
    writers: list[_NpyWriter] = []
    try:
        for (part, dtype, width), name in zip(PARTS, outputs(prefix)):
            writers.append(_NpyWriter(name, dtype, width))
        for dense, raw, labels, _ in read_tsv_file(path, block_size, fail, report):
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
    with _rows_done.get_lock():
        _rows_done.value += rows


def _convert_in_worker(path: str, prefix: str, block_size: int, fail: bool) -> dict[str, Any]:
    return convert_file(path, prefix, block_size, fail, _count)


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
        raise Refused(f"{path}: not a Criteo TSV: no line of {len(COLUMNS)} tab-separated fields in its "
                      f"first {len(head):,} bytes{hint}")


def plan(spec: str, out: str, overwrite: bool) -> list[tuple[str, str]]:
    """(input file, output prefix) per file, or Refused."""
    try:
        paths = resolve_paths(spec, "INPUT")
    except DataError as e:
        raise Refused(str(e)) from None
    if os.path.exists(out) and not os.path.isdir(out):
        raise Refused(f"--out {out}: exists and is not a directory")
    jobs, seen = [], {}
    for path in paths:
        name = stem(path)
        if name in seen:
            raise Refused(f"{seen[name]} and {path} would both be written to {os.path.join(out, name)}_*.npy")
        seen[name] = path
        check_tsv(path)
        jobs.append((path, os.path.join(out, name)))
    existing = [p for _, prefix in jobs for p in outputs(prefix) if os.path.exists(p)]
    if existing and not overwrite:
        more = f" (and {len(existing) - 1} more output files)" if len(existing) > 1 else ""
        raise Refused(f"{existing[0]} exists{more}: pass --overwrite to replace")
    return jobs


# -- running -----------------------------------------------------------------------------
def run(jobs: list[tuple[str, str]], workers: int, block_size: int, fail: bool,
        done: dict[str, dict]) -> None:
    """Convert every job, filling ``done`` (input -> report) as files complete. On an error
    (``fail``: a bad row) the other files stop at once and leave no partial file."""
    bar = tqdm(desc="convert", unit=" rows", unit_scale=True, disable=None, file=sys.stderr)
    bar.set_postfix_str(f"files 0/{len(jobs)}")
    try:
        if workers == 1:
            for path, prefix in jobs:
                done[path] = convert_file(path, prefix, block_size, fail, bar.update)
                bar.set_postfix_str(f"files {len(done)}/{len(jobs)}")
            return
        ctx = _worker_context()
        rows_done = ctx.Value("q", 0)
        with ctx.Pool(workers, initializer=_init_worker, initargs=(rows_done,)) as pool:
            pending = {path: (prefix, pool.apply_async(_convert_in_worker, (path, prefix, block_size, fail)))
                       for path, prefix in jobs}
            try:
                while pending:
                    for path, (prefix, result) in list(pending.items()):
                        if result.ready():
                            done[path] = result.get()  # a worker's error is raised here
                            del pending[path]
                    bar.update(rows_done.value - bar.n)
                    bar.set_postfix_str(f"files {len(done)}/{len(jobs)}")
                    if pending:
                        next(iter(pending.values()))[1].wait(0.2)
            except BaseException:
                pool.terminate()  # the running workers are killed: their partial files are removed here
                for prefix, _ in pending.values():
                    for name in outputs(prefix):
                        remove_partial(name)
                raise
    finally:
        bar.close()


def write_report(out: str, jobs: list[tuple[str, str]], done: dict[str, dict], seconds: float,
                 failed: Optional[str]) -> dict:
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
        "last_run": {"input_files": len(jobs), "converted": len(done), "seconds": round(seconds, 3),
                     "rows": sum(done[src]["rows"] for src in done), "failed": failed},
    }
    with open(path + _PARTIAL, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(path + _PARTIAL, path)
    return report


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: must be at least 1")
    return value


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m hybridrec.data.convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input", metavar="INPUT", help="Criteo TSV: a file, a directory or a glob; plain or .gz")
    parser.add_argument("--out", required=True, help="directory of the .npy files (created)")
    parser.add_argument("--workers", type=_positive, default=min(4, os.cpu_count() or 1),
                        help="worker processes, one file each (default: min(4, CPUs))")
    parser.add_argument("--bad-rows", choices=("skip", "fail"), default="skip",
                        help="skip and count bad rows (default), or stop at the first")
    parser.add_argument("--overwrite", action="store_true", help="replace output files that exist")
    parser.add_argument("--block-size-mb", type=_positive, default=16,
                        help="MiB of text parsed per block, per worker (memory, not results)")
    return parser.parse_args(argv)


def _stop(message: str, code: int) -> NoReturn:
    print(f"hybridrec: {message}", file=sys.stderr)
    sys.exit(code)


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    try:
        jobs = plan(args.input, args.out, args.overwrite)
        os.makedirs(args.out, exist_ok=True)
    except Refused as e:
        _stop(str(e), 2)
    except OSError as e:
        _stop(f"--out {args.out}: {e.strerror or e}", 2)
    done: dict[str, dict] = {}
    start = time.perf_counter()
    try:
        run(jobs, min(args.workers, len(jobs)), args.block_size_mb * 2**20, args.bad_rows == "fail", done)
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
    print(f"hybridrec: converted {len(jobs)} file(s), {rows:,} rows ({notes}) in {seconds:.1f} s "
          f"({rows / max(seconds, 1e-9):,.0f} rows/s) into {args.out} (report: {os.path.join(args.out, REPORT)})")


if __name__ == "__main__":
    main()
