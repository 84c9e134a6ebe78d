"""The built website in a real browser, with the network closed.

One headless Chromium, driven over the DevTools protocol, opens every page of the built site from
disk (file://, as a learner who opens `_build/html/index.html` does) while every request to the
network fails. On each page:

* no TeX is left unrendered: every formula went through MathJax (served by the site itself),
  without a MathJax error;
* every image loads, and so do the favicon and the fonts the page asks for;
* every animation shows (matplotlib's JS animations: all frames loaded, the controls drawn, the
  slider moves through the frames; videos: playable) and every saved ipywidget is drawn;
* nothing was fetched from the network, and the console shows no error;
* the browser tab names the course;
* every image has a text alternative that says something (not a file name or "image"), and a
  figure's (a cell's image output, an animation) says what it shows (browser_checks.js);
* no display equation runs past its column (cut off, or scrolling sideways), and no figure shows
  its smallest text under MIN_FIGURE_TEXT_PX: the size its notebook's kernel recorded in the PNG
  (dpcourse.harness.figure_text), times the scale the page draws the PNG at; every figure's
  measurement is written to _build/browser-test/figure-text.json; nor a figure whose kernel found
  a legend over its data or its text, or a text cut by its edge (recorded in the PNG too);
* axe-core (vendored by tools/vendor_assets.sh) finds no serious or critical violation of the
  WCAG 2.0-2.2 A and AA rules or axe's best practices (AXE_OPTIONS) on a page of the book website
  (and of the student website with DPCOURSE_AXE_STUDENT=1); rules turned off are in AXE_RULES_OFF,
  each with the reason. Every page's violations, of every impact, are written to
  _build/browser-test/axe.json.

A failing page is saved as a screenshot under _build/browser-test/, named in the failure. The
last test builds a small fixture page (an animation, a widget, a formula) with the book's own
configuration and checks that these checks pass on it and catch each kind of breakage.

Without Chromium these tests skip and say how to get it (`.ci/run` installs it on CI). Set
DPCOURSE_CHROMIUM to use another Chromium or Chrome binary.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest
import yaml
from matplotlib.figure import Figure

from dpcourse.harness import figure_text

ROOT = Path(__file__).resolve().parents[1]
HTML = ROOT / "_build" / "html"
STUDENT_HTML = ROOT / "_build" / "student" / "_build" / "html"
SCREENSHOTS = ROOT / "_build" / "browser-test"
CONFIG = yaml.safe_load((ROOT / "_config.yml").read_text())
TITLE = CONFIG["title"]

if not (HTML / "index.html").exists():
    if os.environ.get("DPCOURSE_REQUIRE_SITE"):
        raise RuntimeError(f"{HTML / 'index.html'} is missing: `make book` did not build the site")
    pytest.skip("the book is not built: run `make book` first", allow_module_level=True)

websocket = pytest.importorskip(
    "websocket", reason="the browser test needs websocket-client: pip install -r requirements.txt"
)

HOW_TO_GET_CHROMIUM = (
    "headless Chromium was not found, so the website was not tested in a browser. Install it "
    "(Debian/Ubuntu: `sudo apt-get install chromium`; Fedora: `sudo dnf install chromium`; "
    "macOS: install Google Chrome) or set DPCOURSE_CHROMIUM to a Chromium or Chrome binary"
)


def find_chromium() -> str | None:
    candidates = [os.environ.get("DPCOURSE_CHROMIUM", "")]
    candidates += [
        shutil.which(name) or ""
        for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
    ]
    candidates.append("/Applications/Google Chrome.app/Contents/MacOS/Google Chrome")
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


CHROMIUM = find_chromium()
if CHROMIUM is None:
    pytest.skip(HOW_TO_GET_CHROMIUM, allow_module_level=True)


def site_pages(site: Path) -> list[Path]:
    """Every HTML page of a built site, but index.html (a redirect to the intro)."""
    skip = {"_static", "_sources", "_images", "reports"}
    return sorted(
        p
        for p in site.rglob("*.html")
        if not skip & set(p.relative_to(site).parts) and p.relative_to(site) != Path("index.html")
    )


class BrowserError(RuntimeError):
    pass


class Chromium:
    """One headless Chromium and one tab in it, driven over the DevTools protocol.

    Requests to http(s) are failed before they leave the browser (and host names do not
    resolve), so a page that needs the network shows it; each blocked URL is recorded.
    """

    def __init__(self, executable: str, workdir: Path):
        profile = workdir / "profile"
        profile.mkdir(parents=True)
        self._log_path = workdir / "chromium.log"
        flags = [
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-extensions",
            "--disable-default-apps",
            "--no-first-run",
            "--no-default-browser-check",
            "--mute-audio",
            "--hide-scrollbars",
            "--host-resolver-rules=MAP * ~NOTFOUND",
            "--window-size=1300,900",  # a laptop; outputs must fit (browser_checks.js)
            f"--user-data-dir={profile}",
            "--remote-debugging-port=0",
            "about:blank",
        ]
        with open(self._log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [executable, *flags], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            self._connect(profile / "DevToolsActivePort")
        except BaseException:
            self.close()
            raise

    def _connect(self, port_file: Path) -> None:
        deadline = time.monotonic() + 60
        while True:
            lines = port_file.read_text().splitlines() if port_file.exists() else []
            if len(lines) >= 2:
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self._log_path.read_text(errors="replace")[-2000:]
                raise BrowserError(
                    f"Chromium did not start (exit code {self.proc.poll()}):\n{tail}"
                )
            time.sleep(0.05)
        port, path = lines[0], lines[1]
        self.ws = websocket.create_connection(
            f"ws://127.0.0.1:{port}{path}", timeout=60, suppress_origin=True
        )
        self._id = 0
        self.events: list[dict] = []
        self.blocked: list[str] = []
        target = self.call("Target.createTarget", url="about:blank", session=None)["targetId"]
        self.session = self.call(
            "Target.attachToTarget", targetId=target, flatten=True, session=None
        )["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable")
        self.call("Fetch.enable", patterns=[{"urlPattern": "http*"}])

    def _send(self, method: str, params: dict, session: str | None) -> int:
        self._id += 1
        message = {"id": self._id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        self.ws.send(json.dumps(message))
        return self._id

    def _receive(self, timeout: float) -> dict:
        self.ws.settimeout(max(timeout, 0.01))
        message = json.loads(self.ws.recv())
        if message.get("method") == "Fetch.requestPaused":
            # The network is closed: fail every http(s) request, and remember what was asked for.
            params = message["params"]
            self.blocked.append(params["request"]["url"])
            self._send(
                "Fetch.failRequest",
                {"requestId": params["requestId"], "errorReason": "InternetDisconnected"},
                message.get("sessionId"),
            )
        elif "method" in message:
            self.events.append(message)
        return message

    def call(self, method: str, timeout: float = 30.0, session: str | None = "tab", **params):
        session = self.session if session == "tab" else session
        call_id = self._send(method, params, session)
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BrowserError(f"{method}: no answer from Chromium in {timeout:.0f} s")
            try:
                message = self._receive(remaining)
            except websocket.WebSocketTimeoutException:
                continue
            if message.get("id") == call_id:
                if "error" in message:
                    raise BrowserError(f"{method}: {message['error'].get('message')}")
                return message.get("result", {})

    def open(self, url: str, timeout: float = 30.0) -> None:
        """Load a page and wait for its load event (from a blank page: no events of the last)."""
        if url != "about:blank":
            self.open("about:blank")
        self.events.clear()
        self.blocked.clear()
        result = self.call("Page.navigate", url=url)
        if result.get("errorText"):
            raise BrowserError(f"{url} did not open: {result['errorText']}")
        deadline = time.monotonic() + timeout
        while not any(e["method"] == "Page.loadEventFired" for e in self.events):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BrowserError(f"{url} did not finish loading in {timeout:.0f} s")
            try:
                self._receive(remaining)
            except websocket.WebSocketTimeoutException:
                pass

    def evaluate(self, expression: str, timeout: float = 60.0):
        result = self.call(
            "Runtime.evaluate",
            expression=expression,
            awaitPromise=True,
            returnByValue=True,
            timeout=timeout,
        )
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            raise BrowserError(f"the page check itself failed: {text}")
        return result["result"].get("value")

    def console_errors(self) -> list[str]:
        """Errors the page logged, threw or met loading a resource, since it was opened."""
        errors = []
        for event in self.events:
            method, params = event["method"], event.get("params", {})
            if method == "Runtime.exceptionThrown":
                details = params["exceptionDetails"]
                text = details.get("exception", {}).get("description") or details.get("text")
                errors.append(f"uncaught exception: {text.splitlines()[0] if text else '?'}")
            elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                words = [str(a.get("value", a.get("description", ""))) for a in params["args"]]
                errors.append(f"console.{params['type']}: {' '.join(words)[:300]}")
            elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
                entry = params["entry"]
                where = f" ({entry['url']})" if entry.get("url") else ""
                errors.append(f"console error: {entry.get('text', '')[:300]}{where}")
        return list(dict.fromkeys(errors))

    def screenshot(self, path: Path) -> Path:
        """The whole page (up to 8000 CSS pixels tall) as a PNG."""
        size = self.call("Page.getLayoutMetrics")["cssContentSize"]
        clip = {
            "x": 0,
            "y": 0,
            "width": size["width"],
            "height": min(size["height"], 8000),
            "scale": 1,
        }
        data = self.call(
            "Page.captureScreenshot", format="png", clip=clip, captureBeyondViewport=True
        )["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        try:
            if getattr(self, "ws", None):
                try:
                    self._send("Browser.close", {}, None)
                except Exception:
                    pass
                self.ws.close()
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        finally:
            # Chromium's own process group, also when the process started has exited: Debian's
            # /usr/bin/chromium is a wrapper script, and browser processes under it were found
            # running after it had gone.
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # the whole group has exited
            self.proc.wait()


# The checks that run inside each page, once it has loaded (an async function of {title}).
PAGE_CHECKS = (Path(__file__).parent / "browser_checks.js").read_text()

# Accessibility: axe-core runs in each page after the checks above (MathJax has typeset, the
# widgets are drawn), on the rules of these tags; a violation whose impact is in AXE_FAILS_ON
# fails the page. tools/vendor_assets.sh (`make vendor`, run by `make book` and `make test`)
# fetches axe.min.js; the site itself does not serve it.
AXE = ROOT / "_vendor" / "test" / "axe-core" / "axe.min.js"
AXE_TAGS = ["wcag2a", "wcag2aa", "wcag21a", "wcag21aa", "wcag22aa", "best-practice"]
AXE_FAILS_ON = ("critical", "serious")
# Rules turned off, each with the reason (markup of a third-party part that we cannot mend). None:
# what axe found in the theme's markup, _ext/accessible_site.py and _ext/templates/ mend.
AXE_RULES_OFF: dict[str, str] = {}
AXE_OPTIONS = {
    "runOnly": {"type": "tag", "values": AXE_TAGS},
    "rules": {rule: {"enabled": False} for rule in AXE_RULES_OFF},
    "resultTypes": ["violations"],  # passes and incomplete results are not needed: faster
    # Not the stylesheets again through XMLHttpRequest (for the one rule that reads CSS text,
    # css-orientation-lock): file:// pages may not, and each refusal is a console error.
    "preload": False,
}
# Code blocks are folded while axe runs on the book's pages: pygments gives every token a span of
# its own (three quarters of a chapter's elements), and axe lays out every element of the page for
# its colour-contrast, link and target-size rules; folding each block's spans into one text node
# (and putting them back after) cut axe's time on chapter 7 from 12.4 s to 3.8 s, with the same
# violations. The blocks themselves are still checked (their text colour, scrolling); the tokens'
# colours, the same stylesheet's on every page, are checked on the fixture page, unfolded.
AXE_RUN = """(async (fold, options) => {
  const folded = [];
  for (const pre of fold ? document.querySelectorAll('.highlight pre') : []) {
    const spans = document.createDocumentFragment();
    const text = pre.textContent;
    while (pre.firstChild) spans.appendChild(pre.firstChild);
    pre.textContent = text;
    folded.push([pre, spans]);
  }
  const start = Date.now();
  const result = await window.axe.run(document, options).finally(() => {
    for (const [pre, spans] of folded) pre.replaceChildren(spans);
  });
  const target = (node) => node.target.map((t) => [].concat(t).join(' >>> ')).join(' ');
  const violations = result.violations.map((v) => ({
    id: v.id, impact: v.impact, help: v.help, nodes: v.nodes.length,
    targets: v.nodes.slice(0, 3).map(target)}));
  return {version: window.axe.version, ms: Date.now() - start, violations};
})"""
# axe runs on every page of the book website, and on the student website's only with
# DPCOURSE_AXE_STUDENT=1: that site is built from the same notebooks with the same configuration,
# theme and extensions, less the solutions, and axe found the same rules violated on both (the
# before and after runs of issue 33), while running it there too doubled axe's share of the test.
AXE_STUDENT = os.environ.get("DPCOURSE_AXE_STUDENT") == "1"
# Every page's axe violations (of any impact) and time, by page: written to axe.json at the end.
AXE_RESULTS: dict[str, dict] = {}


def run_axe(browser: Chromium, fold_code: bool = True) -> dict:
    """axe-core's violations in the open page: {ms, violations: [{id, impact, help, ...}]}."""
    if not AXE.exists():
        raise BrowserError(f"{AXE} is missing: run `make vendor` (tools/vendor_assets.sh)")
    if not browser.evaluate("!!(window.axe && window.axe.run)"):
        browser.evaluate(_axe_source() + "\n;0")
    return browser.evaluate(f"({AXE_RUN})({json.dumps(fold_code)}, {json.dumps(AXE_OPTIONS)})")


