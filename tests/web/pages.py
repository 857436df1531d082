"""What the dashboard's page tests share: a Chromium session signed in with a key, moving to a
route, and a full-page screenshot at the module's window width (``test-artifacts/dashboard``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tests.web.test_dashboard import all_of, headless_chromium, screenshot, wait_for

HEIGHT = 900


def sign_in(browser: Any, base_url: str, key: str) -> None:
    """Sign in on ``#/signin`` and wait for the datasets table."""
    browser.get(base_url + "/#/signin")
    wait_for("the key field", lambda: browser.find_element("id", "api-key")).send_keys(key)
    browser.find_element("id", "signin-submit").click()
    wait_for("the datasets table", lambda: all_of(browser, "#datasets-table tbody tr"))


@contextmanager
def signed_in(base_url: str, key: str, width: int) -> Iterator[Any]:
    """A headless Chromium at ``width`` × 900, signed in with ``key``."""
    with headless_chromium() as browser:
        browser.set_window_size(width, HEIGHT)
        sign_in(browser, base_url, key)
        yield browser


def go(driver: Any, route: str) -> None:
    driver.execute_script("window.location.hash = arguments[0];", route)


def shot(driver: Any, name: str, width: int) -> None:
    """A full-page screenshot, then the window back to ``width`` × 900."""
    screenshot(driver, name, width=width)
    driver.set_window_size(width, HEIGHT)
