from setuptools import setup

setup()  # all metadata is in pyproject.toml; this shim is for tools that still look for setup.py
