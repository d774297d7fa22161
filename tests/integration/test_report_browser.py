"""report.html opened from disk in headless Chromium (Debian's chromium + chromium-driver, through
Selenium): what a person sees. The fixture suite is tests/unit/html_report_fixture.py's (known
confusions, a class with no images, Chinese phrases and captions, an unreadable image, one image
deleted before the report, a failed set, a comparison).

    apt-get install -y chromium chromium-driver && pip install 'selenium>=4.30,<5'
    python -m pytest -q tests/integration/test_report_browser.py

Without the browser the test is skipped with that command, except under CI (the CI variable set),
where it fails: .ci/run installs the browser.
"""

from __future__ import annotations

import os

import pytest
from PIL import Image

from benchmarks.report_screenshot import INSTALL, chromium, missing, wait_for_images
from rsclip_ds.evaluation.html_report import MISSING, write_html_report
from tests.unit import html_report_fixture as fx

pytestmark = pytest.mark.slow


def _require_browser() -> None:
    lacks = missing()
    if lacks:
        message = f"the browser test needs {', '.join(lacks)}: {INSTALL}"
        if os.environ.get("CI"):
            pytest.fail(message + " (CI is set: CI must run this test)")
        pytest.skip(message)


@pytest.fixture
def browser():
    _require_browser()
    with chromium() as driver:
        yield driver


def test_report_in_headless_chromium(browser, tmp_path):
    from selenium.webdriver.common.by import By

    facts = fx.make_suite(tmp_path / "suite")
    path = write_html_report(facts["dir"])
    browser.get(path.resolve().as_uri())
    wait_for_images(browser)

    # the confusion matrix as rendered: classes x classes cells, the known confusions in their cells
    table = browser.find_element(By.CSS_SELECTOR, "table.confusion")
    columns = [th.text for th in table.find_elements(By.CSS_SELECTOR, "th.col")]
    assert columns == fx.ORDER
    rows = table.find_elements(By.CSS_SELECTOR, "tr")[1:]
    assert len(rows) == len(fx.NAMES)
    for row in rows:
        true = row.find_element(By.CSS_SELECTOR, "th.row").text
        cells = row.find_elements(By.CSS_SELECTOR, "td[data-count]")
        assert len(cells) == len(columns)
        for pred, cell in zip(columns, cells):
            want = fx.DIAGONAL[true] if true == pred else fx.CONFUSIONS.get((true, pred), 0)
            assert cell.text == (str(want) if want else ""), (true, pred)
            if want:   # shaded: a person sees the cell
                assert cell.value_of_css_property("background-color") not in ("rgba(0, 0, 0, 0)", "transparent")
    assert table.is_displayed() and table.size["width"] > 200

    # every gallery image has loaded, the placeholder of the deleted image too
    images = browser.execute_script(
        "return Array.from(document.querySelectorAll('figure img')).map(function (i) {"
        " return [i.closest('figure').getAttribute('data-image'), i.getAttribute('data-thumb'), i.naturalWidth]; });")
    assert len(images) >= 20
    assert [(p, t, w) for p, t, w in images if w <= 0] == []
    assert (facts["missing_image"], MISSING, 96) in [tuple(i) for i in images]

    # Chinese text renders as text (the DOM holds the characters, not escapes)
    assert "港口" in browser.find_element(By.CSS_SELECTOR, "table.confusion").text
    assert "许多建筑物和绿树" in browser.find_element(By.TAG_NAME, "body").text

    # no console errors (a failed load, a script error)
    severe = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert severe == []

    # the whole page, as a person would scroll it
    height = browser.execute_script("return document.documentElement.scrollHeight")
    browser.set_window_size(1400, min(height + 40, 16000))
    wait_for_images(browser)
    shot = tmp_path / "report.png"
    assert browser.save_screenshot(str(shot))
    with Image.open(shot) as im:
        assert im.format == "PNG" and im.width >= 1000 and im.height >= 2000
        assert max(hi - lo for lo, hi in im.convert("RGB").getextrema()) > 100   # not a blank page
    assert shot.stat().st_size > 50_000
