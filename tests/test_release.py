"""The course as a release: its licences, its one version, its changelog and citation (issue 33).

The version is written once, in ``src/dpcourse/__init__.py``; ``pyproject.toml`` reads it, and
``CHANGELOG.md``'s newest release and ``CITATION.cff`` must name it, with the same date.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

import dpcourse

ROOT = Path(__file__).resolve().parents[1]
RELEASE = re.compile(r"^## \[(\d+\.\d+\.\d+)\] - (\d{4}-\d{2}-\d{2})$", re.M)


def pyproject() -> dict:
    """pyproject.toml, parsed (tomllib: Python 3.11 on; the course's machines have it)."""
    tomllib = pytest.importorskip("tomllib", reason="Python 3.10 has no tomllib")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def releases() -> list[tuple[str, str]]:
    """(version, date) of every release in CHANGELOG.md, newest first."""
    return RELEASE.findall((ROOT / "CHANGELOG.md").read_text())


def test_licences_are_there():
    assert (ROOT / "LICENSE").read_text().startswith("MIT License\n")
    text = (ROOT / "LICENSE-CC-BY-4.0.txt").read_text()
    assert text.startswith("Creative Commons Attribution 4.0 International")
    project = pyproject()["project"]
    assert project["license"] == "MIT"
    assert set(project["license-files"]) == {"LICENSE", "LICENSE-CC-BY-4.0.txt"}


def test_every_page_footer_states_both_licences():
    footer = yaml.safe_load((ROOT / "_config.yml").read_text())["html"]["extra_footer"]
    assert "CC BY 4.0" in footer and "creativecommons.org/licenses/by/4.0" in footer
    assert "MIT License" in footer


def test_the_version_is_written_once():
    project = pyproject()
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "dpcourse.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", dpcourse.__version__)


def test_changelog_and_citation_name_the_version():
    found = releases()
    assert found, "CHANGELOG.md has no release heading '## [X.Y.Z] - YYYY-MM-DD'"
    version, date = found[0]
    assert version == dpcourse.__version__, "CHANGELOG.md's newest release is not the package's"
    assert [d for _, d in found] == sorted((d for _, d in found), reverse=True)
    changelog = (ROOT / "CHANGELOG.md").read_text()
    newest = changelog[changelog.index(f"## [{version}]"):]
    assert "### Errata" in newest.split("\n## [", 1)[0], "the newest release has no errata section"
    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert cff["cff-version"] == "1.2.0" and cff["title"] and cff["authors"]
    assert str(cff["version"]) == version and str(cff["date-released"]) == date
    assert set(cff["license"]) == {"MIT", "CC-BY-4.0"}