def _axe_source(cache: dict = {}) -> str:  # noqa: B006 - read once
    if "source" not in cache:
        cache["source"] = AXE.read_text()
    return cache["source"]


def axe_problems(axe: dict) -> list[str]:
    problems = []
    for v in axe["violations"]:
        if v["impact"] in AXE_FAILS_ON:
            problems.append(
                f"accessibility (axe-core {v['id']}, {v['impact']}): {v['help']}: {v['nodes']} "
                f"elements, e.g. {'; '.join(v['targets'])}"
            )
    return problems


# The smallest text a figure may show on the page, in CSS pixels (the test's window is 1300 px
# wide, a laptop's, at a device pixel ratio of 1). The page's text is 16 px; 9 px is a little over
# half of it, about where a printed figure's 6-7 pt labels stand beside 11 pt text. The course
# draws no text under 9 pt, 12.5 px in the PNG at the notebooks' 100 dpi, so a figure may be shown
# at down to 72 % of its size; chapter 6's two-panel figures, once shown at about 60 % with 8-9 pt
# labels, put them at 6-7 px.
MIN_FIGURE_TEXT_PX = 9.0


def figure_text_problems(figures: list[dict]) -> tuple[list[str], list[dict]]:
    """The figures (as browser_checks.js lists them: src, shown width, what) whose smallest text
    shows under MIN_FIGURE_TEXT_PX, or that do not record it, or whose PNG records a legend over
    data or text or a text cut at the edge (issue 45); and each figure's measurement."""
    problems, measured = [], []
    for fig in figures:
        src = fig["src"]
        if src.startswith("data:"):
            png = src
        elif src.startswith("file:"):
            png = Path(unquote(urlparse(src).path)).read_bytes()
        else:
            problems.append(f"a figure is not part of the site: {src[:80]}")
            continue
        text = figure_text.read(png)
        if text.smallest_px is None or not text.width:
            problems.append(
                f"a figure does not record its smallest text ({fig['what']}): its notebook ran "
                "without tools/notebook_startup.py (make notebooks names it in PYTHONSTARTUP)"
            )
            continue
        problems += [f"{problem} ({fig['what']})" for problem in text.layout_problems]
        scale = fig["shown"] / text.width
        px = text.smallest_px * scale
        measured.append({"figure": fig["what"], "pt": text.smallest_pt, "dpi": text.dpi,
                         "width": text.width, "shown": round(fig["shown"]), "px": round(px, 2)})
        if px < MIN_FIGURE_TEXT_PX - 0.05:
            problems.append(
                f"a figure's smallest text shows at {px:.1f} px, under {MIN_FIGURE_TEXT_PX:g} px: "
                f"{text.smallest_pt:g} pt at {text.dpi:g} dpi, the figure {text.width} px wide "
                f"shown at {scale:.0%} ({fig['what']})"
            )
    return problems, measured


