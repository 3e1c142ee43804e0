"""The training loop and what it is made of: the model and data built for a rank
(``build``), the loop (``trainer``), scoring a split or a checkpoint (``scoring``), and
the continuous schedule over day partitions (``continuous``).

May import: base, config, data, models, parallel, reports, checkpoint, serving."""
