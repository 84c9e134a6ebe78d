"""_ext/launch_buttons.py: launch buttons only where _config.yml names the book's repository
(issue 33). Jupyter Book fills in its own repository otherwise, and the buttons would open its
notebooks. The built pages' buttons are checked by tests/browser_checks.js and tests/test_site.py.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import yaml

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("launch_buttons", ROOT / "_ext" / "launch_buttons.py")
launch_buttons = importlib.util.module_from_spec(spec)
spec.loader.exec_module(launch_buttons)

LAUNCH = {"colab_url": "https://colab.research.google.com", "binderhub_url": "https://mybinder.org"}


def configured(repository_url: str) -> dict:
    config = SimpleNamespace(html_theme_options={
        "repository_url": repository_url, "launch_buttons": dict(LAUNCH),
        "use_repository_button": True})
    launch_buttons.drop_launch_buttons_without_a_repository(None, config)
    return config.html_theme_options


def test_no_repository_no_launch_buttons():
    for url in ("", "https://github.com/executablebooks/jupyter-book"):  # the latter: JB's default
        options = configured(url)
        assert options["launch_buttons"] == {} and options["use_repository_button"] is False


def test_a_named_repository_keeps_them():
    options = configured("https://github.com/some-org/dp-from-scratch")
    assert options["launch_buttons"] == LAUNCH and options["use_repository_button"] is True


def test_the_book_asks_for_colab_and_binder_and_loads_the_guard():
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    assert config["launch_buttons"]["colab_url"] and config["launch_buttons"]["binderhub_url"]
    assert "launch_buttons" in config["sphinx"]["local_extensions"]
    assert config["html"]["use_download_button"] is True
