"""The first code cell of every chapter notebook: install `dpcourse` where it is missing.

On Colab, Kaggle or a bare Jupyter a notebook opened on its own finds no `dpcourse`. The cell
this tool writes installs it, without its dependency on torch (`--no-deps`, so that the torch the
machine came with, a CUDA build, stays), from the first of these that there is:

1. a wheel `dpcourse-*.whl` beside the notebook: the course's archive, which every page of the
   website offers for download, holds one next to the notebooks (`_ext/course_download.py`);
   this needs no network;
2. the website, where `_config.yml` names its address (`html: baseurl:`): the site serves the
   wheel under `downloads/`;
3. the repository, where `_config.yml` names one (`repository: url:`);

and otherwise stops with what to do. Then it installs, by name, those of the package's other
needs (numpy, matplotlib, cloudpickle) that do not import. Where `dpcourse` imports (a clone after
`make`, CI) the cell does nothing.

The cell is the same in every notebook, written from one template here:

    python tools/install_cell.py          # write (or update) the cell in every chapter notebook
    python tools/install_cell.py --check  # exit 1 if a notebook's cell differs

`tests/test_notebook_files.py` checks that every notebook has it, unchanged, as its first code
cell. Run the tool again after naming the site or the repository in `_config.yml`.

Chapter 0: the course's tooling (running the notebooks on any machine).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import yaml

try:
    import tomllib  # Python 3.11 and later
except ModuleNotFoundError:  # 3.10: the copy pip vendors
    from pip._vendor import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
CELL_ID = "install-dpcourse"
# Hidden behind a toggle on the website: it is the same on every page and does nothing there.
TAGS = ["hide-cell"]

TEMPLATE = '''\
# Colab, Kaggle, the course's archive or a bare Jupyter: install the
# course's package if it is missing, keeping the machine's torch (the page
# "Run it on your machine" says more). Where it is installed: nothing.
try:
    import dpcourse  # noqa: F401
except ImportError:
    import importlib.util
    import subprocess
    import sys
    from pathlib import Path

    SITE = "{site}"  # _config.yml's html.baseurl (tools/install_cell.py)
    REPOSITORY = "{repository}"  # _config.yml's repository.url
    # The course's archive has the package's wheel beside the notebooks.
    wheels = sorted(Path.cwd().glob("dpcourse-*.whl"))
    if wheels:
        package = [str(wheels[-1])]
    elif SITE:
        index = f"{{SITE.rstrip('/')}}/downloads/index.html"
        package = ["--no-index", "--find-links", index, "dpcourse"]
    elif REPOSITORY:
        package = [f"dpcourse @ git+{{REPOSITORY}}"]
    else:
        raise ImportError(
            "dpcourse is not installed, and this notebook has no wheel "
            "beside it. Download the course from any page of its website "
            "(the download menu's 'course .zip': every notebook with the "
            "package's wheel), unpack it and open this notebook from there; "
            "or put the website's 'dpcourse .whl' beside this notebook. In a "
            "clone of the course: pip install -e . ; to keep an installed "
            "torch: pip install --no-deps -e . && "
            "pip install {needs}"
        ) from None
    pip = [sys.executable, "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, "--no-deps", *package], check=True)
    missing = [name for name in ({needs_list},)
               if importlib.util.find_spec(name) is None]
    if missing:  # Colab and Kaggle have them all
        subprocess.run([*pip, *missing], check=True)
    importlib.invalidate_caches()
    import dpcourse  # noqa: F401
'''


def _config() -> dict:
    return yaml.safe_load((ROOT / "_config.yml").read_text())


def repository() -> str:
    """The repository's URL that `_config.yml` names ("" when none is)."""
    return ((_config().get("repository") or {}).get("url") or "").strip()


def site() -> str:
    """The website's address that `_config.yml` names (`html: baseurl:`; "" when none is)."""
    return ((_config().get("html") or {}).get("baseurl") or "").strip()


def needs() -> list[str]:
    """The package's runtime needs other than torch, by name: `pyproject.toml`'s dependencies (no
    extras), read from the file, so that this also works where dpcourse is not installed but put
    on PYTHONPATH (make gpu-check on a machine without the network)."""
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = [re.split(r"[\s<>=!~;\[(]", dep, maxsplit=1)[0] for dep in requires]
    return [name for name in names if name != "torch"]


def cell_source() -> str:
    """The cell's source, as every notebook must have it."""
    names = needs()
    return TEMPLATE.format(site=site(), repository=repository(), needs=" ".join(names),
                           needs_list=", ".join(f'"{name}"' for name in names)).rstrip("\n")


def notebooks() -> list[Path]:
    """Every chapter notebook."""
    return sorted((ROOT / "chapters").glob("*.ipynb"))


def _lines(source: str) -> list[str]:
    lines = source.split("\n")
    return [line + "\n" for line in lines[:-1]] + [lines[-1]]


def update(path: Path, check: bool) -> bool:
    """Write the cell into ``path`` (before its first code cell, or in place of an older one);
    True if the notebook was, or (``check``) would be, changed."""
    notebook = json.loads(path.read_text())
    cells = notebook["cells"]
    cell = {"cell_type": "code", "execution_count": None, "id": CELL_ID,
            "metadata": {"tags": TAGS}, "outputs": [], "source": _lines(cell_source())}
    old = [i for i, c in enumerate(cells) if c.get("id") == CELL_ID]
    if old:
        if cells[old[0]] == cell:
            return False
        cells[old[0]] = cell
    else:
        first_code = next(i for i, c in enumerate(cells) if c["cell_type"] == "code")
        cells.insert(first_code, cell)
    if not check:
        path.write_text(json.dumps(notebook, indent=1, ensure_ascii=False) + "\n")
    return True


def main(argv: list[str] | None = None) -> int:
    """Write the cell into every chapter notebook, or (--check) report those that differ."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 on a diff")
    args = parser.parse_args(argv)
    changed = [path.name for path in notebooks() if update(path, args.check)]
    verb = "differ" if args.check else "updated"
    print(f"{len(changed)} notebook(s) {verb}: {', '.join(changed) or '-'}")
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
