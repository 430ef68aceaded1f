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


def test_every_page_is_in_the_nav():
    nav = (REPO / "mkdocs.yml").read_text()
    for page in (REPO / "docs").rglob("*.md"):
        name = page.relative_to(REPO / "docs").as_posix()
        assert re.search(rf":\s*{re.escape(name)}$", nav, re.M), f"{name} is not in the nav"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading (lower case, punctuation dropped, spaces to -)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_readme_links_resolve():
    """Every relative link of the README names a file of the repository, and its ``#anchor``, if
    any, a heading of that file: the sections that moved to docs/ stay reachable."""
    links = re.findall(r"\]\(([^)\s]+)\)", (REPO / "README.md").read_text(encoding="utf-8"))
    assert links
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        target, _, anchor = link.partition("#")
        path = REPO / target if target else REPO / "README.md"
        assert path.exists(), f"README.md links to {target}, which does not exist"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", path.read_text(encoding="utf-8"), re.M)
            assert anchor in {_anchor(h) for h in headings}, f"{link}: no such heading"
