"""A headless Chromium driven by Selenium for the web UI's tests (tests/test_webui_browser.py).

Needs Debian's `chromium` and `chromium-driver` (apt-get) and `selenium` (PyPI); without them
`require_browser()` skips the test with the reason. `console_errors` reads the browser's log:
JavaScript errors, failed loads and CSP refusals all land there at level SEVERE.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any, Callable

import pytest

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
DRIVER_NAMES = ("chromedriver",)


def _which(names: tuple[str, ...], env: str) -> str | None:
    given = os.environ.get(env)
    if given:
        return given if os.path.exists(given) else None
    return next((p for p in map(shutil.which, names) if p), None)


def _missing(why: str) -> None:
    """Skip, except under scripts/test.sh (KVSHARE_REQUIRE_BROWSER=1, after it installed the
    browser), where a missing browser fails the test instead of hiding it."""
    if os.environ.get("KVSHARE_REQUIRE_BROWSER"):
        pytest.fail(why)
    pytest.skip(why)


def require_browser() -> tuple[str, str]:
    """The Chromium and chromedriver paths, or a skip saying what is missing."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        _missing("selenium is not installed (pip install selenium)")
    browser = _which(CHROMIUM_NAMES, "KVSHARE_CHROMIUM")
    driver = _which(DRIVER_NAMES, "KVSHARE_CHROMEDRIVER")
    if browser is None or driver is None:
        _missing("headless Chromium is not installed (apt-get install chromium "
                 "chromium-driver)")
    assert browser is not None and driver is not None
    return browser, driver


def start_browser():
    """A headless Chromium with its console log readable (`console_errors`)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    browser, driver = require_browser()
    opts = webdriver.ChromeOptions()
    opts.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,1000", "--no-first-run", "--disable-extensions"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(driver), options=opts)


def console_errors(drv) -> list[str]:
    """The browser log's SEVERE entries since the last call (JS errors, failed loads)."""
    return [e["message"] for e in drv.get_log("browser") if e.get("level") == "SEVERE"]


def wait_for(fn: Callable[[], Any], timeout: float = 10.0, what: str = "a condition",
             every: float = 0.1) -> Any:
    """`fn()`'s first truthy value within `timeout` seconds, tried every `every` seconds
    (exceptions count as falsy)."""
    end = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < end:
        try:
            value = fn()
            if value:
                return value
        except Exception as e:  # noqa: BLE001 - the page is still changing
            last = e
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}"
                         + (f" (last error: {last})" if last else ""))
