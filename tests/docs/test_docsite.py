"""The documentation site (mkdocs.yml): built strictly and offline, then read in headless Chromium.

The build runs `mkdocs build --strict` in a subprocess whose HTTP(S) proxies point at a closed port,
so a plugin that fetched anything (fonts, social cards, inventories) would fail the build. The
built site is served from 127.0.0.1 (as `mkdocs serve` does: the search index is fetched by the
page, which a file:// URL does not allow) and opened in the system's Chromium (tests/kit/browser.py).
Where HOOKSCOPE_REQUIRE names `docs` and `browser` (the main environment of scripts/test-all), a
missing builder or browser fails; elsewhere these tests skip.
"""

from __future__ import annotations

import functools
import inspect
import os
import re
import subprocess
import sys
import threading
import time
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from browser import chromium, severe
from gate import need

import hookscope as hs

need("docs")
pytestmark = pytest.mark.slow  # mkdocs builds the whole site, then a headless Chromium reads it

ROOT = Path(__file__).resolve().parents[2]
CLOSED_PORT = "http://127.0.0.1:9"  # the discard port: nothing listens, every download fails at once
PROXIES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")
OFFLINE = {**dict.fromkeys(PROXIES, CLOSED_PORT), "NO_PROXY": "", "no_proxy": "", "NO_MKDOCS_2_WARNING": "1"}
PUBLIC = list(hs.__all__)


def build(config: Path, out: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(out)]
    return subprocess.run(
        command, cwd=ROOT, env={**os.environ, **OFFLINE}, capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    started = time.perf_counter()
    done = build(ROOT / "mkdocs.yml", out)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stderr[-6000:]}"
    print(f"site built in {time.perf_counter() - started:.1f} s")
    return out


@pytest.fixture(scope="module")
def served(site: Path):
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def driver():
    need("browser")
    d = chromium(window="1280,1000")
    try:
        yield d
    finally:
        d.quit()


def pages(site: Path) -> dict[str, str]:
    return {p.relative_to(site).as_posix(): p.read_text(encoding="utf-8") for p in site.rglob("*.html")}


def test_every_public_name_is_listed_on_a_reference_page():
    """Each name in hookscope.__all__ has its `::: hookscope...` entry on a page of docs/reference/ (a verb
    named like its module, such as `hs.capture`, by the path where it is defined and its own anchor)."""
    listed = set()
    for page in (ROOT / "docs" / "reference").glob("*.md"):
        text = page.read_text(encoding="utf-8")
        listed |= set(re.findall(r"^::: hookscope\.(\w+)\s*$", text, re.MULTILINE))
        listed |= set(re.findall(r'^<span id="hookscope\.(\w+)"></span>$', text, re.MULTILINE))
    missing = sorted(set(PUBLIC) - listed)
    assert not missing, f"add `::: hookscope.NAME` for {missing} to a page under docs/reference/"
    index = (ROOT / "docs" / "reference" / "index.md").read_text(encoding="utf-8")
    unlinked = [name for name in PUBLIC if f"#hookscope.{name})" not in index]
    assert not unlinked, f"docs/reference/index.md links no entry for {unlinked}"


def test_the_site_needs_nothing_from_the_network(site: Path):
    """No page, stylesheet or script loads anything from another host (Google Fonts, a CDN)."""
    remote = re.compile(r"""(?:src|href)=["'](?:https?:)?//""")
    for name, html in pages(site).items():
        assert "fonts.googleapis" not in html and "fonts.gstatic" not in html, name
        tags = [m.group(0) for m in re.finditer(r"<(?:link|script|img)\b[^>]*>", html)]
        found = [tag for tag in tags if remote.search(tag)]
        assert not found, f"{name} loads from another host: {found[:3]}"
    for css in site.rglob("*.css"):
        assert "fonts.googleapis" not in css.read_text(encoding="utf-8"), css


