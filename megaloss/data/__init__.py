"""Built-in real data that needs no download (the interpreter's own standard library).

- :mod:`megaloss.data.stdlib_text`: language-modelling text, a byte-level BPE tokenizer, blocks.
- :mod:`megaloss.data.code_search`: (docstring -> function source) retrieval pairs.

Import the modules by path; this package imports nothing heavy.
"""
