"""Build the docs site and check every page in headless Chromium.

    python docs/check_site.py [--chromium PATH] [--screenshots DIR]

Builds the site with `mkdocs build --strict` into a temporary folder, serves it on
localhost, opens every page in headless Chromium (through Playwright, with the system's
Chromium: no browser download) and fails on

- a broken image (an `<img>` that did not load: `naturalWidth` 0),
- a broken internal link (a same-site `href` that does not answer 200, or whose
  `#fragment` names no element `id` on the target page),
- a JavaScript error (an uncaught exception, or an error on the console, which includes
  resources that failed to load).

It prints one line per page and exits 1 if any page has a problem. Without Chromium
(Debian package `chromium`, or `--chromium PATH`) it prints "skipped: chromium not found"
and exits 0, or exits 1 with `--require-browser` (what CI passes: a check that looked at
nothing must not pass). Needs `pip install -e ".[docs]"` (mkdocs and playwright).
"""

from __future__ import annotations

import argparse
import functools
import shutil
import subprocess
import sys
import tempfile
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from html.parser import HTMLParser
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urldefrag

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
SHOTS = {"index.html": "home.png", "results/index.html": "results.png"}

IMAGES_JS = """() => Array.from(document.images).map(i => ({src: i.currentSrc || i.src,
    ok: i.complete && i.naturalWidth > 0}))"""
LINKS_JS = "() => Array.from(document.querySelectorAll('a[href]')).map(a => a.href)"


@dataclass
class PageReport:
    """What one page showed: counts, and every problem found."""

    path: str
    images: int = 0
    links: int = 0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class _Ids(HTMLParser):
    """Collects every `id` (and `name`) attribute of a page: the fragments it answers."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.ids.update(v for k, v in attrs if k in ("id", "name") and v)


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def find_chromium(given: str | None) -> str | None:
    """The Chromium to drive: `--chromium`, else the first of CHROMIUM_NAMES on PATH."""
    if given:
        return given if Path(given).is_file() else None
    return next((found for name in CHROMIUM_NAMES if (found := shutil.which(name))), None)


def build(site: Path) -> None:
    """`mkdocs build --strict` into `site`; a failed build stops the check."""
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(site)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"mkdocs build --strict failed:\n{done.stdout}{done.stderr}")


def serve(site: Path) -> tuple[ThreadingHTTPServer, str]:
    """Serve `site` on a free localhost port from a daemon thread; returns the server and its base URL."""
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


class LinkChecker:
    """Fetches each same-site URL once, and remembers its status and the ids it holds."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.seen: dict[str, tuple[int, set[str]]] = {}

    def fetch(self, url: str) -> tuple[int, set[str]]:
        if url not in self.seen:
            try:
                with urllib.request.urlopen(url, timeout=30) as response:
                    status, body, kind = response.status, response.read(), response.headers.get_content_type()
            except urllib.error.HTTPError as err:
                status, body, kind = err.code, b"", ""
            ids = _Ids()
            if kind == "text/html":
                ids.feed(body.decode("utf-8", "replace"))
            self.seen[url] = (status, ids.ids)
        return self.seen[url]

    def problems(self, href: str) -> list[str]:
        """What is wrong with one link (nothing for an external one)."""
        if not href.startswith(self.base):
            return []
        url, fragment = urldefrag(href)
        status, ids = self.fetch(url)
        name = href[len(self.base) - 1 :]
        if status != 200:
            return [f"broken link {name}: HTTP {status}"]
        if fragment and unquote(fragment) not in ids:
            return [f"broken link {name}: no element with id {unquote(fragment)!r}"]
        return []


def _counts(msg) -> bool:
    """A console error counts, except the browser's "Failed to load resource" line, which names no
    URL: the request and response handlers report those loads, with their URL."""
    return msg.type == "error" and not msg.text.startswith("Failed to load resource")