# Every page's figures, measured: written to figure-text.json beside axe.json.
FIGURE_TEXT: dict[str, list[dict]] = {}


def check_page(
    browser: Chromium, url: str, record: str | None = None, axe: bool = True, fold_code=True
) -> tuple[list[str], dict]:
    """Open one page and return (its problems, what it counted); with `axe`, run axe-core there
    too and record its results as `record` in AXE_RESULTS when given."""
    browser.open(url)
    result = browser.evaluate(f"({PAGE_CHECKS})({json.dumps({'title': TITLE})})")
    axe = run_axe(browser, fold_code) if axe else {"violations": []}
    browser.evaluate("0")  # let the events logged until now arrive
    problems = list(result["problems"])
    small, measured = figure_text_problems(result["figures"])
    problems += small
    problems += axe_problems(axe)
    problems += [f"tried to reach the network: {u}" for u in dict.fromkeys(browser.blocked)]
    problems += browser.console_errors()
    counts = dict(result["counts"], axe_violations=len(axe["violations"]))
    if record and "ms" in axe:
        AXE_RESULTS[record] = {"checks_ms": result["ms"], **axe}
    if record and measured:
        FIGURE_TEXT[record] = measured
    return problems, counts


def fail_with_screenshot(browser: Chromium, name: str, problems: list[str]) -> None:
    shot = browser.screenshot(SCREENSHOTS / (re.sub(r"[^\w.-]+", "__", name) + ".png"))
    listed = "\n".join(f"  - {p}" for p in problems)
    pytest.fail(f"{name}: {len(problems)} problems in the browser:\n{listed}\nscreenshot: {shot}")


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    chromium = Chromium(CHROMIUM, tmp_path_factory.mktemp("chromium"))
    yield chromium
    chromium.close()
    if AXE_RESULTS:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        report = {
            "axe-core": next(iter(AXE_RESULTS.values())).get("version"),
            "tags": AXE_TAGS,
            "rules_off": AXE_RULES_OFF,
            "fails_on": AXE_FAILS_ON,
            "pages": dict(sorted(AXE_RESULTS.items())),
        }
        (SCREENSHOTS / "axe.json").write_text(json.dumps(report, indent=1) + "\n")
    if FIGURE_TEXT:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        report = {"min_px": MIN_FIGURE_TEXT_PX, "pages": dict(sorted(FIGURE_TEXT.items()))}
        (SCREENSHOTS / "figure-text.json").write_text(json.dumps(report, indent=1) + "\n")


