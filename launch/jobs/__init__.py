"""Support code of the ``launch/`` jobs (not part of the megaloss library): built-in real data
that needs no download, and what the jobs write and print.

- :mod:`jobs.text_data`: language-modelling text from the interpreter's standard library, a
  byte-level BPE tokenizer, fixed-length blocks; and what both jobs share: the per-rank batch
  stream (``StepBatches``), cache keys (``files_digest``) and cache writes (``atomic_write``).
- :mod:`jobs.code_search`: (docstring -> function source) retrieval pairs extracted with ``ast``.
- :mod:`jobs.reporting`: metrics CSV, loss-curve PNG, ``summary.json``, summary table, rank-0 log.
- :mod:`jobs.runs`: what both jobs share around the training loop: the run options
  (``--save_every``, ``--resume``, ``--eval_only``, ``--overwrite``), one run per output folder,
  failures every rank reports with their cause, SIGTERM / SIGINT stopping at a step boundary.

The launch scripts run with ``launch/`` on ``sys.path`` (Python puts a script's folder there), so
they import these as ``jobs.*``.
"""