def _failed(url: str, why: object, base: str, errors: list[str], report: PageReport, ok: bool = False) -> None:
    """A resource that did not load: a problem on the site itself, a note elsewhere (the check may run
    offline, and the site's pages must not depend on other sites)."""
    if ok:
        return
    if url.startswith(base):
        errors.append(f"resource not loaded {url[len(base) - 1 :]}: {why}")
    else:
        report.notes.append(f"external resource not loaded {url}: {why}")


def check_page(page, url: str, report: PageReport, links: LinkChecker, shot: Path | None) -> None:
    """Load one page in the browser and record its broken images, links and JS errors."""
    errors: list[str] = []
    page.on("pageerror", lambda err: errors.append(f"JavaScript error: {err}"))
    page.on("console", lambda msg: errors.append(f"console error: {msg.text}") if _counts(msg) else None)
    page.on("requestfailed", lambda req: _failed(req.url, req.failure, links.base, errors, report))
    page.on("response", lambda res: _failed(res.url, f"HTTP {res.status}", links.base, errors, report, res.ok))
    response = page.goto(url, wait_until="load")
    if response is None or response.status != 200:
        report.problems.append(f"page answered {response.status if response else 'nothing'}")
    page.wait_for_timeout(300)  # let deferred scripts run and report
    images = page.evaluate(IMAGES_JS)
    report.images = len(images)
    report.problems += [f"broken image {img['src']}" for img in images if not img["ok"]]
    hrefs = sorted(set(page.evaluate(LINKS_JS)))
    report.links = sum(href.startswith(links.base) for href in hrefs)
    for href in hrefs:
        report.problems += links.problems(href)
    if shot is not None:
        page.screenshot(path=str(shot), full_page=True)
    report.problems += errors


def check_site(site: Path, base: str, chromium: str, shots: Path | None) -> list[PageReport]:
    """Open every page of the built site (each `*.html` but the 404 page) in one browser."""
    from playwright.sync_api import sync_playwright

    pages = sorted(p.relative_to(site).as_posix() for p in site.rglob("*.html") if p.name != "404.html")
    links = LinkChecker(base)
    reports = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, headless=True)
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        for path in pages:
            report = PageReport(path)
            page = context.new_page()
            shot = shots / SHOTS[path] if shots is not None and path in SHOTS else None
            check_page(page, base + path, report, links, shot)
            page.close()
            reports.append(report)
        browser.close()
    return reports


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chromium", help="path of the Chromium executable (default: chromium on PATH)")
    parser.add_argument("--screenshots", type=Path, help="save full-page PNGs of the home and results pages here")
    parser.add_argument(
        "--require-browser", action="store_true", help="fail (exit 1) instead of skipping when Chromium is not found"
    )
    args = parser.parse_args(argv)
    chromium = find_chromium(args.chromium)
    if chromium is None:
        missing = "chromium not found (install the Debian package `chromium`, or pass --chromium PATH)"
        if args.require_browser:
            print(f"error: {missing}; --require-browser was given", file=sys.stderr)
            return 1
        print(f"skipped: {missing}")
        return 0
    try:
        import playwright  # noqa: F401
    except ImportError:
        sys.exit('playwright is not installed: pip install -e ".[docs]" (or pip install playwright)')
    if args.screenshots is not None:
        args.screenshots.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="vasepatch-site-") as tmp:
        site = Path(tmp)
        build(site)
        server, base = serve(site)
        try:
            reports = check_site(site, base, chromium, args.screenshots)
        finally:
            server.shutdown()
    for r in reports:
        print(f"{'FAIL' if r.problems else 'ok  '} {r.path:<48} images {r.images:>2}  internal links {r.links:>3}")
        for problem in r.problems:
            print(f"       {problem}")
        for note in r.notes:
            print(f"       note: {note}")
    bad = sum(bool(r.problems) for r in reports)
    print(f"{len(reports)} pages checked with {chromium}: {bad} with problems")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
