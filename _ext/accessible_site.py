"""Accessibility fixes for the course website (issue 33; tests/test_browser.py runs axe-core).

Loaded by `_config.yml` (`sphinx: local_extensions`). What it mends:

* Text alternatives of what a cell draws. myst-nb gives a cell's PNG output the alt text in the
  cell's metadata, `"mystnb": {"image": {"alt": "..."}}`; the same text is written here where
  myst-nb does not: into matplotlib's JS animation (`to_jshtml`: an <img> without alt, whose
  frame slider has no label either) and, for a saved ipywidget, onto its view's <script>
  (`data-alt`), from which a small script (WIDGETS_A11Y) copies it onto the images the widget
  draws. That script also names each widget slider after its label: ipywidgets' handles
  (role="slider") have no accessible name.
* Folded cells: myst-nb's <summary aria-label="Toggle hidden content"> hides the visible "Show code
  cell content" from speech input (WCAG 2.5.3, axe's label-content-name-mismatch): the aria-label
  goes, and the summary is named by what it shows.
* The bibliography: docutils puts role="doc-biblioentry" (deprecated since ARIA 1.3) inside
  role="list", which must hold listitems (axe's aria-required-children): they become listitems.
* The theme's search button and colour-mode switch (templates/, copies of pydata-sphinx-theme
  0.17's components): their icons and the "Ctrl+K" hint are hidden from assistive technology,
  so the accessible name is what the button says; the shortcut is given by aria-keyshortcuts.
"""

from __future__ import annotations

import html
import re
from pathlib import Path

from docutils import nodes
from sphinx.builders.html._assets import _JavaScript

TEMPLATES = Path(__file__).parent / "templates"

ANIMATION_IMAGE = re.compile(r'<img id="(_anim_img[0-9a-f]+)"')
ANIMATION_SLIDER = re.compile(r'(<input id="_anim_slider[0-9a-f]+" type="range")')
WIDGET_VIEW = '<script type="application/vnd.jupyter.widget-view+json"'


def figure_alt(cell: nodes.Element) -> str | None:
    """The alt text a code cell's metadata gives its figures, if any."""
    metadata = cell.get("cell_metadata") or {}
    alt = ((metadata.get("mystnb") or {}).get("image") or {}).get("alt")
    return alt.strip() if isinstance(alt, str) and alt.strip() else None


def label_drawn_figures(app, doctree, docname):
    for cell in doctree.findall(nodes.container):
        if cell.get("nb_element") != "cell_code":
            continue
        alt = figure_alt(cell)
        for raw in list(cell.findall(nodes.raw)):
            if "html" not in raw.get("format", "").split():
                continue
            text = new = raw.astext()
            new = ANIMATION_SLIDER.sub(r'\1 aria-label="Frame of the animation"', new)
            if alt:
                quoted = html.escape(alt, quote=True)
                new = ANIMATION_IMAGE.sub(rf'<img id="\1" alt="{quoted}"', new)
                new = new.replace(WIDGET_VIEW, f'{WIDGET_VIEW} data-alt="{quoted}"')
            if new != text:
                raw.replace_self(nodes.raw(new, new, format=raw["format"]))


# Where the page has saved widgets: once they are drawn (and whenever they draw again), each
# slider handle is named by its widget's label, and the images a view draws get its data-alt.
WIDGETS_A11Y = """\
document.addEventListener("DOMContentLoaded", function () {
  var views = 'script[type="application/vnd.jupyter.widget-view+json"]';
  var count = 0, pending = false;
  function label() {
    pending = false;
    document.querySelectorAll('.widget-subarea [role="slider"]:not([aria-labelledby])')
      .forEach(function (handle) {
        var widget = handle.closest(".jupyter-widgets");
        var name = widget && widget.querySelector(".widget-label");
        if (!name || !name.textContent.trim()) return;
        name.id = name.id || "dpcourse-widget-label-" + (++count);
        handle.setAttribute("aria-labelledby", name.id);
      });
    document.querySelectorAll(views + "[data-alt]").forEach(function (view) {
      var area = view.previousElementSibling;
      if (!area || !area.classList.contains("widget-subarea")) return;
      area.querySelectorAll("img:not([alt])").forEach(function (img) {
        img.alt = view.getAttribute("data-alt");
      });
    });
  }
  new MutationObserver(function () {
    if (!pending) { pending = true; setTimeout(label, 0); }
  }).observe(document.body, {childList: true, subtree: true});
  label();
});"""


def mend_page(app, pagename, templatename, context, doctree):
    body = context.get("body")
    if isinstance(body, str):
        body = body.replace('<summary aria-label="Toggle hidden content">', "<summary>")
        body = body.replace('role="doc-biblioentry"', 'role="listitem"')
        context["body"] = body
        scripts = context.get("script_files")
        if WIDGET_VIEW in body and isinstance(scripts, list):
            scripts.append(_JavaScript(None, body=WIDGETS_A11Y))


def use_templates(app, config):
    config.templates_path.insert(0, str(TEMPLATES))


def setup(app):
    app.connect("config-inited", use_templates)
    app.connect("doctree-resolved", label_drawn_figures)
    app.connect("html-page-context", mend_page)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
