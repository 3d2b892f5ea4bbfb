"""The experience service as a Ray actor (a local Ray with 2 CPUs): detached, named, on the head node,
concurrent searches batched, the tiny extractor inside, the client's sync and awaitable faces, the
wrappers over it, checkpoint and resume from the head node's disk."""

from __future__ import annotations

import asyncio
import json
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# usearch's extension loaded before Ray's makes ray.init abort the whole process (std::regex_error):
# Ray is imported here, at collection, before any test builds a bank index.
USEARCH_FIRST = "usearch.index" in sys.modules and "ray" not in sys.modules
ray = pytest.importorskip("ray")

from _waiting import settle  # noqa: E402

from crl_gym.clients import ExperienceClient, ExperienceUnavailable  # noqa: E402
from crl_gym.experience.embedders import HashingEmbedder  # noqa: E402
from crl_gym.experience.service import StepOrderError  # noqa: E402
from crl_gym.experience.snapshots import list_snapshots  # noqa: E402
from crl_gym.protocol import AddOp, DistillationRequest, ExperienceRef, Step, Trajectory  # noqa: E402
from crl_gym.wrappers.examples import CorridorEnv  # noqa: E402
from crl_gym.wrappers.experience import ExperienceWrapper  # noqa: E402
from crl_train.config import config_from_dict, config_to_dict, load_config  # noqa: E402
from crl_train.methods import make_method  # noqa: E402
from crl_train.openrlhf.steps import ServiceStepMixin  # noqa: E402
from crl_train.service import ServiceOptions  # noqa: E402
from crl_train.service.ray_actor import (  # noqa: E402
    EmbedderPool,
    RayServiceClient,
    deploy_service,
    head_node_id,
)

NAMESPACE = "crl-test"
NAME = "svc"
SEED_ENTRY = "Find the staircase down (>) on the map and walk towards it."


def service_config() -> dict[str, Any]:
    cfg = load_config(None, ["env.ids=[crl/Sokoban-6x6-v0]", "env.kwargs={}", "manager.max_wait_ms=200",
                             "experience.distill_linger_s=0.05", "experience.distill_batch=4", "algo.merge_every=0",
                             f"experience.seed_entries=[{SEED_ENTRY!r}]", "extractor.tiny_vocab_size=320",
                             "extractor.tiny_hidden=32", "extractor.tiny_layers=1", "extractor.tiny_intermediate=64",
                             "extractor.max_context_tokens=512", "extractor.max_new_tokens=32"])
    return config_to_dict(cfg)


def service_options(config: dict[str, Any] | None = None) -> ServiceOptions:
    """The method's extractor side of ``config`` (default: :func:`service_config`)."""
    return make_method(config_from_dict(config or service_config())).service_options()


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    if USEARCH_FIRST:
        pytest.fail("usearch was loaded before Ray in this process, so ray.init would abort it: run this module "
                    "in a process that imports ray first (pytest collection normally does)")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace=NAMESPACE)
    yield str(ray.get_runtime_context().gcs_address)
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def service_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("service")


