"""Ids into 64-bit keys: integers (``hash_ints``) and strings or binary (``hash_strings``,
all of an array's at once), under a seed (``_salt``)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from hybridrec.data import splitmix64

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_STRING_SALT = np.uint64(0xD1B54A32D192ED03)
_LENGTH_SALT = np.uint64(0x8CB92BA72F3D8DD7)


# ------------------------------------------------------------------------------------- hashing
def _salt(seed: int) -> np.uint64:
    # seed + 1: splitmix64(0) = 0, so seed 0 must not leave id 0 unmixed
    return np.uint64(((seed + 1) * int(_GOLDEN)) % 2**64)


def hash_ints(values: np.ndarray, seed: int) -> np.ndarray:
    """64-bit keys of int64 ids."""
    with np.errstate(over="ignore"):
        return splitmix64(values.astype(np.int64).view(np.uint64) + _salt(seed))


def string_bytes(array: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """A string (or binary) array's bytes end to end, and each string's length in them (int64),
    read from its buffers without a copy."""
    n = len(array)
    large = pa.types.is_large_string(array.type) or pa.types.is_large_binary(array.type)
    buffers = array.buffers()
    offsets = np.frombuffer(buffers[1], np.int64 if large else np.int32)[array.offset : array.offset + n + 1]
    data = np.frombuffer(buffers[2], np.uint8) if buffers[2] is not None else np.zeros(0, np.uint8)
    return data[offsets[0] : offsets[-1]], np.diff(offsets).astype(np.int64)


def hash_strings(array: pa.Array, seed: int) -> np.ndarray:
    """64-bit keys of strings (or binary), all at once: each (position, byte) pair is mixed
    on its own and the mixes are summed per string (a tabulation hash), then mixed with the
    length. Nulls hash as empty strings (callers drop or refuse them first)."""
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    n = len(array)
    if n == 0:
        return np.zeros(0, np.uint64)
    body, spans = string_bytes(array)  # a null's span may hold bytes: they are skipped, not summed into a neighbour
    starts = np.cumsum(spans) - spans
    salt = _salt(seed)
    sums = np.zeros(n, np.uint64)
    with np.errstate(over="ignore"):
        if len(body):
            position = np.arange(len(body), dtype=np.int64) - np.repeat(starts, spans)
            mixed = splitmix64(
                ((position.astype(np.uint64) << np.uint64(8)) | body.astype(np.uint64)) + salt + _STRING_SALT
            )
            nonempty = np.flatnonzero(spans > 0)
            if len(nonempty):
                sums[nonempty] = np.add.reduceat(mixed, starts[nonempty])
        lengths = spans
        if array.null_count:
            nulls = np.asarray(array.is_null())
            sums[nulls], lengths = 0, np.where(nulls, 0, spans)
        return splitmix64(sums ^ splitmix64(lengths.astype(np.uint64) + salt + _LENGTH_SALT))
