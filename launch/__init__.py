"""The repository's training jobs (not part of the installed megaloss library).

Job scripts: :mod:`launch.train_lm`, :mod:`launch.train_lm_fsdp`, :mod:`launch.train_embed`,
:mod:`launch.distill_lm`, :mod:`launch.train_dpo`, :mod:`launch.train_grpo` (megaloss's own
loop), :mod:`launch.train_lm_hf`, :mod:`launch.train_embed_hf` (Hugging Face's trainers); each is
``parse_args``, a job for the one runner (:mod:`launch.jobs.runner`) and a short ``main``. What
they share lives in :mod:`launch.jobs`. The ``launch/*.sh`` scripts put the repository root on
``PYTHONPATH`` for the ``deepspeed`` launcher; to run a job directly from the repository root:
``python -m launch.train_lm --help``.
"""
