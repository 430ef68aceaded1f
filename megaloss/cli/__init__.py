"""The console scripts a user runs on their own setup, installed with the package (the
repository's top-level ``tools/`` holds the benchmarks, a different thing):
- :mod:`.check_layout` (``megaloss-check-layout``): does a ds_config layout train like one
  device? The layout through the ``deepspeed`` launcher against one process, step by step.
- :mod:`.comm_model` (``megaloss-comm-model``): what megaloss's losses send per rank as TP, DP
  and SP grow, a model checked against counts measured on gloo processes.

Benchmarks (memory and time side by side with a baseline) stay in the repository's ``tools/``.
"""