def page_params(site: Path, label: str) -> list:
    return [
        pytest.param(p, id=f"{label}/{p.relative_to(site).as_posix()}") for p in site_pages(site)
    ]


PAGES = page_params(HTML, "book")
if (STUDENT_HTML / "index.html").exists():
    PAGES += page_params(STUDENT_HTML, "student")


def test_the_site_has_pages_to_check():
    names = {p.values[0].relative_to(HTML).as_posix() for p in PAGES if p.id.startswith("book/")}
    assert {"chapters/intro.html", "chapters/glossary.html", "search.html"} <= names


@pytest.mark.parametrize("page", PAGES)
def test_page_works_offline(browser, page):
    name = str(page.relative_to(ROOT / "_build"))
    on_student_site = page.is_relative_to(STUDENT_HTML)
    problems, _ = check_page(
        browser, page.as_uri(), record=name, axe=AXE_STUDENT or not on_student_site
    )
    if problems:
        fail_with_screenshot(browser, name, problems)


def test_math_is_typeset_by_the_sites_own_mathjax(browser):
    page = HTML / "chapters" / "01_single_device.html"
    problems, counts = check_page(browser, page.as_uri(), axe=False)  # axe ran there already
    assert not problems, problems
    assert counts["formulas"] >= 10, counts
    src = browser.evaluate(
        "[...document.scripts].map((s) => s.src).find((s) => /mathjax/i.test(s)) || ''"
    )
    assert src.startswith("file:") and "/_static/mathjax/" in src, src


