"""The website's extensions of issue 45, without building the site: _ext/course_download.py (the
wheel and the course's archive, offered in every page's download menu) and _ext/machine_paths.py
(outputs name files from site-packages/ or src/, not from the build machine's folders).
tests/test_site.py checks the built sites; tests/test_packaging.py runs the archive offline."""

from __future__ import annotations

import importlib.util
import json
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "_ext" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


course_download = load("course_download")
machine_paths = load("machine_paths")


def test_the_archive_holds_the_notebooks_cleared_the_wheel_and_how_to_run_them(tmp_path):
    notebook = {"cells": [{"cell_type": "code", "execution_count": 3, "id": "a", "metadata": {},
                           "outputs": [{"output_type": "stream", "name": "stdout", "text": "x"}],
                           "source": "print('x')"}], "metadata": {}, "nbformat": 4,
                "nbformat_minor": 5}
    (tmp_path / "01_one.ipynb").write_text(json.dumps(notebook))
    wheel = tmp_path / "dpcourse-9.9.9-py3-none-any.whl"
    wheel.write_bytes(b"not really a wheel")
    out = course_download.write_archive([tmp_path / "01_one.ipynb"], wheel, tmp_path / "c.zip",
                                        "with solutions")
    with zipfile.ZipFile(out) as archive:
        top = course_download.ARCHIVE_NAME
        assert sorted(archive.namelist()) == sorted(
            [f"{top}/01_one.ipynb", f"{top}/{wheel.name}", f"{top}/README.txt"])
        cell = json.loads(archive.read(f"{top}/01_one.ipynb"))["cells"][0]
        assert cell["outputs"] == [] and cell["execution_count"] is None
        readme = archive.read(f"{top}/README.txt").decode()
    assert wheel.name in readme and "pip install --no-deps" in readme
    assert f'href="{wheel.name}"' in course_download.index_page(wheel, "A Book")


def test_every_pages_download_menu_offers_the_course_and_the_wheel():
    class App:
        class env:  # noqa: N801 - a stand-in for Sphinx's
            dpcourse_downloads = {"wheel": "dpcourse-1.0-py3-none-any.whl",
                                  "archive": "data-parallelism-from-scratch.zip"}

    menu = {"label": "download-buttons", "buttons": [{"label": "ipynb"}, {"label": "pdf"}]}
    context = {"header_buttons": [menu], "pathto": lambda name, kind: "../"}
    course_download.add_to_download_menu(App, "chapters/x", "page.html", context, None)
    assert [b["label"] for b in menu["buttons"]] == [
        "ipynb", "download-course-button", "download-wheel-button", "pdf"]
    assert menu["buttons"][1]["url"] == "../downloads/data-parallelism-from-scratch.zip"
    assert menu["buttons"][2]["url"] == "../downloads/dpcourse-1.0-py3-none-any.whl"


def test_outputs_name_files_as_a_reader_knows_them():
    shorten = machine_paths.without_machine_paths
    assert shorten("[rank 1] /home/ci/.venv/lib/python3.11/site-packages/torch/nn/x.py:143: "
                   "UserWarning") == "[rank 1] site-packages/torch/nn/x.py:143: UserWarning"
    assert shorten('  File "/srv/book/src/dpcourse/ddp/ddp.py", line 3') == (
        '  File "src/dpcourse/ddp/ddp.py", line 3')
    assert shorten("of binary: /work/main/.venv/bin/python") == "of binary: .venv/bin/python"
    assert shorten("/tmp/ipykernel_812/4711.py:3: UserWarning") == "<cell>:3: UserWarning"
    for kept in ("resumed from /tmp/ckpt/step-4", "a ratio 1/2 of /x", "https://x.org/a/src/y"):
        assert shorten(kept) == kept
