"""Adapters that wire megaloss into DeepSpeed and Hugging Face ``transformers``.

Modules (import them by path; importing this package does not import deepspeed or transformers):

- :mod:`megaloss.integrations.config`: the validated ``"megaloss"`` section of a ds_config.
- :mod:`megaloss.integrations.hf`: :class:`CausalLMWithLoss`, any ``*ForCausalLM`` whose forward
  returns the chunked / vocab-parallel CE of its last hidden states (no logits).
- :mod:`megaloss.integrations.deepspeed`: building the DP x TP engine, measuring its gradient
  scale, calibrated optimizer steps and metrics through ``engine.monitor``.
- :mod:`megaloss.integrations.trainer`: a small training loop shared by the ``launch/`` jobs.
- :mod:`megaloss.integrations.reporting`: what the ``launch/`` jobs write and print (metrics CSV,
  loss-curve PNG, ``summary.json``, summary table, rank-0 log lines).

``megaloss.deepspeed`` re-exports the public names of :mod:`megaloss.integrations.deepspeed`.
"""
