"""A report.html as a person sees it: opened from disk in headless Chromium (Debian's chromium and
chromium-driver, through Selenium), every image loaded, saved as a PNG. The evaluation guide's
screenshot is made with it from the demo's last evaluation (a trained `tiny` model on the synthetic
eval set: `bash launch/demo.sh`):

    python -m benchmarks.report_screenshot runs/tiny_demo/eval/step00000150/report.html \
        --png docs/images/eval-report.png --height 2400

tests/integration/test_report_browser.py opens the report the same way (`chromium()`).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
INSTALL = "apt-get install -y chromium chromium-driver && pip install 'selenium>=4.30,<5'"


def missing() -> list[str]:
    """What the browser needs and this machine lacks (empty: it can run)."""
    import importlib.util

    lacks = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    return lacks + (["the selenium package"] if importlib.util.find_spec("selenium") is None else [])


@contextlib.contextmanager
def chromium(width: int = 1400, height: int = 1000):
    """A headless Chromium driver that keeps the browser's console log (goog:loggingPrefs)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    # --no-sandbox: CI containers run as root, where Chromium's sandbox refuses to start
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={width},{height}", "--hide-scrollbars", "--lang=en-US"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
    try:
        yield driver
    finally:
        driver.quit()


def wait_for_images(driver, timeout: float = 20) -> None:
    """Until the page has loaded and every <img> has its source and is complete."""
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(driver, timeout)
    wait.until(lambda d: d.execute_script("return document.readyState") == "complete")
    wait.until(lambda d: d.execute_script(
        "return Array.from(document.images).every(function (i) { return i.src && i.complete; })"))


def screenshot(html: Path, png: Path, width: int = 1400, height: int | None = None) -> Path:
    """The page from its top, `height` px of it (None: all of it), as a PNG."""
    with chromium(width) as driver:
        driver.get(Path(html).resolve().as_uri())
        wait_for_images(driver)
        full = driver.execute_script("return document.documentElement.scrollHeight")
        driver.set_window_size(width, min(height or full, full) + 40)
        wait_for_images(driver)
        png.parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(png))
    return png


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("html", type=Path, help="a report.html")
    parser.add_argument("--png", type=Path, required=True)
    parser.add_argument("--width", type=int, default=1400)
    parser.add_argument("--height", type=int, help="px from the top (default: the whole page)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if missing():
        print(f"report_screenshot: needs {', '.join(missing())}: {INSTALL}", file=sys.stderr)
        return 2
    print(f"wrote {screenshot(args.html, args.png, args.width, args.height)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
