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

The package, one module per job: ``common`` (the columns, the files a path names, the tables
and the mapping of ids into them, the collision estimate, the validation fraction), ``tsv``
(CriteoTSV, its shard readers and the parsing of blocks of lines), ``text`` (a file's bytes
before parsing: the text and gzip checks, blocks of whole lines, lines that are not UTF-8) and ``binary``
(CriteoBinary); ``hybridrec.data.criteo`` keeps their names.
"""

from hybridrec.data.criteo.binary import CriteoBinary
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
from hybridrec.data.criteo.tsv import CriteoTSV, parse_block, read_tsv_file

__all__ = [
    "CAT_FEATURES",
    "COLUMNS",
    "INT_FEATURES",
    "CriteoBinary",
    "CriteoTSV",
    "criteo_tables",
    "estimate_collisions",
    "map_ids",
    "parse_block",
    "read_tsv_file",
    "resolve_paths",
    "validation_fraction",
    "warn_collisions",
]
