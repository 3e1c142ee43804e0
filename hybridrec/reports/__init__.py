"""What a run says about itself: metrics (``metrics``), the training log and its lines
(``runlog``, ``logs``), summary.json and report.png (``summary``), profiler traces
(``profiling``) and a sweep's table (``sweep``).

May import: base, config, data, models, parallel."""
