"""Launch buttons (Colab, Binder, a JupyterHub) only where the book names its repository.

Jupyter Book 1 fills in ``repository.url`` with its own repository when ``_config.yml`` names
none, and sphinx-book-theme would then point every launch button at that repository's notebooks
(or warn, for a host it cannot split into owner and name). Where no repository of ours is named,
this extension turns the launch buttons off, so the pages keep only the download button; where
one is, the buttons ``_config.yml``'s ``launch_buttons`` lists open this book's notebooks.
Issue 33: the book builds with -W either way (``tests/test_launch_buttons.py``).
"""

from __future__ import annotations

# What Jupyter Book puts in repository.url when _config.yml names no repository.
JUPYTER_BOOKS_OWN = "github.com/executablebooks/jupyter-book"


def names_a_repository(url: str | None) -> bool:
    """Whether ``url`` is a repository of this book's (not empty, not Jupyter Book's default)."""
    return bool(url) and JUPYTER_BOOKS_OWN not in url


def drop_launch_buttons_without_a_repository(app, config) -> None:
    options = config.html_theme_options
    if not names_a_repository(options.get("repository_url")):
        options["launch_buttons"] = {}
        for button in ("use_repository_button", "use_issues_button", "use_edit_page_button"):
            options[button] = False


def setup(app):
    app.connect("config-inited", drop_launch_buttons_without_a_repository, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
