"""Sphinx fixes that keep the course website working offline and free of console errors.

Loaded by `_config.yml` (`sphinx: local_extensions`). Three things:

* matplotlib's JS animations (`Animation.to_jshtml()`, `rcParams["animation.html"] = "jshtml"`)
  ask a CDN for Font Awesome 4, for the icons of their buttons. The site already serves Font
  Awesome (the theme's, which knows the same icon names), so the link is dropped from the page:
  the animation then plays, icons and all, with the network closed.
* Sphinx 7.4 writes every inline script that an extension registered (`add_js_file(None,
  body=...)`) twice, and the second copy of sphinx-thebe's `const THEBE_JS_URL = ...` is a
  SyntaxError in the console of every page. Each page keeps one copy of each script.
* Pages with saved ipywidgets get a few lines before `embed-amd.js`: where its icon fonts are
  (it finds them from the require.js paths of its modules, which would otherwise point at
  `@jupyter-widgets/...` next to the page), and
  the MathJax 2 call the widgets make to typeset their labels (`MathJax.Hub.Queue`), passed on
  to MathJax 3, which the site uses (with Jupyter's `$...$` for inline math in labels).
"""

from __future__ import annotations

import re

from docutils import nodes
from sphinx.builders.html._assets import _JavaScript

FONT_AWESOME_FROM_CDN = re.compile(
    r'<link\s+rel="stylesheet"\s+href="https?://[^"]*font-awesome[^"]*"\s*/?>\s*'
)


def drop_cdn_icon_fonts(app, doctree, docname):
    for raw in list(doctree.findall(nodes.raw)):
        if "html" not in raw.get("format", "").split():
            continue
        html = raw.astext()
        if FONT_AWESOME_FROM_CDN.search(html):
            html = FONT_AWESOME_FROM_CDN.sub("", html)
            raw.replace_self(nodes.raw(html, html, format=raw["format"]))


def one_copy_of_each_script(app, pagename, templatename, context, doctree):
    scripts = context.get("script_files")
    if not isinstance(scripts, list):
        return
    seen, unique = set(), []
    for js in scripts:
        key = (
            getattr(js, "filename", js) or "",
            getattr(js, "priority", None),
            tuple(sorted(getattr(js, "attributes", {}).items())),
        )
        if key not in seen:
            seen.add(key)
            unique.append(js)
    scripts[:] = unique


WIDGETS_SETUP = """\
(function () {
  var here = new URL("%s", document.baseURI).href;  // ends with "/"
  window.__jupyter_widgets_assets_path__ = here;
  window.require.config({paths: {
    "@jupyter-widgets/html-manager": here + "html-manager",
    "@jupyter-widgets/html-manager/dist": here.slice(0, -1)
  }});
})();
document.addEventListener("DOMContentLoaded", function () {
  var mj = window.MathJax;
  if (!mj || !mj.version || mj.Hub || !mj.typesetPromise) return;
  // Widget labels write math between single dollars, as in Jupyter: make it \\(...\\) first.
  function dollars(node) {
    if (node.nodeType === 3) {
      node.nodeValue = node.nodeValue.replace(/\\$([^$]+)\\$/g, "\\\\($1\\\\)");
    } else {
      Array.prototype.forEach.call(node.childNodes, dollars);
    }
  }
  mj.Hub = {Queue: function () {
    Array.prototype.forEach.call(arguments, function (job) {
      if (Array.isArray(job) && job[0] === "Typeset" && job[2]) {
        dollars(job[2]);
        mj.startup.promise = mj.startup.promise.then(function () {
          return mj.typesetPromise([job[2]]);
        });
      }
    });
  }};
});"""


def set_up_widgets(app, pagename, templatename, context, doctree):
    scripts = context.get("script_files")
    if not isinstance(scripts, list):
        return
    for i, js in enumerate(scripts):
        if (getattr(js, "filename", "") or "").endswith("widgets/embed-amd.js"):
            where = context["pathto"]("_static/widgets/", 1)
            scripts.insert(i, _JavaScript(None, body=WIDGETS_SETUP % where, priority=js.priority))
            return


def setup(app):
    app.connect("doctree-resolved", drop_cdn_icon_fonts)
    app.connect("html-page-context", one_copy_of_each_script, priority=900)
    app.connect("html-page-context", set_up_widgets, priority=901)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
