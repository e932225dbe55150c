"""The `hookscope top --html` page in a real headless browser: the system's Chromium driven through
its chromedriver by selenium (scripts/setup-env installs both from apt when the dev extra is asked
for). Selenium is pointed at /usr/bin/chromedriver and the system browser, with selenium-manager
offline, so nothing is ever downloaded. Where HOOKSCOPE_REQUIRE names `browser` (the main
environment of scripts/test-all) a missing browser fails the test (tests/kit/gate.py); elsewhere it skips.

Set HOOKSCOPE_SCREENSHOT=FILE.png to also save a screenshot of the page (docs/top.md's image).
"""

from __future__ import annotations

import os

import pytest
from browser import chromium, severe
from gate import need
from top_fixtures import PLANTED, POINT, TIED, UNITS, make_store

from hookscope.store import open_store
from hookscope.top import build_index, neurons, page_data, top, write_page

pytestmark = pytest.mark.slow  # a headless Chromium


@pytest.fixture(scope="module")
def driver():
    need("browser")  # scripts/setup-env .venv dev installs all three; the main environment requires them
    d = chromium()
    try:
        yield d
    finally:
        d.quit()


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    root = tmp_path_factory.mktemp("top-html")
    syn = make_store(root)
    store = open_store(syn.path)
    index = build_index(store, POINT, k=10)
    data = page_data(store, index, neurons(UNITS), k=8, context=4, tokenizer=syn.tokenizer)
    path = write_page(root / "page.html", data)
    return syn, store, path


def _shown(driver):
    from selenium.webdriver.common.by import By

    rows = []
    for el in driver.find_elements(By.CSS_SELECTOR, "#contexts .ctx"):
        rows.append(
            {
                "row": int(el.get_attribute("data-row")),
                "text": el.find_element(By.CSS_SELECTOR, ".toks").get_attribute("textContent"),
                "center": el.find_element(By.CSS_SELECTOR, ".tok.center").get_attribute("textContent"),
                "value": float(el.find_element(By.CSS_SELECTOR, ".v").text),
            }
        )
    return rows


def test_page_shows_the_known_contexts_without_console_errors(driver, page):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    syn, store, path = page
    want = top(store, POINT, PLANTED, k=8, context=4, tokenizer=syn.tokenizer)
    driver.get(path.as_uri() + f"#unit={PLANTED}")
    assert severe(driver) == []
    shown = _shown(driver)
    assert [s["row"] for s in shown] == want.rows.tolist()
    assert [s["text"] for s in shown] == [c.text for c in want.contexts]
    target = syn.tokenizer.decode([syn.target])
    assert all(s["center"] == target for s in shown)  # the planted token is the one outlined
    assert [s["value"] for s in shown] == pytest.approx(want.values.tolist(), abs=1e-3)
    assert driver.find_element(By.ID, "unit-title").text.endswith(f"unit {PLANTED}")

    # pick another unit in the list: its contexts replace the first ones
    driver.find_element(By.CSS_SELECTOR, f'.unit[data-unit="{TIED}"]').click()
    tied = top(store, POINT, TIED, k=8, context=4, tokenizer=syn.tokenizer)
    assert [s["row"] for s in _shown(driver)] == tied.rows.tolist()
    assert driver.current_url.endswith(f"#unit={TIED}")

    # sort by max and by frequency: the list follows the index's own figures
    index = build_index(store, POINT, k=1)
    Select(driver.find_element(By.ID, "sort")).select_by_value("max")
    listed = [int(e.get_attribute("data-unit")) for e in driver.find_elements(By.CSS_SELECTOR, ".unit")]
    maxes = index.values[:, 0].tolist()
    assert listed == sorted(range(UNITS), key=lambda u: (-maxes[u], -u))
    assert listed[0] == PLANTED
    Select(driver.find_element(By.ID, "sort")).select_by_value("freq")
    Select(driver.find_element(By.ID, "dir")).select_by_value("asc")
    listed = [int(e.get_attribute("data-unit")) for e in driver.find_elements(By.CSS_SELECTOR, ".unit")]
    freq = index.fires.tolist()
    assert [freq[u] for u in listed] == sorted(freq)
    # the histogram is drawn: one bar per bin between the first and last non-empty ones
    bars = driver.find_elements(By.CSS_SELECTOR, "#hist svg rect")
    h = index.hist[TIED].tolist()
    nz = [i for i, c in enumerate(h) if c]
    assert len(bars) == nz[-1] - nz[0] + 1
    assert severe(driver) == []

    shot = os.environ.get("HOOKSCOPE_SCREENSHOT")
    if shot:
        driver.get("about:blank")  # a fresh load, not a same-page hash change: the default sort
        driver.get(path.as_uri() + f"#unit={PLANTED}")
        driver.save_screenshot(shot)


def test_page_text_is_never_parsed_as_html(driver, tmp_path):
    """Token text like `<img onerror=...>` must show as text, not run."""
    data = {
        "point": "p<b>",
        "source": {"kind": "neurons"},
        "rows": 1,
        "k": 1,
        "context": 0,
        "strings": ["<img src=x onerror=\"document.title='pwned'\">", "</script><b>x</b>"],
        "edges": [None] + [0.0] * 80 + [None],
        "store": "s",
        "settings": {},
        "units": [
            {
                "u": 0,
                "freq": 1.0,
                "fires": 1,
                "max": 1.0,
                "hist": [0] * 40 + [0, 1] + [0] * 39,
                "ctx": [{"v": 1.0, "c": 0, "row": 0, "doc": 0, "pos": 0, "t": [0, 1], "a": [1.0, 0.5]}],
            }
        ],
    }
    path = write_page(tmp_path / "x.html", data)
    driver.get(path.as_uri())
    rows = _shown(driver)
    assert rows[0]["text"] == data["strings"][0] + data["strings"][1]
    assert "pwned" not in driver.title
    assert severe(driver) == []
