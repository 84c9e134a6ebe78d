"""The course to be had from the website: the package's wheel and every notebook in one archive.

A learner who reads the website and wants to run a chapter needs the notebook and the ``dpcourse``
package it imports. The build writes both into the site, under ``downloads/``:

* ``dpcourse-<version>-py3-none-any.whl``: the package, built from the repository's sources by
  setuptools' backend (what ``python -m build --wheel`` runs), with ``index.html`` beside it, a
  page that links it, so that ``pip install --no-index --find-links <site>/downloads/index.html
  dpcourse`` installs it from the site (the install cell does that where ``_config.yml`` names
  the site's address, ``html.baseurl``);
* ``data-parallelism-from-scratch.zip``: one folder holding every notebook of this edition of the
  book (outputs cleared: the full website's with the solutions, the student website's without),
  the wheel beside them and a ``README.txt`` saying how to run them. Each notebook's first cell
  installs the wheel it finds beside itself (``tools/install_cell.py``), so the archive runs with
  no network where torch and the package's three needs (numpy, matplotlib, cloudpickle) are
  installed (``tests/test_packaging.py`` runs chapter 1 from it so, in a network namespace).

Every page's download menu offers the archive and the wheel next to the page's own notebook, and
``{course-file}`archive` `` or ``{course-file}`wheel` `` links them from a page's text (the page
"Run it on your machine"). Issue 45: the code can be had from the site.

Chapter 0: the course's tooling (the website).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from docutils import nodes
from sphinx.util import logging

logger = logging.getLogger(__name__)

FOLDER = "downloads"  # in the built site
ARCHIVE_NAME = "data-parallelism-from-scratch"
# What the wheel is built from: the package's sources and the files pyproject.toml names.
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "LICENSE-CC-BY-4.0.txt")

README = """\
Data Parallelism from Scratch: the course's notebooks ({edition}) and its package.

1. Have Python 3.10 or newer with PyTorch 2.11 to 2.13, numpy, matplotlib and cloudpickle
   (Colab and Kaggle have them; elsewhere: pip install torch numpy matplotlib cloudpickle),
   and Jupyter (pip install jupyterlab).
2. Open the notebooks from this folder (jupyter lab, or upload a notebook and {wheel} together).
3. Run each notebook from the top: its first cell installs the package from {wheel}, which sits
   beside the notebooks, without touching the torch you have (pip install --no-deps), and does
   nothing where dpcourse is installed already. No network is needed for that.

Or install it yourself first: pip install --no-deps {wheel}
The website's page "Run it on your machine" says what the course chooses on each machine.
"""


def repository_root(start: str | Path) -> Path:
    """The folder at or above ``start`` that holds ``pyproject.toml`` and ``src/dpcourse`` (the
    editions are built from copies under ``_build/``, inside the repository)."""
    for folder in (Path(start).resolve(), *Path(start).resolve().parents):
        if (folder / "pyproject.toml").is_file() and (folder / "src" / "dpcourse").is_dir():
            return folder
    raise FileNotFoundError(f"no repository of the course (pyproject.toml, src/dpcourse) at or "
                            f"above {start}")


def copy_package_sources(root: Path, dest: Path) -> Path:
    """Copy what the package is built from (``src/``, ``pyproject.toml`` and the files it names)
    from ``root`` into ``dest``, so that a build leaves no ``build/`` or ``*.egg-info`` in the
    working tree; returns ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in SOURCES:
        shutil.copy2(root / name, dest / name)
    shutil.copytree(root / "src", dest / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    return dest


def build_wheel(root: Path, out: Path) -> Path:
    """The package's wheel, built from a copy of ``root``'s sources by setuptools' backend with
    this interpreter (no network: the build isolation of ``pip wheel`` would fetch setuptools),
    written into ``out``; returns its path."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src = copy_package_sources(root, Path(tmp) / "src")
        backend = "import sys; from setuptools import build_meta as b; b.build_wheel(sys.argv[1])"
        built = Path(tmp) / "dist"
        result = subprocess.run([sys.executable, "-c", backend, str(built)], cwd=src,
                                capture_output=True, text=True)
        if result.returncode:
            raise RuntimeError(f"building dpcourse's wheel failed:\n{result.stdout}{result.stderr}")
        (wheel,) = built.glob("dpcourse-*.whl")
        return Path(shutil.copy2(wheel, out / wheel.name))


def cleared(notebook: dict) -> dict:
    """The notebook without outputs or execution counts (what a learner runs)."""
    for cell in notebook.get("cells", []):
        if cell.get("cell_type") == "code":
            cell["outputs"], cell["execution_count"] = [], None
    return notebook


def write_archive(notebooks: list[Path], wheel: Path, out: Path, edition: str) -> Path:
    """``out`` (a .zip): one folder named after the course holding ``notebooks`` (outputs
    cleared), ``wheel`` and a README; returns ``out``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    top = ARCHIVE_NAME
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for path in notebooks:
            text = json.dumps(cleared(json.loads(path.read_text())), indent=1,
                              ensure_ascii=False) + "\n"
            archive.writestr(f"{top}/{path.name}", text)
        archive.write(wheel, f"{top}/{wheel.name}")
        archive.writestr(f"{top}/README.txt", README.format(edition=edition, wheel=wheel.name))
    return out


def index_page(wheel: Path, title: str) -> str:
    """A page linking the wheel and the archive: what ``pip install --find-links <this page>``
    reads, and a page of the site like the others (its title names the book, its favicon)."""
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>Downloads - {title}</title>"
            "<link rel=\"icon\" href=\"../_static/favicon.png\">"
            "<style>body{font-family:sans-serif;margin:2em}li{margin:0.8em 0}"
            "a{display:inline-block;padding:0.3em 0}</style></head><body>\n"
            f"<h1>Downloads: {title}</h1>\n<ul>\n"
            f"<li><a href=\"{ARCHIVE_NAME}.zip\">{ARCHIVE_NAME}.zip</a>: every notebook of the "
            "course with the package's wheel</li>\n"
            f"<li><a href=\"{wheel.name}\">{wheel.name}</a>: the package alone "
            "(pip install --no-deps)</li>\n</ul>\n</body></html>\n")


