"""Running a job: the checks before any rank starts (``validation``, ``preflight``), the
launcher that starts the ranks and ends them (``launch``), one rank's whole job (``rank``),
and how a user's error is shown (``errors``).

May import: base, config, data, models, parallel, reports, checkpoint, serving, training."""
