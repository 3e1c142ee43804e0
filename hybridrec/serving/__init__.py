"""Serving: a checkpoint written as a self-contained export (``export``: the program,
its spec and its preprocessing; ``export_sequences`` for a sequence ranker's user encoder),
read back (``exported``), kept current by deltas (``delta``), and raw rows made into the
program's inputs from the export alone (``preprocess``).

    from hybridrec.serving import Preprocessor

May import: base, config, data, models, parallel, reports, checkpoint."""

from hybridrec.serving.preprocess import Preprocessor

__all__ = ["Preprocessor"]
