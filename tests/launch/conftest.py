"""The launch tests' cache: ``MEGALOSS_CACHE`` (the jobs' default ``--cache_dir``) points at one
temporary folder for the session unless already set, so no test writes tokenizers or token
streams into ``~/.cache/megaloss``; launched jobs inherit it."""
import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _megaloss_cache(tmp_path_factory):
    if os.environ.get("MEGALOSS_CACHE"):
        yield os.environ["MEGALOSS_CACHE"]
        return
    os.environ["MEGALOSS_CACHE"] = str(tmp_path_factory.mktemp("megaloss-cache"))
    try:
        yield os.environ["MEGALOSS_CACHE"]
    finally:
        os.environ.pop("MEGALOSS_CACHE", None)
