"""Links to the course's files: ``{repo}`benchmarks/README.md` `` in a page's text.

Where ``_config.yml`` names the repository the book is published from (``repository.url``),
the role links the file there (``<url>/blob/<branch>/<path>``, ``/tree/`` for a folder) and
shows its path as code; where it names none (as now), it shows the path as code without a link,
as ``launch_buttons.py`` leaves the launch buttons off: Jupyter Book would otherwise fill in its
own repository. ``{repo}`the benchmarks' notes <benchmarks/README.md>` `` shows the words
instead of the path.

Either way the path must exist in the repository the book is built in (the nearest folder above
the book's sources that holds ``.git``; the editions are built from copies under ``_build/``), so
that a file that moves or is renamed breaks the build (-W) instead of leaving a dead reference.
Issue 34: references to the repository's files are links where the book names its repository.
"""

from __future__ import annotations

import re
from pathlib import Path

from docutils import nodes
from sphinx.util import logging

logger = logging.getLogger(__name__)

# What Jupyter Book puts in repository.url when _config.yml names no repository
# (launch_buttons.py turns the launch buttons off in that case, for the same reason).
JUPYTER_BOOKS_OWN = "github.com/executablebooks/jupyter-book"
_TITLED = re.compile(r"^(?P<title>.+?)\s*<(?P<path>[^<>]+)>$", re.S)


def repository_root(srcdir: str | Path) -> Path | None:
    """The working tree the book is built in: the nearest folder at or above ``srcdir`` that
    holds ``.git`` (a folder, or a file in a worktree); None outside one."""
    for folder in (Path(srcdir).resolve(), *Path(srcdir).resolve().parents):
        if (folder / ".git").exists():
            return folder
    return None


def file_url(repository: str, branch: str, path: str, is_dir: bool) -> str:
    """The page of ``path`` in a GitHub-style repository at ``branch``."""
    return f"{repository.rstrip('/')}/{'tree' if is_dir else 'blob'}/{branch}/{path.strip('/')}"


def repo_role(name, rawtext, text, lineno, inliner, options=None, content=None):
    env = inliner.document.settings.env
    match = _TITLED.match(text)
    title, path = (match["title"], match["path"].strip()) if match else (None, text.strip())
    messages = []
    root = repository_root(env.srcdir)
    target = root / path if root else None
    if path.startswith(("/", "..")) or "://" in path:
        msg = inliner.reporter.error(
            f"{{repo}} takes a path inside the repository, such as benchmarks/README.md; "
            f"got {path!r}",
            line=lineno,
        )
        return [inliner.problematic(rawtext, rawtext, msg)], [msg]
    if target is not None and not target.exists():
        logger.warning(
            "{repo}`%s`: no such file or folder in the repository (%s): fix the path",
            path, root, location=(env.docname, lineno),
        )
    shown = nodes.literal(path, path) if title is None else nodes.inline(title, title)
    options = env.config.html_theme_options
    url = options.get("repository_url") or ""
    if url and JUPYTER_BOOKS_OWN not in url:
        branch = options.get("repository_branch") or "main"
        is_dir = path.endswith("/") or (target is not None and target.is_dir())
        link = nodes.reference(rawtext, "", shown, refuri=file_url(url, branch, path, is_dir))
        link["classes"].append("repository-file")
        return [link], messages
    shown["classes"].append("repository-file")
    return [shown], messages


def setup(app):
    app.add_role("repo", repo_role)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
