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
* the browser tab names the course.

A failing page is saved as a screenshot under _build/browser-test/, named in the failure. The
last test builds a small fixture page (an animation, a widget, a formula) with the book's own
configuration and checks that these checks pass on it and catch each kind of breakage.

Without Chromium these tests skip and say how to get it (`.ci/run` installs it on CI). Set
DPCOURSE_CHROMIUM to use another Chromium or Chrome binary.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

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
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)  # Chromium's own process group
                self.proc.wait()


# The checks that run inside each page, once it has loaded (an async function of {title}).
PAGE_CHECKS = (Path(__file__).parent / "browser_checks.js").read_text()


def check_page(browser: Chromium, url: str) -> tuple[list[str], dict]:
    """Open one page and return (its problems, what it counted)."""
    browser.open(url)
    result = browser.evaluate(f"({PAGE_CHECKS})({json.dumps({'title': TITLE})})")
    browser.evaluate("0")  # let the events logged until now arrive
    problems = list(result["problems"])
    problems += [f"tried to reach the network: {u}" for u in dict.fromkeys(browser.blocked)]
    problems += browser.console_errors()
    return problems, result["counts"]


def fail_with_screenshot(browser: Chromium, name: str, problems: list[str]) -> None:
    shot = browser.screenshot(SCREENSHOTS / (re.sub(r"[^\w.-]+", "__", name) + ".png"))
    listed = "\n".join(f"  - {p}" for p in problems)
    pytest.fail(f"{name}: {len(problems)} problems in the browser:\n{listed}\nscreenshot: {shot}")


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    chromium = Chromium(CHROMIUM, tmp_path_factory.mktemp("chromium"))
    yield chromium
    chromium.close()


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
    problems, _ = check_page(browser, page.as_uri())
    if problems:
        fail_with_screenshot(browser, str(page.relative_to(ROOT / "_build")), problems)


def test_math_is_typeset_by_the_sites_own_mathjax(browser):
    page = HTML / "chapters" / "01_single_device.html"
    problems, counts = check_page(browser, page.as_uri())
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


def _fixture_notebook(path: Path) -> None:
    """A notebook with saved outputs: a formula, a matplotlib JS animation and an ipywidget."""
    import ipywidgets
    import nbformat
    from ipywidgets.embed import embed_data
    from matplotlib.animation import FuncAnimation
    from matplotlib.figure import Figure

    fig = Figure(figsize=(3, 2), dpi=40)
    ax = fig.add_subplot()
    (line,) = ax.plot([0, 1], [0, 0])
    ax.set_ylim(0, 3)
    anim = FuncAnimation(fig, lambda i: line.set_ydata([0, i]), frames=3, interval=100)
    # As a chapter shows it. Its link to Font Awesome on a CDN is dropped by _ext/offline_site.py.
    animation = anim.to_jshtml()
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
    nb.cells = [
        nbformat.v4.new_markdown_cell("# Fixture\n\nA formula: $\\sum_{r=0}^{N-1} g_r / N$."),
        nbformat.v4.new_code_cell(
            "anim",
            outputs=[out("display_data", data={"text/html": animation, "text/plain": "anim"})],
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
}


def test_the_checks_pass_on_a_page_with_an_animation_and_a_widget(browser, fixture_site):
    problems, counts = check_page(browser, fixture_site.as_uri())
    if problems:
        fail_with_screenshot(browser, "fixture", problems)
    assert counts["animations"] == 1 and counts["widgets"] == 1 and counts["formulas"] >= 1, counts
    drawn = browser.evaluate(
        """[!!document.querySelector('.widget-subarea .widget-slider'),
            !!document.querySelector('.widget-subarea .widget-label mjx-container'),
            !!document.querySelector('.widget-subarea button svg, .widget-subarea button i')]"""
    )
    assert drawn == [True, True, True], f"slider, its label's math, the button's icon: {drawn}"


@pytest.mark.parametrize("breakage", list(BREAKAGES))
def test_the_checks_catch(browser, fixture_site, breakage):
    mutate, expected = BREAKAGES[breakage]
    slug = re.sub(r"\W+", "-", breakage)
    broken = fixture_site.with_name(f"broken-{slug}.html")
    broken.write_text(mutate(fixture_site.read_text()))
    problems, _ = check_page(browser, broken.as_uri())
    assert any(expected in p for p in problems), f"{breakage}: expected {expected!r} in {problems}"
