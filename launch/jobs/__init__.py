"""Support code of the ``launch/`` jobs (not part of the megaloss library): built-in real data
that needs no download, the models, the options and what the jobs write and print.

- :mod:`launch.jobs.text_data`: language-modelling text from the interpreter's standard library,
  a byte-level BPE tokenizer, fixed-length blocks; and what all jobs share: the per-rank batch
  stream (``StepBatches``), cache keys (``files_digest``) and cache writes (``atomic_write``).
- :mod:`launch.jobs.code_search`: (docstring -> function source) retrieval pairs extracted with
  ``ast``.
- :mod:`launch.jobs.lm_data`: the LM jobs' split, tokenizer and token streams (cached), blocks and
  evaluation shards.
- :mod:`launch.jobs.pair_data`: the embedding jobs' cached pairs and tokenizer.
- :mod:`launch.jobs.models`: the small random-init Llama and BERT the jobs train.
- :mod:`launch.jobs.teacher`: the distillation job's teacher read back from a main-job checkpoint
  (the full lm_head from every TP rank's model file) and its held-out perplexity.
- :mod:`launch.jobs.retrieval`: MRR@k and recall@1 of held-out retrieval.
- :mod:`launch.jobs.arguments`: the command-line option groups the jobs share;
  :mod:`launch.jobs.check_args`: a job's command line checked once before any rank starts.
- :mod:`launch.jobs.reporting`: metrics CSV, loss-curve PNG, ``summary.json``, summary table,
  rank-0 log.
- :mod:`launch.jobs.runner`: the one runner of every job (process, run folder, resume,
  ``--eval_only``, checkpoints, stop signals, the step loop, evaluation, summary and outputs; a
  job supplies build / step / evaluate and its reports); :mod:`launch.jobs.lm_job` (the LM jobs'
  loop and reports), :mod:`launch.jobs.sft_phases` (SFT then a second phase on one engine: the
  preference and GRPO jobs), :mod:`launch.jobs.layouts` (their layout refusal and rank share),
  :mod:`launch.jobs.embed_step` (the embedding job's MNR step), :mod:`launch.jobs.fsdp_checkpoints`
  (the FSDP job's DCP checkpoints).
- :mod:`launch.jobs.runs`: what ties a run together around the training loop: the run options
  (``--save_every``, ``--resume``, ``--eval_only``, ``--overwrite``), a trainer job's run folder
  and the end-of-run tail (outputs, summary table, barrier); it re-exports the pieces below.
  :mod:`launch.jobs.agreement`: set-up failures agreed across ranks (``agreed``);
  :mod:`launch.jobs.checkpoints`: one run per output folder, resume and checkpoints;
  :mod:`launch.jobs.signals`: SIGTERM / SIGINT / SIGUSR1 stopping at a step boundary;
  :mod:`launch.jobs.progress`: the progress bar and the step loop (``TrainLoop``);
  :mod:`launch.jobs.quiet_logs`: the libraries' noise silenced;
  :mod:`launch.jobs.processes`: process start-up and end (``run_job``: exit status, the error
  reported once with its cause, process groups destroyed).

Imported as a package (``from launch.jobs.text_data import ...``): the ``launch/*.sh`` scripts put
the repository root on ``PYTHONPATH``.
"""
