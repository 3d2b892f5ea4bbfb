"""Screenshots of the explorer's pages for docs/img/, from a small demo run made here.

    python scripts/explorer_screenshots.py [--out docs/img]

Writes a bank and a ``trajectories.jsonl`` the way a run does (entries added, updated, merged,
credited, episodes guided), serves them with the experience service on loopback with a token,
and saves one PNG per page (``explorer-bank.png``, ``explorer-entry.png``, ``explorer-search.png``,
``explorer-training.png``) taken with headless Chromium (:mod:`crl_gym.explorer.browser`).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path
from typing import Any

from crl_gym.experience.bank import ExperienceBank
from crl_gym.experience.embedders import HashingEmbedder, embedder_name
from crl_gym.experience.manager import ExperienceManager
from crl_gym.experience.merge import merge_bank
from crl_gym.experience.service import RetrievalService
from crl_gym.explorer.browser import chromium_driver
from crl_gym.protocol import (
    AddOp,
    DistillationRequest,
    ExperienceRef,
    ExtractorSample,
    Step,
    Trajectory,
    UpdateOp,
)
from crl_gym.server import BackgroundServer

TOKEN = "demo-token"
ADVICE = [
    "Walk east along the top wall first; the stairs are usually in the far corner.",
    "Check the room's four corners before exploring the middle.",
    "If a monster stands between you and the stairs, go around it along the wall.",
    "Pick up the key before heading to the locked door.",
    "Cross the river where it is narrowest; push a boulder in to make a bridge.",
    "Never step on lava: walk around it even if the path is longer.",
    "In a dark room, move one step at a time and read every new message.",
    "When the corridor splits, try the branch that goes towards the stairs' direction.",
    "Use the wand only when a monster blocks the only path.",
    "A boulder pushed into the water becomes a bridge: line up behind it first.",
    "After two bumps into a wall, turn and follow the wall instead.",
    "Descend with '>' as soon as you stand on the stairs.",
]


def _merge_two(prompts: list[str]) -> list[str]:
    """A Merge that folds each window's first two entries into one."""
    return [json.dumps({"E1": "merge", "E2": "merge", "merged": "Follow the wall to the stairs, then press '>'."})
            for _ in prompts]


def demo_run(run_dir: Path, steps: int = 12, seed: int = 0) -> RetrievalService:
    """A run directory with a bank that went through Adds, Updates, Merges and credits."""
    rng = random.Random(seed)
    emb = HashingEmbedder(128)
    bank = ExperienceBank(run_dir / "bank", dim=emb.dim, embedder_name=embedder_name(emb))
    service = RetrievalService(ExperienceManager(bank, emb))
    mgr = service.manager
    lines = []
    for step in range(steps):
        new = [AddOp(t) for t in ADVICE[step::steps][:1]] + [AddOp(f"{rng.choice(ADVICE)} (seen at step {step})")]
        sample = ExtractorSample(prompt=f"Task: reach the stairs in a 5x5 room.\nTrajectory of step {step}: ...\n"
                                        "Write one short piece of advice.", response=json.dumps([{"op": "add", "text": new[0].text}]),
                                 logprobs=[-0.4] * 12, token_ids=list(range(12)), extractor_version=step)
        mgr.apply_ops(new, step=step, sample=sample)
        ids = bank.ids()
        if step % 3 == 2:
            target = rng.choice(ids)
            mgr.apply_ops([UpdateOp(target, bank.get(target).text.split(" (")[0] + " Then press '>'.")], step=step)  # type: ignore[union-attr]
        if step % 5 == 4:
            merge_bank(bank, emb, _merge_two, order="similar", step=step)
        credits = []
        for entry_id in rng.sample(bank.ids(), k=min(4, len(bank))):
            outcomes = [rng.random() < 0.35 + 0.04 * step for _ in range(rng.randint(1, 4))]
            credits.append((entry_id, sum(1.0 if o else -1.0 for o in outcomes) / len(outcomes), len(outcomes)))
            e = bank.get(entry_id)
            for n, ok in enumerate(outcomes):
                traj = Trajectory(steps=[Step(observation="...", action=rng.choice("hjkl")) for _ in range(rng.randint(3, 12))])
                req = DistillationRequest(task="Reach the stairs down in a 5x5 room.", trajectory=traj, outcome=float(ok),
                                          success=ok, experience=ExperienceRef(entry_id, e.text, e.version),  # type: ignore[union-attr]
                                          condition="guided", env_id="crl/MiniHack-Room-5x5-v0", seed=n, rollout_step=step)
                lines.append(req.to_json())
            bank.record_retrieval([entry_id] * len(outcomes), 1.0)
        bank.record_credits(step, credits)
    (run_dir / "trajectories.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return service


def _shoot(driver: Any, url: str, path: Path, before: Any = None) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(url)
    if driver.execute_script("return sessionStorage.getItem('crl-explorer-token')") is None:
        WebDriverWait(driver, 30).until(lambda d: d.find_element(By.ID, "token-form").is_displayed())
        driver.find_element(By.ID, "token-input").send_keys(TOKEN)
        driver.find_element(By.CSS_SELECTOR, "#token-form button").click()
    WebDriverWait(driver, 30).until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "true")
    if before is not None:
        before(driver)
    driver.save_screenshot(str(path))


def main(argv: list[str] | None = None) -> list[Path]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("docs/img"))
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        service = demo_run(Path(tmp) / "run")
        merged = next((r[0] for r in service.manager.bank.read_sql(
            "SELECT entry_id FROM entry_events WHERE kind = 'merge' ORDER BY seq DESC LIMIT 1")), service.manager.bank.ids()[0])
        driver = chromium_driver(Path(tmp) / "profile")
        written = []
        try:
            with BackgroundServer(service, token=TOKEN) as server:
                def search(d: Any) -> None:
                    from selenium.webdriver.common.by import By
                    from selenium.webdriver.support.ui import WebDriverWait
                    d.find_element(By.ID, "search-q").send_keys("how do I find the stairs in a dark room")
                    k = d.find_element(By.ID, "search-k")
                    k.clear()
                    k.send_keys("3")
                    d.find_element(By.CSS_SELECTOR, "#search-form button").click()
                    WebDriverWait(d, 30).until(lambda x: x.find_elements(By.CSS_SELECTOR, "#results tbody tr"))

                def charts(d: Any) -> None:
                    from selenium.webdriver.support.ui import WebDriverWait
                    WebDriverWait(d, 30).until(lambda x: x.execute_script(
                        "return [...document.images].every(i => i.complete && i.naturalWidth > 0)"))

                for name, path, hook in (("bank", "/ui/bank?sort=rbar&order=desc&per_page=25", None),
                                         ("entry", f"/ui/entry/{merged}", None),
                                         ("search", "/ui/search", search), ("training", "/ui/training", charts)):
                    target = args.out / f"explorer-{name}.png"
                    _shoot(driver, server.url + path, target, hook)
                    written.append(target)
        finally:
            driver.quit()
            service.close()
    for p in written:
        print(p)
    return written


if __name__ == "__main__":
    main()
