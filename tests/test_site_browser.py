"""The built site in a real browser (headless Chromium through selenium): every page loads with no failed
request and no request to another host, and a newcomer's searches ("install", "24 GB", "GPU") put a guide
first. Skipped, with the reason, where no Chromium driver or selenium is installed (``scripts/install.sh dev``
installs both on Debian as root)."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDE_PATHS = ("/guides/", "/installation/", "/quickstart/")
SEARCHES = ("install", "24 GB", "GPU")

pytestmark = pytest.mark.slow


def _driver_or_skip():
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed: pip install -e '.[dev]'")
    driver_path = shutil.which("chromedriver")
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if driver_path is None or browser is None:
        pytest.skip(
            "no Chromium and chromedriver: apt-get install chromium chromium-driver (scripts/install.sh dev)"
        )
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    return webdriver.Chrome(service=Service(driver_path), options=options)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory):
    """The site built strict, served on localhost: ``(base URL, site folder)``."""
    folder = tmp_path_factory.mktemp("site") / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(folder)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(folder))
    handler.log_message = lambda *args: None  # type: ignore[method-assign]
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}", folder
    server.shutdown()


@pytest.fixture(scope="module")
def browser():
    driver = _driver_or_skip()
    yield driver
    driver.quit()


def _requests(driver) -> tuple[set[str], list[str]]:
    """The URLs the page requested since the last call, and those that failed (an error, a status >= 400)."""
    urls, failed, ids = set(), [], {}
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        params = message.get("params", {})
        if message["method"] == "Network.requestWillBeSent":
            urls.add(params["request"]["url"])
            ids[params["requestId"]] = params["request"]["url"]
        elif message["method"] == "Network.responseReceived" and params["response"]["status"] >= 400:
            failed.append(f"{params['response']['status']} {params['response']['url']}")
        elif message["method"] == "Network.loadingFailed" and not params.get("canceled"):
            failed.append(f"{params.get('errorText')} {ids.get(params['requestId'], '?')}")
    return urls, failed


def test_every_page_loads_from_the_site_alone(site, browser) -> None:
    base, folder = site
    host = urlsplit(base).netloc
    pages = sorted(path.relative_to(folder).as_posix() for path in folder.rglob("*.html"))
    problems = []
    for page in pages:
        if page == "404.html":
            continue
        browser.get(f"{base}/{page}")
        urls, failed = _requests(browser)
        elsewhere = sorted(
            u for u in urls if urlsplit(u).scheme in ("http", "https") and urlsplit(u).netloc != host
        )
        problems += [f"{page}: failed {item}" for item in failed]
        problems += [f"{page}: requests another host: {url}" for url in elsewhere]
    assert len(pages) > 50
    assert not problems, "\n".join(problems[:40])


@pytest.mark.parametrize("query", SEARCHES)
def test_a_newcomers_search_puts_a_guide_first(site, browser, query: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    base, _ = site
    browser.get(f"{base}/index.html")
    browser.find_element(By.CSS_SELECTOR, "label.md-search__icon, label[for='__search']").click()
    field = WebDriverWait(browser, 10).until(
        expected_conditions.element_to_be_clickable((By.CSS_SELECTOR, "input.md-search__input"))
    )
    field.send_keys(query)
    href = _settled_first_result(browser)
    assert href.startswith(GUIDE_PATHS), f"search for {query!r} puts {href} first, not a guide"


def _settled_first_result(driver, timeout_s: float = 20.0) -> str:
    """The first result's path once the results stop changing (they are re-rendered as the index answers)."""
    script = "const a = document.querySelector('.md-search-result__item a'); return a && a.href"
    deadline, previous = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        current = driver.execute_script(script)
        if current is not None and current == previous:
            return urlsplit(current).path
        previous = current
        time.sleep(0.5)
    raise AssertionError(f"no settled search result within {timeout_s} s (last: {previous})")
