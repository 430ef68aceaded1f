"""The console scripts a user runs on their own setup, installed with the package (the
repository's top-level ``tools/`` holds the benchmarks, a different thing):
- :mod:`.check_layout` (``megaloss-check-layout``): does a ds_config layout train like one
  device? The layout through the ``deepspeed`` launcher against one process, step by step
  (the CLI; the spec, the runs and the comparison in :mod:`.check_layout_spec`,
  :mod:`.check_layout_run`, :mod:`.check_layout_report`, pipeline layouts in
  :mod:`.check_layout_pipeline`).
- :mod:`.comm_model` (``megaloss-comm-model``): what megaloss's losses send per rank as TP, DP
  and SP grow, a model checked against counts measured on gloo processes (the CLI; the per-loss
  byte models in :mod:`.comm_costs`, the measurement in :mod:`.comm_measure`, the tables and plot
  at scale in :mod:`.comm_scale`).

Benchmarks (memory and time side by side with a baseline) stay in the repository's ``tools/``.
"""
