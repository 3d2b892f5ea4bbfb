"""Headless Chromium for the explorer's browser tests and screenshots: Debian's own browser and
driver (``apt-get install chromium chromium-driver``), driven by Selenium with both paths given, so
Selenium Manager has nothing to look up or download.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1400,1000",
)


def chromium_available() -> bool:
    """Whether the system browser and its driver are installed."""
    return (
        Path(CHROMIUM).is_file()
        and Path(CHROMEDRIVER).is_file()
        and shutil.which(CHROMEDRIVER) is not None
    )


def chromium_driver(user_data_dir: str | Path) -> Any:
    """A Selenium WebDriver on headless Chromium with a fresh profile in ``user_data_dir``."""
    os.environ.setdefault(
        "SE_OFFLINE", "true"
    )  # Selenium Manager, should anything reach it: no network
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={Path(user_data_dir).resolve()}")
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