def test_search_works_offline(browser):
    browser.open((HTML / "search.html").as_uri() + "?q=all-reduce")
    found = browser.evaluate(
        """(async () => {
             for (let i = 0; i < 200; i++) {
               const hits = document.querySelectorAll('#search-results li a');
               if (hits.length) return [...hits].map((a) => a.getAttribute('href'));
               await new Promise((r) => setTimeout(r, 50));
             }
             return [];
           })()"""
    )
    assert any("glossary" in href for href in found), f"search for 'all-reduce' found {found}"
    assert not browser.blocked and not browser.console_errors()


# --- The checks themselves, on a fixture page ----------------------------------------------


# A code cell with the kinds of token the chapters' code has (keywords, names of functions, classes,
# decorators and builtins, strings, numbers, comments, operators), whose colours axe checks.
CODE_TOKENS = '''import torch.distributed as dist  # a comment


class Sharded(torch.nn.Module):
    @functools.cache
    def scale(self, x: float, *, by: int = 0x2, name=None) -> float:
        """A docstring."""
        if x is None or by not in (1, 2) and True:
            raise ValueError(f"rank {dist.get_rank()}: {x!r:>8}", "text", b"bytes", r"\\d")
        return len(x) * by @ x ** 2 // 3 % 4 - 1e-3
'''
FIXTURE_ALT = {
    "figure": "A line chart of loss against step for two runs: both fall from 2 to 0.5",
    "animation": "A line rising from 0 to 2 over three frames, the y axis from 0 to 3",
    "widget": "A slider for the number of ranks and an all-reduce button",
}


