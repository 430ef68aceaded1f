"""Adapters that wire megaloss into DeepSpeed (:mod:`.deepspeed`) and Hugging Face models
(:mod:`.hf`). They only wire and choose defaults; the math lives below them. Importing these
packages imports neither ``deepspeed`` nor ``transformers``.
"""
