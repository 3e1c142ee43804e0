"""Vocabulary files (``id_mapping=vocabulary``): an id's table row is its position in the
file, found by binary search over sorted 64-bit keys."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from hybridrec.data import DataError, missing_hint, shorten
from hybridrec.data.parquet.columns import _kind, _plain_array
from hybridrec.data.parquet.hashing import hash_strings

_VOCABULARY_SEED = 0  # the hash that finds strings in a vocabulary: internal, any value works


# -------------------------------------------------------------------------- vocabularies
class Vocabulary:
    """A vocabulary file (``python -m hybridrec.data.vocab``): id i of the file (0-based, the
    file's order) is table row i + 1; row 0 is every id not in it. Looked up by binary search
    over sorted 64-bit keys (integers themselves; strings hashed, then compared), so no hash
    table of the whole vocabulary is built per read."""

    def __init__(self, path: str, key: str) -> None:
        try:
            ids = pq.read_table(path, columns=["id"]).column("id")
        except (OSError, pa.ArrowInvalid, KeyError) as e:
            raise DataError(
                f"{key}={path}: not a vocabulary file written by `python -m hybridrec.data.vocab` "
                f"({str(e).splitlines()[0] if str(e) else type(e).__name__}){missing_hint(path)}"
            ) from None
        ids = _plain_array(ids)
        self.path, self.kind, self.size = path, _kind(ids.type), len(ids)
        if self.kind not in ("int", "str") or ids.null_count:
            raise DataError(
                f"{key}={path}: its ids are {ids.type}{' with nulls' if ids.null_count else ''}; "
                f"a vocabulary holds integers or strings"
            )
        if self.kind == "int":
            keys = np.asarray(pc.cast(ids, pa.int64()), dtype=np.int64)
        else:
            self.ids = (
                ids.cast(pa.large_binary())
                if pa.types.is_large_string(ids.type) or pa.types.is_large_binary(ids.type)
                else ids.cast(pa.binary())
            )
            keys = hash_strings(ids, _VOCABULARY_SEED)
        self.order = np.argsort(keys, kind="stable")
        self.keys = keys[self.order]
        same = np.flatnonzero(self.keys[1:] == self.keys[:-1])
        if len(same):
            first = ids[int(self.order[same[0]])].as_py()
            raise DataError(
                f"{key}={path}: id {shorten(first)} is in it twice (or two strings share a 64-bit "
                f"hash): write it again with `python -m hybridrec.data.vocab`"
            )

    def rows(self, values: pa.Array) -> np.ndarray:
        """Table rows of non-null ids (1 + position in the file; 0 = not in the vocabulary)."""
        if len(values) == 0 or self.size == 0:
            return np.zeros(len(values), np.int64)
        if self.kind == "int":
            keys = np.asarray(pc.cast(values, pa.int64(), safe=False), dtype=np.int64)  # uint64 ids wrap: unknown
            at = np.minimum(np.searchsorted(self.keys, keys), self.size - 1)
            return np.where(self.keys[at] == keys, self.order[at] + 1, 0)
        encoded = pc.dictionary_encode(values)
        distinct = encoded.dictionary
        keys = hash_strings(distinct, _VOCABULARY_SEED)
        at = np.minimum(np.searchsorted(self.keys, keys), self.size - 1)
        hit = self.keys[at] == keys
        position = self.order[at]
        if hit.any():  # the hashes agree: the strings must too
            same = pc.equal(distinct.cast(self.ids.type), self.ids.take(pa.array(position)))
            hit &= np.asarray(pc.fill_null(same, False))
        rows = np.where(hit, position + 1, 0)
        return rows[np.asarray(encoded.indices, dtype=np.int64)]