def _fixture_notebook(path: Path) -> None:
    """A notebook with saved outputs: a formula, a figure, a matplotlib JS animation and an
    ipywidget, the first three with alt text in their cells' metadata (as the chapters have)."""
    import ipywidgets
    import nbformat
    from ipywidgets.embed import embed_data
    from matplotlib.animation import FuncAnimation

    # At the notebooks' 100 dpi, its 10 pt tick labels 13.9 px in the PNG, shown at full size.
    fig = Figure(figsize=(3, 2), dpi=100)
    ax = fig.add_subplot()
    (line,) = ax.plot([0, 1], [0, 0])
    ax.set_ylim(0, 3)
    anim = FuncAnimation(fig, lambda i: line.set_ydata([0, i]), frames=3, interval=100)
    figure_text.install()  # the PNGs record their smallest text, as in the notebooks' kernels
    try:
        # As a chapter shows it. Its link to Font Awesome on a CDN is dropped by
        # _ext/offline_site.py.
        animation = anim.to_jshtml()
        png = io.BytesIO()
        fig.savefig(png, format="png")
    finally:
        figure_text.uninstall()
    assert "font-awesome" in animation
    slider = ipywidgets.IntSlider(value=4, min=1, max=8, description="ranks $N$")
    button = ipywidgets.Button(description="all-reduce", icon="check")  # icons need fonts
    widgets = embed_data(views=[ipywidgets.VBox([slider, button])])

    out = nbformat.v4.new_output
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nb.metadata["language_info"] = {"name": "python"}
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": widgets["manager_state"]}
    view = widgets["view_specs"][0]
    alt = {key: {"mystnb": {"image": {"alt": text}}} for key, text in FIXTURE_ALT.items()}
    nb.cells = [
        nbformat.v4.new_markdown_cell(
            "# Fixture\n\nA formula: $\\sum_{r=0}^{N-1} g_r / N$, and one on its own line:\n\n"
            "$$\\bar g = \\frac{1}{N} \\sum_{r=0}^{N-1} g_r$$\n\n"
            # a link on an exercise's tinted box, whose colour _ext/static/course.css darkens
            # (a real label, Exercise 1.1 as on its page: the book refuses any other)
            ":::{exercise}\n:label: ex-1-batch\n\nRead [the reference](https://example.org/).\n:::\n"
        ),
        nbformat.v4.new_code_cell(  # every kind of token a chapter's code has, for axe's contrast
            CODE_TOKENS,
            outputs=[out("stream", name="stdout", text="rank 0: 1.0\nrank 1: 2.0\n")],
        ),
        nbformat.v4.new_code_cell(
            "fig",
            outputs=[
                out(
                    "display_data",
                    data={
                        "image/png": base64.b64encode(png.getvalue()).decode(),
                        "text/plain": "<Figure size 120x80 with 1 Axes>",
                    },
                )
            ],
            metadata=alt["figure"],
        ),
        nbformat.v4.new_code_cell(
            "anim",
            outputs=[out("display_data", data={"text/html": animation, "text/plain": "anim"})],
            metadata=alt["animation"],
        ),
        nbformat.v4.new_code_cell(
            "slider",
            outputs=[
                out(
                    "display_data",
                    data={
                        "application/vnd.jupyter.widget-view+json": view,
                        "text/plain": "IntSlider(value=4)",
                    },
                )
            ],
            metadata=alt["widget"],
        ),
    ]
    nbformat.write(nb, path)


@pytest.fixture(scope="module")
def fixture_site(tmp_path_factory) -> Path:
    """The fixture notebook built with the book's own _config.yml (not executed)."""
    src = tmp_path_factory.mktemp("fixture-book")
    _fixture_notebook(src / "fixture.ipynb")
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    config["execute"] = {"execute_notebooks": "off"}
    config["exclude_patterns"] = ["_build/*"]
    config["bibtex_bibfiles"] = [str(ROOT / f) for f in config.get("bibtex_bibfiles", [])]
    for key in ("logo",):
        if key in config:
            config[key] = str(ROOT / config[key])
    if "favicon" in config.get("html", {}):
        config["html"]["favicon"] = str(ROOT / config["html"]["favicon"])
    extensions = config["sphinx"].get("local_extensions") or {}
    for name, path in extensions.items():
        extensions[name] = str(ROOT / path)
    sphinx = config["sphinx"]["config"]
    sphinx["html_static_path"] = [str(ROOT / p) for p in sphinx.get("html_static_path", [])]
    for path in sphinx["html_static_path"]:
        assert Path(path).is_dir(), f"{path} is missing: run `make book` (it fetches it)"
    (src / "_config.yml").write_text(yaml.safe_dump(config, sort_keys=False))
    (src / "_toc.yml").write_text("format: jb-book\nroot: fixture\n")
    build = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from jupyter_book.cli.main import main; sys.exit(main())",
            "build",
            str(src),
            "-W",
            "-q",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    page = src / "_build" / "html" / "fixture.html"
    assert build.returncode == 0 and page.exists(), build.stdout[-3000:] + build.stderr[-3000:]
    return page


