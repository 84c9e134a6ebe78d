"""Internal links of the built website: every link, image, script and stylesheet a page names
exists in the site, every #anchor exists on its page, and nothing is loaded from the network.

Checks the files, without a browser (tests/test_browser.py opens the pages). Links to other
sites (http, https, mailto) are not followed: the course is read offline. The student site is
checked too when it is built.
"""

from __future__ import annotations

import os
import re
from functools import cache
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[1]
HTML = ROOT / "_build" / "html"
STUDENT_HTML = ROOT / "_build" / "student" / "_build" / "html"

if not (HTML / "index.html").exists():
    if os.environ.get("DPCOURSE_REQUIRE_SITE"):
        raise RuntimeError(f"{HTML / 'index.html'} is missing: `make book` did not build the site")
    pytest.skip("the book is not built: run `make book` first", allow_module_level=True)

SITES = [HTML] + ([STUDENT_HTML] if (STUDENT_HTML / "index.html").exists() else [])
EXTERNAL = ("http:", "https:", "mailto:", "tel:", "javascript:", "data:", "ftp:")
# (tag, attribute) pairs that name another file; those marked True are loaded with the page.
LINKING = {
    ("a", "href"): False,
    ("area", "href"): False,
    ("link", "href"): True,
    ("img", "src"): True,
    ("script", "src"): True,
    ("iframe", "src"): True,
    ("source", "src"): True,
    ("video", "src"): True,
    ("video", "poster"): True,
    ("audio", "src"): True,
    ("embed", "src"): True,
    ("object", "data"): True,
}


class Page(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[tuple[str, str, bool]] = []  # (tag, url, loaded with the page)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        for key in ("id", "name") if tag == "a" else ("id",):
            if attrs.get(key):
                self.ids.add(attrs[key])
        for (t, attr), loaded in LINKING.items():
            if t == tag and attrs.get(attr):
                rel = (attrs.get("rel") or "").split()
                if tag == "link" and not {"stylesheet", "icon", "preload", "shortcut"} & set(rel):
                    loaded = False  # rel=index, search, next, prev...: navigation
                self.links.append((tag, attrs[attr].strip(), loaded))
        if tag == "img" and attrs.get("srcset"):
            for candidate in attrs["srcset"].split(","):
                if candidate.strip():
                    self.links.append((tag, candidate.split()[0], True))
        if tag == "meta" and (attrs.get("http-equiv") or "").lower() == "refresh":
            match = re.search(r"url=(.+)$", attrs.get("content") or "", re.IGNORECASE)
            if match:
                self.links.append(("meta", match.group(1).strip("'\" "), False))


@cache
def parse(path: Path) -> Page:
    page = Page()
    page.feed(path.read_text(errors="replace"))
    return page


def pages(site: Path) -> list[Path]:
    return sorted(
        p
        for p in site.rglob("*.html")
        if not {"_static", "reports"} & set(p.relative_to(site).parts)
    )


def broken_links(site: Path, path: Path) -> list[str]:
    problems = []
    for tag, url, _ in parse(path).links:
        if url.lower().startswith(EXTERNAL) or url.startswith("//") or url == "#":
            continue
        parts = urlsplit(url)
        target = path if not parts.path else (path.parent / unquote(parts.path)).resolve()
        if target.is_dir():
            target = target / "index.html"
        if not target.is_relative_to(site.resolve()):
            problems.append(f"<{tag}> {url}: outside the site")
        elif not target.is_file():
            problems.append(f"<{tag}> {url}: no such file")
        elif parts.fragment and target.suffix == ".html":
            if unquote(parts.fragment) not in parse(target).ids:
                problems.append(f"<{tag}> {url}: no #{unquote(parts.fragment)} in {target.name}")
    return problems


PAGES = [
    pytest.param(
        site,
        p,
        id=f"{'student' if site == STUDENT_HTML else 'book'}/{p.relative_to(site).as_posix()}",
    )
    for site in SITES
    for p in pages(site)
]


@pytest.mark.parametrize(("site", "path"), PAGES)
def test_internal_links_and_anchors_resolve(site, path):
    problems = broken_links(site, path)
    assert not problems, (
        f"{path.relative_to(site)}: {len(problems)} broken links:\n  "
        + "\n  ".join(dict.fromkeys(problems))
    )


@pytest.mark.parametrize(("site", "path"), PAGES)
def test_pages_load_nothing_from_the_network(site, path):
    remote = [
        f"<{tag}> {url}"
        for tag, url, loaded in parse(path).links
        if loaded and (url.lower().startswith(("http:", "https:")) or url.startswith("//"))
    ]
    assert not remote, f"{path.relative_to(site)} loads from the network: {remote}"


def test_the_site_is_complete():
    """The pages readers expect exist and link each other: the appendix, search, downloads."""
    intro = parse(HTML / "chapters" / "intro.html")
    hrefs = {url.split("#")[0] for _, url, _ in intro.links}
    for page in ("glossary.html", "bibliography.html", "01_single_device.html", "../search.html"):
        assert page in hrefs, f"the intro does not link {page}"
    chapter = parse(HTML / "chapters" / "01_single_device.html")
    downloads = [url for _, url, _ in chapter.links if url.endswith(".ipynb")]
    assert downloads, "chapter 1 has no download button for its notebook"
    glossary = parse(HTML / "chapters" / "glossary.html").ids
    for term in ("all-reduce", "bucket", "rank", "world-size", "shard"):
        assert f"term-{term}" in glossary, f"the glossary lacks {term}"
    citations = [url for _, url, _ in intro.links if url.startswith("bibliography.html#")]
    assert citations, "the intro cites nothing"


def toc_chapters() -> list[str]:
    import yaml

    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [c["file"] for part in toc.get("parts", []) for c in part.get("chapters", [])]
    return [f for f in files if re.fullmatch(r"chapters/\d\d_\w+", f)]


@pytest.mark.parametrize("name", toc_chapters())
def test_chapter_is_numbered_with_objectives_a_download_and_a_place_on_the_map(name):
    path = HTML / f"{name}.html"
    html = path.read_text()
    title = re.sub(r"<[^>]+>", "", re.search(r"<h1>(.*?)</h1>", html, re.DOTALL).group(1))
    number = int(Path(name).name[:2])
    assert title.startswith(f"{number}. "), f"{name}: the title {title!r} is not numbered {number}"
    assert "Learning objectives" in html, f"{name} states no learning objectives"
    links = [url for _, url, _ in parse(path).links]
    assert f"../_sources/{name}.ipynb" in links, f"{name} has no download button for its notebook"
    intro = [url for _, url, _ in parse(HTML / "chapters" / "intro.html").links]
    assert f"{Path(name).name}.html" in intro, f"the course map in intro.ipynb does not link {name}"