@pytest.fixture(scope="module")
def client(cluster: str, service_dir: Path) -> Iterator[RayServiceClient]:
    """Deployed by another driver process that exits at once: only a detached actor outlives it."""
    cfg_file = service_dir.parent / "service_config.json"
    cfg_file.write_text(json.dumps(service_config()))
    code = (
        "import json, ray\n"
        f"ray.init(address={cluster!r}, namespace={NAMESPACE!r}, log_to_driver=False)\n"
        "from crl_train.config import config_from_dict\n"
        "from crl_train.methods import make_method\n"
        "from crl_train.service.ray_actor import deploy_service\n"
        f"cfg = json.loads(open({str(cfg_file)!r}).read())\n"
        f"c = deploy_service(cfg, {str(service_dir)!r}, options=make_method(config_from_dict(cfg)).service_options(), "
        f"name={NAME!r}, "
        f"namespace={NAMESPACE!r}, num_cpus=1, max_concurrency=16, embedding_workers=2, reuse=False)\n"
        "print('NODE', c.node_id())\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    c = RayServiceClient(NAME, NAMESPACE, timeout=60)
    c.deployed_on = res.stdout.split("NODE", 1)[1].strip()  # type: ignore[attr-defined]
    yield c
    try:
        c.shutdown()
    except ExperienceUnavailable:
        pass


def request(entry: ExperienceRef | None, success: bool, seed: int = 0) -> DistillationRequest:
    steps = [Step("You are at cell 0.", "east", 0.0), Step("You are at cell 1.", "east", float(success))]
    return DistillationRequest(task="Walk east to the exit.", trajectory=Trajectory(steps=steps), outcome=float(success),
                               success=success, experience=entry, condition="guided" if entry else "free",
                               env_id="crl/Corridor", seed=seed)


def wait_for(fn: Any, what: str, timeout: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_embedder_pool_spreads_encodes_over_its_copies() -> None:
    pool = EmbedderPool([HashingEmbedder(32), HashingEmbedder(32)])
    barrier = threading.Barrier(8)

    def work() -> None:
        barrier.wait()
        for _ in range(20):
            pool.encode(["walk east", "the exit"])

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(pool.calls) == 160 and min(pool.calls) > 0
    assert (pool.encode(["x"]) == HashingEmbedder(32).encode(["x"])).all()
    with pytest.raises(ValueError, match="disagree on the dimension"):
        EmbedderPool([HashingEmbedder(16), HashingEmbedder(32)])


def test_service_is_detached_named_and_pinned_to_the_head_node(client: RayServiceClient) -> None:
    assert client.health().status == "ok" and client.health().extractor == "alive"
    head = head_node_id()
    assert client.node_id() == head == client.deployed_on  # type: ignore[attr-defined]
    assert isinstance(client, ExperienceClient)
    with pytest.raises(ExperienceUnavailable, match="no experience service 'nobody'"):
        RayServiceClient("nobody", NAMESPACE).search("x")


def test_client_has_the_whole_interface(client: RayServiceClient) -> None:
    assert client.get_requests(1) == []
    hit = client.search("Find the staircase")
    assert isinstance(hit, ExperienceRef) and hit.text == SEED_ENTRY
    assert [r.text if r else None for r in client.search_many(["stairs", "map"])] == [SEED_ENTRY, SEED_ENTRY]
    assert client.apply_ops([AddOp("Walk east until the corridor ends.")]).added == 1
    answer, provenance = client.ask("which way?", hit, "a corridor")
    assert answer and provenance is not None and provenance["token_ids"]  # the tiny extractor answered
    step = int(client.stats().last_ended_step) + 1
    for i in range(3):
        client.submit(request(hit, i % 2 == 0, seed=i))
    ended = client.end_step(step)
    assert ended.ended == [step] and ended.requests == 3 and ended.credited >= 1
    with pytest.raises(StepOrderError, match="already ended"):
        client.end_step(step)
    with pytest.raises(StepOrderError):
        client.end_step(-1)
    with pytest.raises(TypeError, match="DistillationRequest"):
        client.submit({"task": "x"})  # type: ignore[arg-type]
    stats = client.stats()
    assert stats.bank_size >= 2 and stats.submitted >= 3 and stats.last_ended_step == step
    # the extractor inside the actor distils what it was sent
    wait_for(lambda: client.stats().distilled >= 3, "distillation inside the actor")


def test_concurrent_searches_are_batched_by_the_manager(client: RayServiceClient) -> None:
    before = client.stats().manager
    barrier = threading.Barrier(16)
    errors: list[BaseException] = []

    def search(i: int) -> None:
        barrier.wait()
        try:
            assert client.search(f"where is the exit number {i}") is not None
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=search, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    after = client.stats().manager
    requests, batches = after["requests"] - before["requests"], after["batches"] - before["batches"]  # type: ignore[operator]
    assert requests == 16
    assert batches < requests / 2, f"{requests} concurrent searches went out in {batches} batches"


def test_awaitable_twins_from_async_code(client: RayServiceClient) -> None:
    async def main() -> tuple[Any, ...]:
        hits = await asyncio.gather(*[client.asearch(f"stairs {i}") for i in range(6)])
        many = await client.asearch_many(["stairs"])
        answer = await client.aask("which way?", hits[0], "a room")
        await client.asubmit(request(hits[0], True, seed=9))
        step = int((await client.astats()).last_ended_step) + 1
        ended = await client.aend_step(step)
        added = await client.aapply_ops([AddOp("Keys open doors.")])
        with pytest.raises(StepOrderError):
            await client.aend_step(step)
        with pytest.raises(ExperienceUnavailable):
            await RayServiceClient("nobody", NAMESPACE).asearch("x")
        return hits, many, answer, ended, added, await client.ahealth()

    hits, many, answer, ended, added, health = asyncio.run(main())
    assert all(isinstance(h, ExperienceRef) for h in hits) and len(many) == 1
    assert isinstance(answer[0], str) and ended.requests == 1 and added.added == 1 and health.status == "ok"


def test_wrappers_run_over_the_ray_client_and_it_pickles(client: RayServiceClient) -> None:
    copy = pickle.loads(pickle.dumps(client))
    env = ExperienceWrapper(CorridorEnv(length=1), copy, env_id="crl/Corridor")
    submitted = client.stats().submitted
    obs, info = env.reset(seed=0, options={"experience": "guided"})
    assert info["experience"] is not None and info["experience"]["text"] in obs
    *_, info = env.step("east")
    assert info["distillation_request"].success
    assert client.stats().submitted == submitted + 1


def test_trainer_mixin_ends_steps_and_checkpoints_the_service(client: RayServiceClient, service_dir: Path) -> None:
    class StandIn:  # OpenRLHF's BasePPOTrainer.train_step (it needs CUDA to exist)
        def train_step(self, samples: Any, global_step: int) -> tuple[dict[str, Any], int]:
            return {}, global_step + 1

    class Trainer(ServiceStepMixin, StandIn):
        pass

    trainer = Trainer()
    trainer.crl_setup(client, checkpoint_every=1)
    first = trainer.crl_step
    status, _ = trainer.train_step([], 0)
    assert status["crl/service_up"] == 1.0 and client.stats().last_ended_step == first
    ckpt = service_dir / "checkpoint"
    state = json.loads((ckpt / "state.json").read_text())
    assert state["service"]["last_ended"] == first and (ckpt / "extractor").is_dir()
    # the checkpoint names the bank snapshot it pairs with
    assert state["bank_snapshot"].startswith(f"checkpoint-step-{first}-")
    assert state["bank_snapshot"] in [s.name for s in list_snapshots(service_dir / "bank")]


def test_bank_and_state_survive_the_actor(client: RayServiceClient, service_dir: Path) -> None:
    client.checkpoint()
    stats = client.stats()
    client.shutdown()
    with pytest.raises(ExperienceUnavailable):
        client.health()
    again = deploy_service(service_config(), service_dir, options=service_options(), name=NAME, namespace=NAMESPACE, num_cpus=1,
                           max_concurrency=4)
    resumed = again.stats()
    assert resumed.bank_size == stats.bank_size and resumed.last_ended_step == stats.last_ended_step
    assert again.search("Keys open doors") is not None
    with pytest.raises(StepOrderError):
        again.end_step(stats.last_ended_step)  # steps ended before the restart stay ended


def test_on_node_keeps_an_actor_made_by_plain_remote_on_its_node(cluster: str) -> None:
    """What the launcher hands OpenRLHF in place of its trainer class (``PPOTrainer.remote(...)``)."""
    from crl_train.openrlhf.placement import OnNode

    head = head_node_id()
    pinned = OnNode(ray.remote(num_cpus=0)(HashingEmbedder), head)
    actor = pinned.remote(16)
    where = ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()), timeout=120)
    assert where == head and ray.get(actor.encode.remote(["x"]), timeout=60).shape == (1, 16)
    ray.kill(actor)


