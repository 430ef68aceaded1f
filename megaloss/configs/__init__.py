"""The ds_config files megaloss ships (package data): ZeRO stages 0-3 with a ``"megaloss"``
section, and ``zero2_hf.json`` for the Hugging Face Trainer. In a checkout they are also
``configs/`` at the repository root; installed, they are found here::

    from megaloss.configs import config_path
    engine, ... = megaloss.integrations.deepspeed.initialize(model, config_path("zero2"), ...)

What each file sets and why: ``README.md`` beside this module.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import List

__all__ = ["config_path", "config_names"]


def config_names() -> List[str]:
    """The shipped configs' names (``"zero0"``, ..., ``"zero2_hf"``), sorted."""
    files = resources.files(__name__)
    return sorted(f.name[:-5] for f in files.iterdir() if f.name.endswith(".json"))


def config_path(name: str) -> Path:
    """The path of the shipped config ``name`` (``"zero2"`` or ``"zero2.json"``).

    Raises:
        ValueError: no shipped config has that name (the message lists the names).
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    stem = name[:-5] if name.endswith(".json") else name
    if stem not in config_names():
        raise ValueError(f"no shipped ds_config named {name!r}; choose one of {config_names()}")
    # a regular file inside the installed package (setuptools installs package data unzipped)
    return Path(str(resources.files(__name__).joinpath(stem + ".json")))
