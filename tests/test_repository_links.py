"""_ext/repository_links.py: the text's references to the course's files (issue 34).

``{repo}`benchmarks/README.md` `` links the file in the repository ``_config.yml`` names, and
shows its path as code where none is named (as the launch buttons are left off then); a path
that does not exist fails the build. Here: the role on a made-up page both ways, and the book's
text, which names the repository's files only through the role, and only files that exist.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

# The website's tools: a GPU machine's image (make gpu-check) has neither, and skips this file
# rather than stop the whole run at collection.
pytest.importorskip("sphinx", reason="the website's tests need Sphinx and docutils (make setup)")
publish_doctree = pytest.importorskip("docutils.core").publish_doctree
roles = pytest.importorskip("docutils.parsers.rst").roles

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location(
    "repository_links", ROOT / "_ext" / "repository_links.py"
)
repository_links = importlib.util.module_from_spec(spec)
spec.loader.exec_module(repository_links)

PAGES = sorted((ROOT / "chapters").glob("*.ipynb")) + sorted((ROOT / "chapters").glob("*.md"))
REPO_ROLE = re.compile(r"\{repo\}`(?:[^`<]*<)?([^`>]+)>?`")
# A file or folder of the repository named as code in the text, outside the role.
PLAIN = re.compile(
    r"(?<!\{repo\})`((?:benchmarks|tests|tools|slurm|src|_ext)/[\w./-]*|README\.md|"
    r"CONTRIBUTING\.md|CHANGELOG\.md|Makefile|pyproject\.toml|requirements\.txt|CITATION\.cff|"
    r"_config\.yml|_toc\.yml)`"
)


def render(text: str, repository_url: str = "", srcdir: Path = ROOT):
    """The doctree of ``text`` (reStructuredText) with the role, as a book whose
    html_theme_options name ``repository_url`` and whose sources are in ``srcdir``."""
    roles.register_local_role("repo", repository_links.repo_role)
    env = SimpleNamespace(
        srcdir=str(srcdir),
        docname="page",
        config=SimpleNamespace(
            html_theme_options={"repository_url": repository_url, "repository_branch": "main"}
        ),
    )
    return publish_doctree(text, settings_overrides={"env": env, "report_level": 5})


def test_without_a_repository_the_path_is_shown_as_code_without_a_link():
    for url in ("", "https://github.com/executablebooks/jupyter-book"):  # JB's own default
        tree = render("See :repo:`benchmarks/README.md`.", url)
        assert not list(tree.findall(lambda n: n.tagname == "reference"))
        (literal,) = tree.findall(lambda n: n.tagname == "literal")
        assert literal.astext() == "benchmarks/README.md"


def test_with_a_repository_files_and_folders_link_to_it():
    url = "https://github.com/some-org/dp-from-scratch"
    tree = render(
        "See :repo:`benchmarks/README.md`, :repo:`benchmarks` and "
        ":repo:`the trainer <src/dpcourse/practice/train.py>`.",
        url,
    )
    links = [(n["refuri"], n.astext()) for n in tree.findall(lambda n: n.tagname == "reference")]
    assert links == [
        (f"{url}/blob/main/benchmarks/README.md", "benchmarks/README.md"),
        (f"{url}/tree/main/benchmarks", "benchmarks"),
        (f"{url}/blob/main/src/dpcourse/practice/train.py", "the trainer"),
    ]


def test_the_repository_is_found_above_an_edition_built_under_build(tmp_path):
    assert repository_links.repository_root(ROOT / "_build" / "full" / "chapters") == ROOT
    assert repository_links.repository_root(tmp_path) is None


def test_a_path_outside_the_repository_is_an_error():
    tree = render(":repo:`../etc/passwd`")
    assert list(tree.findall(lambda n: n.tagname == "problematic"))


def markdown_of(path: Path) -> str:
    if path.suffix == ".md":
        return path.read_text()
    cells = json.loads(path.read_text())["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.name)
def test_the_text_names_the_repositorys_files_through_the_role_and_they_exist(path):
    text = markdown_of(path)
    plain = sorted(set(PLAIN.findall(text)))
    assert not plain, (
        f"{path.name} names {plain} as plain code: write {{repo}}`path` so that it links to "
        "the repository where _config.yml names one"
    )
    missing = [p for p in REPO_ROLE.findall(text) if not (ROOT / p.strip()).exists()]
    assert not missing, f"{path.name}: {{repo}} names {missing}, which do not exist"


def test_the_book_loads_the_role():
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    assert "repository_links" in config["sphinx"]["local_extensions"]
