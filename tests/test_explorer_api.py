"""The explorer's JSON routes and pages, in process (the browser tests drive the same routes)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from crl_gym.experience.bank import ExperienceBank
from crl_gym.experience.embedders import HashingEmbedder, embedder_name
from crl_gym.experience.manager import ExperienceManager
from crl_gym.experience.merge import merge_bank
from crl_gym.experience.service import RetrievalService
from crl_gym.explorer import BankSource, explorer_app
from crl_gym.protocol import AddOp, DistillationRequest, ExperienceRef, Trajectory, UpdateOp
from crl_gym.server import create_app

EMB = HashingEmbedder(64)
TOKEN = "s3cret-token"
HOSTILE = "<script>window.__pwned = 1</script><a href=\"javascript:window.__pwned=2\">x</a> \u202eevil\u202c"


def _fill(service: RetrievalService) -> dict[str, int]:
    """30 entries at step 0, an Update at 2, a Merge of two at 3, a hostile Add and two credits at 4."""
    ids = service.manager.apply_ops([AddOp(f"entry {i:02d}: open the door with the key {i}") for i in range(30)],
                                    step=0).added
    service.manager.apply_ops([UpdateOp(ids[3], "entry 03: open the red door with the brass key")], step=2)
    bank = service.manager.bank
    merge = json.dumps({"E1": "merge", "E2": "merge", "merged": "Doors open with their keys."})
    report = merge_bank(bank, EMB, lambda ps: [merge for _ in ps], order="id", step=3)
    assert report.ok, report.error
    hostile = service.manager.apply_ops([AddOp(HOSTILE)], step=4).added[0]
    bank.record_credits(4, [(ids[5], 1.0, 3), (ids[6], -1.0, 1)])
    return {"first": ids[0], "updated": ids[3], "anchor": next(iter(report.updated)), "hostile": hostile,
            "credited": ids[5]}


@pytest.fixture()
def served(tmp_path: Path):
    bank = ExperienceBank(tmp_path / "bank", dim=EMB.dim, embedder_name=embedder_name(EMB))
    service = RetrievalService(ExperienceManager(bank, EMB))
    ids = _fill(service)
    app = create_app(service, TOKEN)
    with TestClient(app) as client:
        yield client, service, ids
    app.state.explorer.close()
    app.state.coalescer.close()
    service.close()


def _get(client: TestClient, path: str, token: str | None = TOKEN) -> dict:
    r = client.get(path, headers={"Authorization": f"Bearer {token}"} if token else {})
    assert r.status_code == 200, r.text
    return r.json()


def test_data_needs_the_token_and_pages_hold_no_data(served) -> None:
    client, _, ids = served
    for path in ("/ui/api/entries", f"/ui/api/entries/{ids['first']}", "/ui/api/search?q=door", "/ui/api/timeline",
                 "/ui/api/plots/ops.svg", "/ui/api/summary"):
        assert client.get(path).status_code == 401
        assert client.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
    page = client.get("/ui/bank")
    assert page.status_code == 200 and "open the door" not in page.text
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert client.get("/ui/static/explorer.js").status_code == 200


def test_pages_sort_and_filter_server_side(served) -> None:
    client, service, ids = served
    n = len(service.manager.bank)
    p1 = _get(client, "/ui/api/entries?per_page=10")
    assert p1["total"] == n and p1["pages"] == -(-n // 10) and len(p1["entries"]) == 10
    p2 = _get(client, "/ui/api/entries?per_page=10&page=2")
    assert [e["id"] for e in p1["entries"]] + [e["id"] for e in p2["entries"]] == sorted(service.manager.bank.ids())[:20]
    by_rbar = _get(client, "/ui/api/entries?sort=rbar&order=desc&per_page=2")["entries"]
    assert by_rbar[0]["id"] == ids["credited"] and by_rbar[0]["rbar"] == 1.0 and by_rbar[0]["episodes"] == 3
    by_version = _get(client, "/ui/api/entries?sort=version&order=desc&per_page=1")["entries"]
    assert by_version[0]["version"] >= 1
    found = _get(client, "/ui/api/entries?q=brass")
    assert [e["id"] for e in found["entries"]] == [ids["updated"]]
    assert _get(client, "/ui/api/entries?q=100%25")["total"] == 0  # % is a character, not a wildcard
    assert _get(client, "/ui/api/entries?credited=true")["total"] == 2
    assert client.get("/ui/api/entries?sort=text;DROP", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 422


def test_search_is_the_services_own_and_records_nothing(served) -> None:
    client, service, _ = served
    q = "open the red door with the brass key"
    before = {e.id: e.retrieval_count for e in service.manager.bank}
    d = _get(client, f"/ui/api/search?q={q}&k=3")
    assert {e.id: e.retrieval_count for e in service.manager.bank} == before
    assert len(d["picked"]) == 3 and d["candidates"][0]["similarity"] >= d["candidates"][-1]["similarity"]
    top = service.search(q)
    assert top is not None and d["picked"][0] == top.id


def test_entry_history_shows_update_merge_and_the_hostile_text_verbatim(served) -> None:
    client, _, ids = served
    upd = _get(client, f"/ui/api/entries/{ids['updated']}")
    assert [e["kind"] for e in upd["events"]][:2] == ["add", "update"]
    assert upd["events"][1]["text"] == "entry 03: open the red door with the brass key"
    merged = _get(client, f"/ui/api/entries/{ids['anchor']}")
    assert any(e["kind"] == "merge" and e["step"] == 3 and len(e["detail"]["sources"]) == 2 for e in merged["events"])
    hostile = _get(client, f"/ui/api/entries/{ids['hostile']}")
    assert hostile["entry"]["text"] == HOSTILE
    credited = _get(client, f"/ui/api/entries/{ids['credited']}")
    assert credited["credits"] == [{"step": 4, "rbar": 1.0, "episodes": 3}]
    assert client.get("/ui/api/entries/999999", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 404


def test_over_training_counts_and_charts(served) -> None:
    client, service, _ = served
    t = _get(client, "/ui/api/timeline")
    assert t["steps"] == [0, 1, 2, 3, 4]
    assert t["adds"] == [30, 0, 0, 0, 1] and t["updates"][2] == 1 and t["merges"][3] == 1
    assert t["bank_size"][-1] == len(service.manager.bank)
    assert t["mean_rbar"][4] == 0.0 and t["mean_rbar"][0] is None
    svg = client.get("/ui/api/plots/bank_size.svg", headers={"Authorization": f"Bearer {TOKEN}"})
    assert svg.headers["content-type"].startswith("image/svg+xml")
    root = ET.fromstring(svg.text)
    assert root.tag.endswith("svg") and root.findall(".//{http://www.w3.org/2000/svg}polyline")


def test_ui_opens_a_run_dir_read_only_and_shows_its_episodes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    bank = ExperienceBank(run / "bank", dim=EMB.dim, embedder_name=embedder_name(EMB))
    mgr = ExperienceManager(bank, EMB)
    a = mgr.apply_ops([AddOp("go east to the stairs"), AddOp("avoid the lava")], step=0).added[0]
    req = DistillationRequest(task="find the stairs", trajectory=Trajectory(), outcome=1.0, success=True,
                              experience=ExperienceRef(a, "go east to the stairs"), condition="guided",
                              env_id="crl/Room", seed=3, rollout_step=0)
    (run / "trajectories.jsonl").write_text(req.to_json() + "\n{not json\n", encoding="utf-8")
    mgr.close()
    bank.close()
    files = {p: p.stat().st_mtime_ns for p in (run / "bank").iterdir()}
    source = BankSource.open(run)
    app = explorer_app(source)
    with TestClient(app) as client:
        d = _get(client, f"/ui/api/entries/{a}", token=None)
        assert d["episodes"][0]["success"] is True and d["episodes"][0]["seed"] == 3
        assert _get(client, "/ui/api/search?q=stairs", token=None)["picked"] == [a]
        assert _get(client, "/ui/api/summary", token=None)["read_only"] is True
        methods = {m for r in app.routes for m in getattr(r, "methods", ()) or ()}
        assert methods <= {"GET", "HEAD"}
    source.close()
    after = {p: p.stat().st_mtime_ns for p in (run / "bank").iterdir()}
    assert {p: t for p, t in after.items() if p in files} == files  # nothing written
    # what SQLite itself needs to read a WAL database: its (empty) log and shared-memory files
    assert {p.name for p in after if p not in files} <= {"bank.sqlite-wal", "bank.sqlite-shm"}
    assert not (run / "bank" / "bank.sqlite-wal").exists() or (run / "bank" / "bank.sqlite-wal").stat().st_size == 0


def test_the_ui_command_serves_a_run_dir(tmp_path: Path) -> None:
    import socket
    import subprocess
    import sys
    import time

    import httpx

    bank = ExperienceBank(tmp_path / "run" / "bank", dim=EMB.dim, embedder_name=embedder_name(EMB))
    bank.add("go east to the stairs", EMB.encode(["go east to the stairs"])[0])
    bank.close()
    (tmp_path / "token").write_text(TOKEN)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "crl_gym.cli", "ui", "--bank", str(tmp_path / "run"), "--port", str(port),
                             "--token-file", str(tmp_path / "token"), "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 60
        while True:
            try:
                httpx.get(f"{url}/health", timeout=2).raise_for_status()
                break
            except httpx.HTTPError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
                time.sleep(0.2)
        assert httpx.get(f"{url}/ui/api/entries").status_code == 401
        got = httpx.get(f"{url}/ui/api/entries", headers={"Authorization": f"Bearer {TOKEN}"}).json()
        assert [e["text"] for e in got["entries"]] == ["go east to the stairs"]
        assert httpx.post(f"{url}/apply_ops", json={"ops": []}, headers={"Authorization": f"Bearer {TOKEN}"}).status_code in (404, 405)
        assert httpx.get(f"{url}/ui/bank").status_code == 200
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
    missing = subprocess.run([sys.executable, "-m", "crl_gym.cli", "ui", "--bank", str(tmp_path)], capture_output=True, text=True)
    assert missing.returncode != 0 and "neither" in missing.stderr


def test_out_of_range_filters_are_422s(served) -> None:
    client, _, _ = served
    auth = {"Authorization": f"Bearer {TOKEN}"}
    for qs in ("step_min=99999999999999999999", "min_retrievals=-1", "per_page=1000", "page=0", "order=up"):
        assert client.get(f"/ui/api/entries?{qs}", headers=auth).status_code == 422, qs


def test_an_entry_shows_who_wrote_it_and_whether_it_is_quarantined(served) -> None:
    client, service, ids = served
    auth = {"Authorization": f"Bearer {TOKEN}"}
    updated = _get(client, f"/ui/api/entries/{ids['updated']}")  # its current text: the Update's, at step 2
    assert updated["origin"]["written_by"] == "user" and updated["origin"]["step"] == 2
    assert not updated["origin"]["quarantined"]
    assert _get(client, f"/ui/api/entries/{ids['anchor']}")["origin"]["written_by"] == "merge"
    # over HTTP with the token: hide what the user wrote at step 4 (the hostile entry), then bring it back
    assert client.post("/quarantine", json={"written_by": "user", "steps": "4:4"}).status_code == 401
    r = client.post("/quarantine", json={"written_by": "user", "steps": "4:4"}, headers=auth)
    assert r.status_code == 200 and r.json()["entries"] == [ids["hostile"]], r.text
    assert ids["hostile"] not in service.manager.bank
    assert _get(client, f"/ui/api/entries/{ids['hostile']}")["origin"]["quarantined"] is True
    assert client.post("/snapshot", json={"name": "hidden"}, headers=auth).status_code == 200
    summary = _get(client, "/ui/api/summary")
    assert summary["quarantined"] == 1 and [s["name"] for s in summary["snapshots"]] == ["hidden"]
    r = client.post("/quarantine", json={"written_by": "user", "steps": "4:4", "undo": True}, headers=auth)
    assert r.json()["entries"] == [ids["hostile"]] and ids["hostile"] in service.manager.bank
    assert client.post("/quarantine", json={"written_by": "user", "steps": "9:1"}, headers=auth).status_code == 422


def test_the_explorer_shows_which_entries_are_pinned(served) -> None:
    from crl_gym.experience.pinning import UNPINNED_TAG
    from crl_gym.protocol import ExtractorSample

    client, service, ids = served
    distilled = service.manager.apply_ops([AddOp("take the key before the door")], step=5,
                                          sample=ExtractorSample("p", "ADD", [-0.1])).added[0]
    loose = service.manager.apply_ops([AddOp("any door will do", tags=(UNPINNED_TAG,))], step=5).added[0]
    rows = {e["id"]: e["pinned"] for e in _get(client, "/ui/api/entries?per_page=100")["entries"]}
    assert rows[ids["first"]] is True and rows[distilled] is False and rows[loose] is False
    assert _get(client, f"/ui/api/entries/{ids['first']}")["entry"]["pinned"] is True
    assert _get(client, f"/ui/api/entries/{distilled}")["entry"]["pinned"] is False
