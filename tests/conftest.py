"""Test layout: one folder per package layer (``ops``, ``parallel``, ``losses``, ``calibration``,
``integrations``), plus ``launch`` (the jobs and their data) and ``tools`` (benchmarks).

Tiers: ``pytest -m "not slow"`` is the fast tier (single process, under a minute); the full suite
(``pytest``, what CI runs) adds the tests marked ``slow``. Every test that spawns processes or
builds a DeepSpeed engine is ``slow`` (marked here from its ``distributed`` / ``deepspeed``
marker, so no such test can land in the fast tier by accident).
"""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
# Shared test helpers (float64 references, launcher helpers). The launch jobs are the package
# ``launch`` at the repository root, imported as ``launch.*`` like megaloss.
sys.path.insert(0, os.path.join(HERE, "helpers"))


def pytest_configure(config):
    config.addinivalue_line("markers", "distributed: spawns several gloo processes (slow tier)")
    config.addinivalue_line("markers", "deepspeed: runs a real DeepSpeed engine (slow tier)")
    config.addinivalue_line("markers", "slow: not in the fast tier (CI runs everything)")
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU, skips without (gpu_check.sh)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("distributed") or item.get_closest_marker("deepspeed"):
            item.add_marker(pytest.mark.slow)