def write_downloads(srcdir: Path, outdir: Path, edition: str,
                    title: str = "Data Parallelism from Scratch") -> dict[str, Path]:
    """The wheel, its index page and the archive of ``srcdir/chapters``'s notebooks, written into
    ``outdir/downloads``; ``{"wheel": ..., "archive": ...}``."""
    folder = Path(outdir) / FOLDER
    if folder.exists():
        shutil.rmtree(folder)
    wheel = build_wheel(repository_root(srcdir), folder)
    (folder / "index.html").write_text(index_page(wheel, title))
    notebooks = sorted((Path(srcdir) / "chapters").glob("*.ipynb"))
    archive = write_archive(notebooks, wheel, folder / f"{ARCHIVE_NAME}.zip", edition)
    return {"wheel": wheel, "archive": archive}


# Sphinx: the files, written before the pages (whose links test_links.py follows), the download
# menu's entries and the role.


def book_title(app) -> str:
    """The book's title, as Jupyter Book gives it to Sphinx (``_config.yml``'s ``title``)."""
    return app.config.html_title or app.config.project


def edition_of(app) -> str:
    return ("student edition, without solutions" if "student" in book_title(app).lower()
            else "with solutions")


def write_site_downloads(app) -> None:
    if app.builder.format != "html":
        return
    try:
        repository_root(app.srcdir)
    except FileNotFoundError:  # a book outside the course's repository (a test's fixture)
        logger.info("course_download: no repository of the course here, so no downloads")
        app.env.dpcourse_downloads = {}
        return
    app.env.dpcourse_downloads = {
        kind: path.name
        for kind, path in write_downloads(Path(app.srcdir), Path(app.outdir), edition_of(app),
                                          book_title(app)).items()
    }


def downloads_of(app) -> dict[str, str]:
    """The file names written for this build (the wheel's carries the version)."""
    names = getattr(app.env, "dpcourse_downloads", None)
    if names is None:
        # import here: only where the build wrote no files (a role before builder-inited)
        from dpcourse import __version__  # noqa: PLC0415

        names = {"wheel": f"dpcourse-{__version__}-py3-none-any.whl",
                 "archive": f"{ARCHIVE_NAME}.zip"}
    return names


def add_to_download_menu(app, pagename, templatename, context, doctree) -> None:
    """The theme's download menu (the page's .ipynb, .md, .pdf) also offers the course."""
    names = downloads_of(app)
    if not names:
        return
    root = context["pathto"]("", 1).rstrip("/")
    for group in context.get("header_buttons", []):
        if group.get("label") != "download-buttons":
            continue
        group["buttons"][1:1] = [
            {"type": "link", "url": f"{root}/{FOLDER}/{names['archive']}",
             "text": "course .zip", "icon": "fas fa-file-zipper",
             "tooltip": "Download the course: every notebook with the dpcourse package",
             "label": "download-course-button"},
            {"type": "link", "url": f"{root}/{FOLDER}/{names['wheel']}",
             "text": "dpcourse .whl", "icon": "fas fa-box",
             "tooltip": "Download the dpcourse package (a wheel: pip install --no-deps FILE)",
             "label": "download-wheel-button"},
        ]


def course_file_role(name, rawtext, text, lineno, inliner, options=None, content=None):
    """``{course-file}`archive` `` or ``{course-file}`wheel` ``: a link to that download, its file
    name shown as code; ``{course-file}`the archive <archive>` `` shows the words instead."""
    env = inliner.document.settings.env
    match = re.fullmatch(r"(?s)(?P<title>.+?)\s*<(?P<kind>\w+)>", text.strip())
    title, kind = (match["title"], match["kind"]) if match else (None, text.strip())
    names = downloads_of(env.app)
    if kind not in names:
        msg = inliner.reporter.error(
            f"{{course-file}} takes one of {sorted(names)}; got {kind!r}", line=lineno)
        return [inliner.problematic(rawtext, rawtext, msg)], [msg]
    up = "../" * env.docname.count("/")
    shown = nodes.literal(names[kind], names[kind]) if title is None else nodes.inline(title, title)
    return [nodes.reference(rawtext, "", shown, refuri=f"{up}{FOLDER}/{names[kind]}")], []


def setup(app):
    app.connect("builder-inited", write_site_downloads)
    app.connect("html-page-context", add_to_download_menu, priority=600)
    app.add_role("course-file", course_file_role)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
