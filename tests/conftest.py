import os
import sys

# Spawned workers import test modules by name: make tests/ importable as top-level modules.
sys.path.insert(0, os.path.dirname(__file__))


def pytest_configure(config):
    config.addinivalue_line("markers", "distributed: spawns several gloo processes (CI runs them)")
    config.addinivalue_line("markers", "deepspeed: runs a real DeepSpeed engine (CI runs them)")
    config.addinivalue_line("markers", "slow: takes more than a few seconds (CI runs them)")