def _break(html: str, old: str, new: str, count: int = 1) -> str:
    assert old in html, f"the fixture page has no {old!r}"
    return html.replace(old, new, count)


def _figures_with_bad_alt(html: str) -> str:
    """The figure without its alt, three copies of it with a file name, too few words and none
    for alt text, and the animation with a placeholder for one."""
    figure = re.search(r'<img[^>]* alt="A line chart[^"]*"[^>]*>', html).group(0)
    alts = ("../_images/loss.png", "Loss curves")
    copies = "".join(re.sub(r' alt="[^"]*"', f' alt="{alt}"', figure) for alt in alts)
    html = html.replace(figure, re.sub(r' alt="[^"]*"', "", figure) + copies, 1)
    return re.sub(r'(<img id="_anim_img\w+") alt="[^"]*"', r'\1 alt="animation"', html)


# 9.1's equation as it was until issue 34, on one line: on the page at 1300 px it stopped at
# "(master weights, mome".
LONG_EQUATION = (
    r"\underbrace{2\Psi}_{\text{fp16 weights}} + \underbrace{2\Psi}_{\text{fp16 gradients}}"
    r" + \underbrace{K\Psi}_{\text{optimizer}}, \qquad K = 4 + 4 + 4 = 12"
    r"\text{ (master weights, momentum, variance)},"
)


def _png_without_record() -> str:
    """A data: URI of a figure saved where figure_text is not installed (no text size in it)."""
    fig = Figure(figsize=(3, 2), dpi=100)
    fig.add_subplot().plot([0, 1], [1, 0])
    png = io.BytesIO()
    fig.savefig(png, format="png")
    return "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()


