"""The docs site's API pages cover the whole package: every module of ``megaloss`` (private ones,
``_name``, excepted) has a ``::: module`` entry in ``docs/api/*.md``, and every entry names a
module that exists (CI builds the site with ``mkdocs build --strict``)."""
import pkgutil
import re
from pathlib import Path

import megaloss

REPO = Path(__file__).resolve().parents[1]


def _modules():
    names = {"megaloss"}
    for info in pkgutil.walk_packages(megaloss.__path__, "megaloss."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            names.add(info.name)
    return names


def test_every_module_has_an_api_page_entry():
    entries = set()
    for page in (REPO / "docs" / "api").glob("*.md"):
        entries |= set(re.findall(r"^::: (\S+)$", page.read_text(), re.M))
    modules = _modules()
    assert modules - entries == set(), "modules without an API entry"
    assert entries - modules == set(), "API entries naming no module"
    nav = (REPO / "mkdocs.yml").read_text()
    for page in (REPO / "docs" / "api").glob("*.md"):
        assert f"api/{page.name}" in nav, f"{page.name} is not in mkdocs.yml's nav"
