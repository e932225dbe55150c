"""The headless browser the page tests drive: the system's Chromium through its chromedriver
(scripts/setup-env installs both from apt with the dev extra), selenium-manager offline, so nothing
is ever downloaded. `need("browser")` first: it skips or fails (HOOKSCOPE_REQUIRE) without them."""

from __future__ import annotations

import os
import shutil

from gate import BROWSERS, CHROMEDRIVER


def chromium(window: str = "1280,860"):
    """A new headless Chromium (quit it when done) that records the page's console messages."""
    os.environ["SE_OFFLINE"] = "true"  # selenium-manager must never fetch a driver or a browser
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = next(shutil.which(b) for b in BROWSERS if shutil.which(b))
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        f"--window-size={window}",
        "--disable-extensions",
        "--no-first-run",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(executable_path=shutil.which(CHROMEDRIVER)), options=options)


def severe(driver) -> list[dict]:
    """The console's errors since the last call."""
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