BREAKAGES = {
    "MathJax removed": (
        lambda h: re.sub(r'<script[^>]*src="[^"]*mathjax/tex-mml-chtml\.js[^"]*"></script>', "", h),
        "MathJax did not load",
    ),
    "an animation frame broken": (
        lambda h: _break(h, '"data:image/png;base64,', '"data:image/png;base64,AAAA'),
        "frames did not load",
    ),
    "animation icons from a CDN": (
        lambda h: _break(
            h,
            "</head>",
            '<link rel="stylesheet" href="https://maxcdn.bootstrapcdn'
            '.com/font-awesome/4.4.0/css/font-awesome.min.css"></head>',
        ),
        "tried to reach the network: https://maxcdn.bootstrapcdn.com/",
    ),
    "widget manager removed": (
        lambda h: re.sub(r'<script[^>]*src="[^"]*widgets/embed-amd\.js[^"]*"></script>', "", h),
        "widgets not drawn: the page lacks embed-amd.js",
    ),
    "a missing image": (
        lambda h: _break(h, "<h1>", '<img src="nowhere.png" alt=""><h1>'),
        "image did not load: nowhere.png",
    ),
    "a script error": (
        lambda h: _break(h, "</body>", "<script>undefinedFunction()</script></body>"),
        "undefinedFunction is not defined",
    ),
    "an output wider than the page": (
        lambda h: _break(
            h,
            '<article class="bd-article">',  # in the page's text, not its print-only header
            '<article class="bd-article"><div class="cell_output"><pre style="white-space: pre">'
            + "wide " * 300
            + '</pre></div><div class="cell_output"><table style="width: 3000px"><tr><td>wide'
            "</td></tr></table></div>",
        ),
        "scrolls sideways",
    ),
    "a table wider than the page": (
        lambda h: _break(
            h,
            '<article class="bd-article">',
            '<article class="bd-article"><table><tr>' + "<td>wide&nbsp;column&nbsp;text</td>" * 80
            + "</tr></table>",
        ),
        "a table scrolls sideways",
    ),
    "TeX outside MathJax's reach": (
        lambda h: _break(h, "<h1>", r"<p>single dollars: $\alpha$</p><h1>"),
        "TeX left unrendered",
    ),
    "a display equation wider than its column": (
        lambda h: _break(
            h,
            '<article class="bd-article">',
            '<article class="bd-article"><div class="math notranslate nohighlight">\\['
            + LONG_EQUATION + "\\]</div>",
        ),
        "a display equation is cut off",
    ),
    # the figure drawn at 140 px of its 300: its 10 pt (13.9 px) tick labels at 6.5 px; and a
    # figure whose PNG does not say how small its text is
    "figure text too small on the page": (
        lambda h: _break(
            re.sub(r'(<img[^>]* alt="A line chart[^"]*")', r'\1 style="width: 140px"', h, count=1),
            '<article class="bd-article">',
            f'<article class="bd-article"><div class="cell_output"><img src="'
            f'{_png_without_record()}" alt="A line falling from 1 to 0 across the whole chart, '
            'with no labels"></div>',
        ),
        (
            "a figure's smallest text shows at 6.5 px, under 9 px: 10 pt at 100 dpi, the figure "
            "300 px wide shown at 47%",
            "a figure does not record its smallest text",
        ),
    ),
    # Several breakages of one kind on one page (each page opened costs the test a second or so).
    "figures without a proper alt text": (
        lambda h: _figures_with_bad_alt(h),
        (
            "has no alt text",
            'has a placeholder for alt text: "animation"',
            'has a placeholder for alt text: "../_images/loss.png"',
            'its alt text is too short to say what it shows: "Loss curves"',
        ),
    ),
    "a field without a label, text and code without enough contrast": (
        lambda h: _break(
            _break(
                h,
                '<article class="bd-article">',
                '<article class="bd-article"><input id="unnamed">'
                '<p id="faint" style="color: #bbb">faint text</p>',
            ),
            "</head>",
            "<style>.highlight .k { color: #c8c8c8 !important }</style></head>",  # keywords
        ),
        (
            "accessibility (axe-core label, critical): Form elements must have labels: 1 elements, "
            "e.g. #unnamed",
            "accessibility (axe-core color-contrast, serious): Elements must meet minimum color "
            "contrast ratio thresholds: 7 elements, e.g. #faint; .k:nth-child(",  # and 6 keywords
        ),
    ),
}


def test_the_checks_pass_on_a_page_with_an_animation_and_a_widget(browser, fixture_site):
    problems, counts = check_page(browser, fixture_site.as_uri(), fold_code=False)
    if problems:
        fail_with_screenshot(browser, "fixture", problems)
    assert counts["animations"] == 1 and counts["widgets"] == 1 and counts["formulas"] >= 1, counts
    assert counts["figures"] == 2 and counts["display_equations"] == 1, counts
    # The alt text of the cells' metadata, on the figure (myst-nb) and the animation's frame
    # (_ext/accessible_site.py); the widget's slider is named by its label.
    named = browser.evaluate(
        """[document.querySelector('.cell_output img[src*="_images/"]').alt,
            document.querySelector('img[id^="_anim_img"]').alt,
            document.querySelector('.widget-subarea [role="slider"]')
              .getAttribute('aria-labelledby') !== null]"""
    )
    assert named == [FIXTURE_ALT["figure"], FIXTURE_ALT["animation"], True], named
    drawn = browser.evaluate(
        """[!!document.querySelector('.widget-subarea .widget-slider'),
            !!document.querySelector('.widget-subarea .widget-label mjx-container'),
            !!document.querySelector('.widget-subarea button svg, .widget-subarea button i')]"""
    )
    assert drawn == [True, True, True], f"slider, its label's math, the button's icon: {drawn}"


@pytest.mark.parametrize("breakage", list(BREAKAGES))
def test_the_checks_catch(browser, fixture_site, breakage):
    mutate, expected = BREAKAGES[breakage]
    expected = (expected,) if isinstance(expected, str) else expected
    slug = re.sub(r"\W+", "-", breakage)
    broken = fixture_site.with_name(f"broken-{slug}.html")
    broken.write_text(mutate(fixture_site.read_text()))
    # axe only where the breakage is one for axe to find: the page checks' own are found without.
    axe = any(e.startswith("accessibility (axe-core") for e in expected)
    problems, _ = check_page(browser, broken.as_uri(), axe=axe, fold_code=False)
    missed = [e for e in expected if not any(e in p for p in problems)]
    assert not missed, f"{breakage}: expected {expected!r} in {problems}"