def test_the_guides_and_their_links_land_on_the_site(site: Path):
    """README is the home page; its links into docs/ and to files outside it point at pages that exist."""
    html = pages(site)
    home = html["index.html"]
    for target in ('"scale/"', '"examples/"', '"repo/bench/RESULTS/"', '"repo/examples/"'):
        assert f"href={target}" in home, f"the home page has no link to {target}"
    for folder in (
        "scale/",
        "store-format/",
        "top/",
        "examples/",
        "examples/linear_probe/",
        "repo/bench/RESULTS/",
        "repo/examples/",
    ):
        page = folder + "index.html"
        assert page in html, f"{page} was not built"
    assert (site / "repo" / "examples" / "linear_probe.py").read_bytes() == (
        ROOT / "examples" / "linear_probe.py"
    ).read_bytes()
    for picture in ("top.png", "examples/img/linear_probe.png", "img/profile_time_per_block.svg"):
        assert (site / picture).read_bytes() == (ROOT / "docs" / picture).read_bytes(), picture
    assert "notest" not in html["index.html"]  # the docs runner's fence marker is not shown


def test_a_broken_link_or_anchor_fails_the_build(tmp_path: Path):
    """mkdocs.yml's own validation settings turn a link to a missing page or anchor into a failure."""
    import yaml

    ours = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\n[a page](other.md#nowhere)\n")
    (docs / "other.md").write_text("# Other\n\n[gone](missing.md)\n")
    config = tmp_path / "mkdocs.yml"
    config.write_text(
        yaml.safe_dump(
            {
                "site_name": "t",
                "docs_dir": str(docs),
                "strict": ours["strict"],
                "validation": ours["validation"],
                "theme": {"name": "mkdocs"},
            }
        )
    )
    done = build(config, tmp_path / "site")
    assert done.returncode != 0
    assert "missing.md" in done.stderr and "nowhere" in done.stderr, done.stderr[-3000:]


def test_home_page_renders_and_search_finds_collect(driver, served: str):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(served)
    assert driver.find_element(By.CSS_SELECTOR, "article h1").text == "hookscope"
    nav = driver.find_element(By.CSS_SELECTOR, "nav.md-nav--primary").get_attribute("textContent")
    assert all(section in nav for section in ("Guides", "Examples", "API reference", "Benchmarks")), nav
    code = driver.find_elements(By.CSS_SELECTOR, "article pre code")
    assert any("hs.collect(model, ids" in c.get_attribute("textContent") for c in code)

    box = driver.find_element(By.CSS_SELECTOR, "input.md-search__input")
    driver.execute_script("arguments[0].focus()", box)
    box.send_keys("collect")
    results = WebDriverWait(driver, 30).until(
        lambda d: d.find_elements(By.CSS_SELECTOR, ".md-search-result__item a") or False
    )
    hrefs = [r.get_attribute("href").replace("?h=collect", "") for r in results]
    assert served + "reference/capture/#hookscope.collect" in hrefs, hrefs
    assert severe(driver) == []
    local = driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert all(url.startswith(served) for url in local), [u for u in local if not u.startswith(served)]


def test_every_public_name_has_a_reference_entry_with_an_example(driver, served: str, site: Path):
    from selenium.webdriver.common.by import By

    where = {}  # name -> the reference page that holds its anchor
    for page, html in pages(site).items():
        if page.startswith("reference/"):
            for name in PUBLIC:
                if f'id="hookscope.{name}"' in html:
                    where.setdefault(name, page)
    assert set(where) == set(PUBLIC), f"no reference entry for {sorted(set(PUBLIC) - set(where))}"
    for page in sorted(set(where.values())):
        driver.get(served + page.removesuffix("index.html"))
        for name in [n for n, p in where.items() if p == page]:
            anchor = driver.find_element(By.ID, f"hookscope.{name}")
            entry = anchor.find_element(By.XPATH, "./following::div[contains(@class, 'doc-contents')][1]")
            text = entry.get_attribute("textContent")
            assert entry.find_elements(By.CSS_SELECTOR, "pre code"), f"hookscope.{name}: no example shown"
            if inspect.isfunction(getattr(hs, name)):
                assert "Returns:" in text and "Raises:" in text, f"hookscope.{name}: no Returns / Raises"
        assert severe(driver) == [], page


def test_the_guides_pictures_load(driver, served: str):
    from selenium.webdriver.common.by import By

    for page in ("top/", "profiling/", "examples/linear_probe/", "examples/sae_from_store/"):
        driver.get(served + page)
        images = driver.find_elements(By.CSS_SELECTOR, "article img")
        assert images, page
        for img in images:
            loaded = driver.execute_script("return arguments[0].complete && arguments[0].naturalWidth", img)
            assert loaded, f"{page}: {img.get_attribute('src')} did not load"
