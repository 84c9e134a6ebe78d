"""Searching the course website, offline too (issue 34, item 6).

Loaded by `_config.yml` (`sphinx: local_extensions`). What a reader found, and what this does:

* **Two search boxes on every page** (three on the search page): pydata-sphinx-theme puts its
  search button in the header bar (`navbar_persistent`) as well as the one sphinx-book-theme
  puts at the top of the sidebar. The header's goes; the search page keeps its own form only.
* **Results without a snippet**: Sphinx shows the text around the word found by fetching each
  result's page, which a browser refuses for pages opened from disk (`file://`), so the site
  had `html_show_search_summary: false`. Here the text of every page (its prose and code, not
  the cells' outputs, in its sections, with its glossary terms) is written into
  `_static/page_texts.js` when the site is built, and the search page answers Sphinx's fetch of
  a page from it: snippets, offline and online alike, from about half a megabyte loaded by the
  search page alone.
* **The glossary several times under one name**: each glossary term that matches is a result
  titled with its page's title alone ("B. Glossary", "B. Glossary", ...). A result that is an
  index entry (a glossary term) is titled "B. Glossary > all-reduce", as Sphinx titles a result
  that is a section of a page.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from docutils import nodes
from sphinx.builders.html._assets import _JavaScript

STATIC = Path(__file__).parent / "static"
TEXTS = "page_texts.js"
SKIPPED = (nodes.raw, nodes.image, nodes.comment, nodes.system_message)


def no_header_search(app, config):
    """The header bar's search button goes (the sidebar's stays)."""
    config.html_theme_options = dict(config.html_theme_options or {}, navbar_persistent=[])


def _is_output(node) -> bool:
    return isinstance(node, nodes.container) and node.get("nb_element") in (
        "cell_code_output", "mime_bundle")


def _text(node: nodes.Element) -> str:
    """The text of ``node`` without its sub-sections, outputs, raw HTML and images."""
    parts = []
    for child in node.children:
        if isinstance(child, nodes.section) or isinstance(child, SKIPPED) or _is_output(child):
            continue
        if isinstance(child, nodes.Text):
            parts.append(child.astext())
        elif isinstance(child, nodes.Element):
            parts.append(_text(child))
    return " ".join(p for p in parts if p.strip())


def _terms(node: nodes.Element) -> str:
    """Each glossary term as an element of its own id, so that a result for the term shows the
    term's definition (Sphinx looks the anchor up in the page)."""
    out = []
    for item in node.findall(nodes.definition_list_item):
        terms = [t for t in item.findall(nodes.term) if t.get("ids")]
        if not terms:
            continue
        definition = " ".join(d.astext() for d in item.findall(nodes.definition))
        for term in terms:
            body = html.escape(f"{term.astext()}: {definition}")
            out.append(f'<div id="{html.escape(term["ids"][0])}">{body}</div>')
    return "".join(out)


def _section_html(section: nodes.Element) -> str:
    ids = section.get("ids") or [""]
    inner = html.escape(_text(section)) + "".join(
        _section_html(s) for s in section.children if isinstance(s, nodes.section))
    return f'<section id="{html.escape(ids[0])}">{inner}</section>'


def collect_text(app, doctree, docname):
    if app.builder.format != "html":
        return
    top = [s for s in doctree.children if isinstance(s, nodes.section)]
    body = "".join(_section_html(s) for s in top) or html.escape(doctree.astext())
    page = f'<div role="main">{body}{_terms(doctree)}</div>'
    texts = app.builder.__dict__.setdefault("dpcourse_page_texts", {})
    texts[docname + app.builder.out_suffix] = page


def write_texts(app, exception):
    texts = getattr(app.builder, "dpcourse_page_texts", None)
    if exception is not None or texts is None:
        return
    target = Path(app.outdir) / "_static" / TEXTS
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("window.DPCOURSE_PAGE_TEXTS = " + json.dumps(texts, sort_keys=True)
                      + ";\n")


def search_page(app, pagename, templatename, context, doctree):
    if pagename != "search":
        return
    scripts = context.get("script_files")
    if isinstance(scripts, list):  # the theme writes them relative to the page
        scripts.append(_JavaScript(f"_static/{TEXTS}"))
        scripts.append(_JavaScript("_static/search_results.js"))


def setup(app):
    app.connect("config-inited", no_header_search)
    app.connect("doctree-resolved", collect_text)
    app.connect("build-finished", write_texts)
    app.connect("html-page-context", search_page)
    return {"parallel_read_safe": True, "parallel_write_safe": False}
