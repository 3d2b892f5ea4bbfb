"""The bank explorer in a real browser: Debian's headless Chromium against a real
``crl-experience serve`` on loopback, over a bank this test writes.

Skipped only where Chromium is not installed (``.ci/run`` installs it, so under CI a missing
browser fails instead of skipping).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from crl_gym.clients import RemoteClient
from crl_gym.experience.bank import ExperienceBank
from crl_gym.experience.embedders import HashingEmbedder, embedder_name
from crl_gym.experience.manager import ExperienceManager
from crl_gym.experience.merge import merge_bank
from crl_gym.explorer.browser import chromium_available, chromium_driver
from crl_gym.protocol import AddOp, UpdateOp

if not chromium_available():
    if os.environ.get("CI"):
        raise RuntimeError("CI must run the browser tests: .ci/run installs chromium and chromium-driver")
    pytest.skip("chromium / chromium-driver are not installed (apt-get install chromium chromium-driver)",
                allow_module_level=True)

from selenium.webdriver.common.by import By  # noqa: E402 - only where the browser is there
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

EMB = HashingEmbedder(64)
TOKEN = "explorer-test-token"
N = 60
BIG = "x" * 999_000 + "<script>window.__pwned = 9</script>"
HOSTILE = [
    '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">',
    '<a href="javascript:window.__pwned = 3">click me</a> javascript:window.__pwned = 4',
    "\u202eexe.gnp\u2066 reversed? \u2069 and \u200f\u05e9\u05dc\u05d5\u05dd",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _write_bank(d: Path) -> dict[str, Any]:
    bank = ExperienceBank(d, dim=EMB.dim, embedder_name=embedder_name(EMB))
    mgr = ExperienceManager(bank, EMB)
    texts = [f"advice {i:02d}: walk {['north', 'south', 'east', 'west'][i % 4]} {i} steps, then take the stairs"
             for i in range(N)]
    ids = mgr.apply_ops([AddOp(t) for t in texts], step=0).added
    for n, i in enumerate(ids):  # distinct retrieval counts: entry k was retrieved k times
        for _ in range(n % 17):
            bank.record_retrieval([i], 1.0)
    mgr.apply_ops([UpdateOp(ids[7], "advice 07: walk east 7 steps, mind the lava, then take the stairs")], step=2)
    merge = json.dumps({"E1": "merge", "E2": "merge", "merged": "advice 00+01: walk north or south, then the stairs"})
    report = merge_bank(bank, EMB, lambda ps: [merge for _ in ps], order="id", step=3)
    assert report.ok, report.error
    bank.record_credits(3, [(ids[10], 1.0, 4), (ids[11], -1.0, 2)])
    out = {"ids": ids, "updated": ids[7], "anchor": next(iter(report.updated)), "credited": ids[10]}
    mgr.close()
    bank.close()
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("explorer")
    made = _write_bank(root / "bank")
    (root / "token").write_text(TOKEN)
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "crl_gym.cli", "serve", "--bank", str(root / "bank"), "--port", str(port),
         "--embedder", "hashing:64", "--token-file", str(root / "token"), "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"crl-experience serve did not start: {proc.stderr.read().decode() if proc.stderr else ''}")
        time.sleep(0.2)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    # hostile entries through the service's own write route; the lone surrogate as a JSON escape
    ops = [{"kind": "add", "text": t} for t in [*HOSTILE, BIG]]
    body = json.dumps({"ops": ops, "step": 4})[:-1] + ', "pad": 0}'
    body = body.replace("click me", "click \\ud800 me")
    r = httpx.post(f"{url}/apply_ops", content=body, headers={**auth, "Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 200, r.text
    made["hostile"] = r.json()["added_ids"]
    made["url"] = url
    try:
        yield made
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    d = chromium_driver(tmp_path_factory.mktemp("chromium-profile"))
    d.set_page_load_timeout(60)
    try:
        yield d
    finally:
        d.quit()


def _wait(driver: Any, cond: Any, timeout: float = 30) -> Any:
    return WebDriverWait(driver, timeout).until(cond)


def _open(driver: Any, url: str, token: str | None = TOKEN) -> None:
    """Load a page; give the token when the page asks for it; wait until its data is shown."""
    driver.get(url)
    if token is not None:
        _wait(driver, lambda d: d.find_element(By.ID, "token-form").is_displayed() or d.find_element(By.TAG_NAME, "body").get_attribute("data-ready"))
        if driver.find_element(By.ID, "token-form").is_displayed():
            driver.find_element(By.ID, "token-input").send_keys(token)
            driver.find_element(By.CSS_SELECTOR, "#token-form button").click()
    _wait(driver, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "true")


def _rows(driver: Any, table: str = "entries") -> list[Any]:
    return driver.find_elements(By.CSS_SELECTOR, f"#{table} tbody tr")


def _no_script_ran(driver: Any) -> None:
    assert driver.execute_script("return typeof window.__pwned") == "undefined"
    assert not driver.find_elements(By.CSS_SELECTOR, "a[href^='javascript'], img, script:not([src])")


def test_a_wrong_token_gets_no_data(server: dict[str, Any], driver: Any) -> None:
    driver.get(f"{server['url']}/ui/bank")
    driver.execute_script("sessionStorage.clear()")
    driver.get(f"{server['url']}/ui/bank")
    _wait(driver, lambda d: d.find_element(By.ID, "token-form").is_displayed())
    driver.find_element(By.ID, "token-input").send_keys("not-the-token")
    driver.find_element(By.CSS_SELECTOR, "#token-form button").click()
    _wait(driver, lambda d: "refused" in d.find_element(By.ID, "token-error").text)
    assert driver.find_element(By.ID, "token-form").is_displayed()
    assert _rows(driver) == [] and "advice" not in driver.page_source
    assert driver.execute_script("return sessionStorage.getItem('crl-explorer-token')") is None


def test_the_bank_lists_sorts_and_pages(server: dict[str, Any], driver: Any) -> None:
    _open(driver, f"{server['url']}/ui/bank?per_page=25")
    total = N - 1 + len(HOSTILE) + 1  # a Merge folded two entries into one
    assert len(_rows(driver)) == 25
    assert f"page 1 of {-(-total // 25)}" in driver.find_element(By.ID, "page-info").text
    first = [int(r.get_attribute("data-id")) for r in _rows(driver)]
    driver.find_element(By.ID, "next").click()
    _wait(driver, lambda d: "page 2 of" in d.find_element(By.ID, "page-info").text)
    second = [int(r.get_attribute("data-id")) for r in _rows(driver)]
    assert first + second == sorted(first + second) and not set(first) & set(second)
    driver.find_element(By.CSS_SELECTOR, "button[data-sort='retrievals']").click()
    _wait(driver, lambda d: "sorted by retrievals desc" in d.find_element(By.ID, "page-info").text)
    counts = [int(c.text) for c in driver.find_elements(By.CSS_SELECTOR, "#entries tbody td.retrievals")]
    assert counts == sorted(counts, reverse=True) and counts[0] == 16
    driver.find_element(By.CSS_SELECTOR, "button[data-sort='rbar']").click()
    _wait(driver, lambda d: "sorted by rbar desc" in d.find_element(By.ID, "page-info").text)
    assert int(_rows(driver)[0].get_attribute("data-id")) == server["credited"]
    q = driver.find_element(By.ID, "f-q")
    q.clear()
    q.send_keys("mind the lava")
    driver.find_element(By.CSS_SELECTOR, "#filters button").click()
    _wait(driver, lambda d: " 1 entries" in d.find_element(By.ID, "page-info").text)
    assert [int(r.get_attribute("data-id")) for r in _rows(driver)] == [server["updated"]]


def test_a_search_returns_the_services_top_entry(server: dict[str, Any], driver: Any) -> None:
    _open(driver, f"{server['url']}/ui/search")
    query = "walk east 7 steps and mind the lava"
    driver.find_element(By.ID, "search-q").send_keys(query)
    driver.find_element(By.CSS_SELECTOR, "#search-form button").click()
    _wait(driver, lambda d: len(_rows(d, "results")) > 0)
    top = int(_rows(driver, "results")[0].get_attribute("data-id"))
    ref = RemoteClient(server["url"], token=TOKEN).search(query)  # after the page: the page records nothing
    assert ref is not None and top == ref.id


def test_an_entry_history_shows_its_update_and_its_merge(server: dict[str, Any], driver: Any) -> None:
    _open(driver, f"{server['url']}/ui/entry/{server['updated']}")
    kinds = [li.get_attribute("data-kind") for li in driver.find_elements(By.CSS_SELECTOR, "#history li")]
    assert kinds == ["add", "update"]
    assert "Update at step 2" in driver.find_element(By.ID, "history").text
    _open(driver, f"{server['url']}/ui/entry/{server['anchor']}")
    history = driver.find_element(By.ID, "history").text
    assert "Merge at step 3" in history and "advice 00+01" in history
    gone = [i for i in server["ids"][:2] if i != server["anchor"]][0]
    _open(driver, f"{server['url']}/ui/entry/{gone}")
    assert "Merged into another entry at step 3" in driver.find_element(By.ID, "history").text


def test_hostile_entries_render_as_text(server: dict[str, Any], driver: Any) -> None:
    script_id, link_id, rtl_id, big_id = server["hostile"]
    _open(driver, f"{server['url']}/ui/bank?q=window.__pwned&per_page=10")
    cells = [c.text for c in driver.find_elements(By.CSS_SELECTOR, "#entries tbody td.text")]
    assert any("<script>window.__pwned = 1</script>" in c for c in cells)
    _no_script_ran(driver)
    for entry_id, expect in ((script_id, HOSTILE[0]), (rtl_id, HOSTILE[2])):
        _open(driver, f"{server['url']}/ui/entry/{entry_id}")
        assert driver.execute_script("return document.getElementById('entry-text').textContent") == expect
        _no_script_ran(driver)
    _open(driver, f"{server['url']}/ui/entry/{link_id}")
    shown = driver.execute_script("return document.getElementById('entry-text').textContent")
    assert shown == HOSTILE[1].replace("click me", "click \ufffd me")  # the lone surrogate became U+FFFD
    _no_script_ran(driver)
    _open(driver, f"{server['url']}/ui/entry/{big_id}")
    assert driver.execute_script("return document.getElementById('entry-text').textContent.length") == len(BIG)
    _no_script_ran(driver)


def test_the_training_page_draws_its_charts(server: dict[str, Any], driver: Any) -> None:
    _open(driver, f"{server['url']}/ui/training")
    _wait(driver, lambda d: all(d.execute_script(f"const i = document.getElementById('chart-{n}'); "
                                                 f"return i.complete && i.naturalWidth > 0")
                                for n in ("bank_size", "ops", "rbar")))
    assert "Steps 0 to 4" in driver.find_element(By.ID, "training-note").text