def _written_entries(service_dir: Path) -> list[ExperienceRef]:
    """The entries the extractor wrote (they have a sample to credit), read beside the actor's writer."""
    from crl_gym.experience.store import open_readonly

    db = open_readonly(service_dir / "bank" / "bank.sqlite")
    try:
        rows = db.execute("SELECT id, text, version FROM entries WHERE provenance IS NOT NULL ORDER BY id").fetchall()
    finally:
        db.close()
    return [ExperienceRef(int(i), str(t), int(v)) for i, t, v in rows]


def _play(client: RayServiceClient, entries: list[ExperienceRef], step: int) -> None:
    """One rollout step: two guided episodes on each of ``entries`` (one won, one lost: r̄(m) = 0), then its end."""
    for n, entry in enumerate(entries):
        client.submit(request(entry, success=True, seed=2 * n))
        client.submit(request(entry, success=False, seed=2 * n + 1))
    client.end_step(step)


def test_a_restarted_service_actor_resumes_its_buffer_and_trains(cluster: str, tmp_path: Path) -> None:
    """As ``crl-experience serve --extractor`` restarted on its bank directory (tests/test_resume_state.py):
    stopping the actor checkpoints B_φ, π_φ and the counters; a new actor on the directory goes on
    from them, its bank as it was, and its extractor trains on the restored samples."""
    service_dir = tmp_path / "service"
    config = service_config()
    config["algo"]["buffer_size"] = 2  # a CISPO update per two credited entries

    def start() -> RayServiceClient:
        return deploy_service(config, service_dir, options=service_options(config), name="resumed", namespace=NAMESPACE, num_cpus=1, max_concurrency=4)

    first = start()
    try:
        for i in range(4):  # free episodes: the extractor writes entries, each with its sample
            first.submit(request(None, success=True, seed=i))
        first.end_step(0)
        settle(first, lambda s: s.distilled >= 4 and s.queue_depth == 0, "4 distilled", timeout=300.0)
        written = _written_entries(service_dir)
        assert written, "the extractor wrote no entry"
        entries = written[:3] if len(written) >= 3 else written[:1]  # an odd number of credits: one stays in B_φ
        _play(first, entries, 1)
        before = settle(first, lambda s: s.distilled >= 4 + 2 * len(entries) and s.queue_depth == 0
                         and s.credited == len(entries) and s.get("buffer_size") == 1, "the credits in B_φ",
                         timeout=300.0)
    finally:
        first.shutdown()  # closing writes the checkpoint: no explicit checkpoint() before it
    assert (service_dir / "checkpoint" / "state.json").is_file()
    again = start()
    try:
        resumed = again.stats()
        for key in ("buffer_size", "extractor_updates", "credited", "distilled", "bank_size", "last_ended_step"):
            assert resumed.get(key) == before.get(key), (key, resumed.get(key), before.get(key))
        _play(again, _written_entries(service_dir)[:1], 2)  # the restored sample and a new one: the extractor trains
        after = settle(again, lambda s: s.extractor_updates > before.extractor_updates, "an update after the restart",
                       timeout=300.0)
        assert after.get("errors") == 0 and after.get("unreplayable") == 0 and after.extractor == "alive"
    finally:
        again.shutdown()
