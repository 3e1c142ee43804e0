"""The bytes of a Criteo TSV file before they are parsed: the checks that a file is text
(``_text_head``) and gzip when named so (``_check_gzip``), its text in blocks of whole lines
that stop cleanly where a stream breaks (``_line_blocks``, ``_Unreadable``), and the lines that
are not UTF-8 (``_blank_undecodable``)."""

from __future__ import annotations

import gzip
import os
import zlib
from typing import Iterator

import pyarrow as pa

from hybridrec.data import DataError


class _Unreadable(Exception):
    """A file's stream broke after the blocks already yielded; ``partial`` bytes of the next
    line had been read."""

    def __init__(self, kind: str, cause: BaseException, partial: int) -> None:
        super().__init__(kind)
        self.kind, self.cause, self.partial = kind, cause, partial


_TEXT_HEAD = 65_536  # bytes of a file's text looked at before training


def _text_head(path: str, key: str) -> bytes:
    """The first bytes of the file's text (decompressed), refused when they are not text: a
    NUL byte is in no TSV, and a binary file read as lines would lose every row to
    "wrong field count" errors and look like a file of bad rows."""
    try:
        with gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb") as f:
            head = f.read(_TEXT_HEAD)
    except (OSError, EOFError, zlib.error):  # a broken gzip stream: reported where it breaks, by the reader
        return b"?"
    if (nul := head.find(b"\0")) >= 0:
        raise DataError(
            f"{path}: not a text file (a NUL byte at byte {nul:,} of its text); {key} names Criteo's "
            f"tab-separated logs (.tsv or .tsv.gz): a converted .npy day is read with data=criteo_binary"
        )
    return head


def _check_gzip(path: str) -> None:
    """A file named .gz that is not gzip (a plain TSV renamed, another format) is named as
    such now: read as gzip, it would lose every row and look like a file too short."""
    if not path.endswith(".gz") or os.path.getsize(path) == 0:
        return
    with open(path, "rb") as f:
        head = f.read(2)
    if head != b"\x1f\x8b":
        text = all(32 <= c < 127 or c in b"\t\r\n" for c in head)
        plain = "plain text: drop the .gz from its name" if text else "not gzip"
        raise DataError(f"{path}: named .gz but it is not gzip (it starts with {head!r}: {plain})")


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
        kind = (
            "truncated gzip"
            if isinstance(error, EOFError)
            else "corrupt gzip"
            if gz and isinstance(error, (zlib.error, gzip.BadGzipFile))
            else "read error"
        )
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
