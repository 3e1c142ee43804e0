"""Parquet feature logs (``data=parquet``): a team's own rows (Spark, a feature store),
described entirely by the data config: which column is the label, the sample weight, each
dense feature and each sparse feature (one-hot or multi-hot, weighted or not, sharing tables
or not), and how ids become table rows.

A split is its files' rows in order (files sorted by name, row groups in file order), minus
the held-out validation runs when ``valid_fraction`` carves validation out of the training
files. Global batch k is rows [k*B, (k+1)*B) of the split, so the batches are the same for
every world size; rank r reads only its rows of each batch, from the row groups that cover
them (an index of cumulative row counts per file and row group, from the Parquet footers),
with ``ParquetFile.read_row_group``: never a whole file, so files larger than memory work.
The last row groups read are kept, so consecutive batches do not decode a group again. Every
value is converted by column (PyArrow compute and NumPy over a row group's slice): no Python
loop over rows, ids or values (strings are hashed by their distinct values, all at once).

Bad rows (a null or non-0/1 label, a null or non-finite dense value or sample weight, a list
longer than ``max_length``, a null id in a list, an id outside the table with
``id_mapping=none``, id weights that do not match the ids): a random-access source cannot
drop a row without shifting every later batch, which would make batches depend on who read
what before. So a bad row keeps its place and becomes padding: dense 0, one id 0 per
feature, label 0, not real (``Rows.real``), which gives it weight 0 in the loss and keeps it
out of every metric and of the predictions. It is counted with file and row (0-based, as
PyArrow and pandas index a file's rows); ``bad_rows=fail`` stops at the first one instead.

Rows and bad rows are counted on a split's first pass only; each rank counts the rows it
read (``per_rank_report``), and the run's report is the ranks' sum (the training tail that
fills no global batch is reported by the rank whose slice starts the last batch). Pooling
factors and, per hashed feature, the share of ids that collide (per vocabulary feature, the
share of ids outside it) are estimated on the first training rows when the source is built.

The package, one module per job: ``hashing`` (ids to 64-bit keys), ``vocabulary`` (vocabulary
files), ``config`` (the data config's features as plain values), ``layout`` (the files, row
groups and segments of a split), ``columns`` (a table's columns into ids, lengths, weights,
labels and dense values, and the checks that find bad rows) and ``source`` (ParquetSource,
its config checks, building and reading); ``hybridrec.data.parquet`` keeps their names.
"""

from hybridrec.data.parquet.hashing import hash_ints, hash_strings
from hybridrec.data.parquet.source import HOLDOUT_RUN, SAMPLE_ROWS, ParquetSource
from hybridrec.data.parquet.vocabulary import Vocabulary

__all__ = ["HOLDOUT_RUN", "SAMPLE_ROWS", "ParquetSource", "Vocabulary", "hash_ints", "hash_strings"]
