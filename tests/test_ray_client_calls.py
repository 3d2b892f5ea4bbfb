"""The Ray face without a cluster: :class:`ServiceActor` is a plain class (its methods answer the typed
results' JSON forms), and :class:`RayServiceClient` calls the actor through ``ServiceActor``'s own
methods and parses what comes back. Ray itself cannot run here: a stand-in ``ray`` module hands the
remote call to a local ``ServiceActor`` (tests/test_ray_service.py runs the real one where Ray is installed)."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from crl_gym.experience.results import Health, OpsApplied, ServiceStats, StepEnded
from crl_gym.experience.service import StepOrderError
from crl_gym.protocol import AddOp, DistillationRequest, Trajectory
from crl_train.config import config_to_dict, load_config
from crl_train.methods import make_method
from crl_train.service.ray_actor import RayServiceClient, ServiceActor


class _Remote:
    """``handle.method.remote(*a)``: runs ``method`` on the local actor; what ``ray.get`` returns."""

    def __init__(self, fn: Callable[..., object], calls: list[str]) -> None:
        self.fn, self.calls = fn, calls

    def remote(self, *args: object, **kwargs: object) -> object:
        self.calls.append(self.fn.__name__)
        try:
            return ("ok", self.fn(*args, **kwargs))
        except Exception as exc:  # noqa: BLE001 - handed to ray.get, as a task error would be
            return ("error", exc)


class _Handle:
    def __init__(self, actor: ServiceActor) -> None:
        self._actor, self.calls = actor, []  # type: ignore[var-annotated]

    def __getattr__(self, name: str) -> _Remote:
        return _Remote(getattr(self._actor, name), self.calls)


class RayError(Exception):
    pass


class RayTaskError(RayError):
    """Ray raises a task's exception wrapped, with the original as ``cause``."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


class RayActorError(RayError):
    pass


class GetTimeoutError(RayError):
    pass


def _get(ref: tuple[str, object], timeout: float | None = None) -> object:
    kind, value = ref
    if kind == "error":
        assert isinstance(value, BaseException)
        raise RayTaskError(value)
    return value


@pytest.fixture
def actor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ServiceActor]:
    cfg = load_config(None, ["method=grpo", "env.ids=[crl/Sokoban-6x6-v0]", "env.kwargs={}",
                             "experience.seed_entries=['Push the box onto the target.']"])
    fake, errors = types.ModuleType("ray"), types.ModuleType("ray.exceptions")
    fake.get = _get  # type: ignore[attr-defined]
    for cls in (RayError, RayTaskError, RayActorError, GetTimeoutError):
        setattr(errors, cls.__name__, cls)
    fake.exceptions = errors  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.setitem(sys.modules, "ray.exceptions", errors)
    a = ServiceActor(config_to_dict(cfg), str(tmp_path / "svc"), options=make_method(cfg).service_options())
    yield a
    a.close()


def test_the_actor_answers_json_forms_and_the_client_parses_them(actor: ServiceActor) -> None:
    assert actor.health() == {"status": "ok", "pending": 0, "extractor": None, "storage": None}  # grpo: no extractor
    handle = _Handle(actor)
    client = RayServiceClient("svc", timeout=5, handle=handle)
    ops = client.apply_ops([AddOp("Walk east to the exit.")])
    assert isinstance(ops, OpsApplied) and ops.added == 1
    hit = client.search("push the box")
    assert hit is not None and hit.text == "Push the box onto the target."
    client.submit(DistillationRequest(task="t", trajectory=Trajectory(), outcome=1.0, success=True,
                                      experience=None, rollout_step=0))
    ended = client.end_step(0)
    assert isinstance(ended, StepEnded) and (ended.ended, ended.requests) == ([0], 1)
    with pytest.raises(StepOrderError, match="already ended"):
        client.end_step(0)
    stats = client.stats()
    assert isinstance(stats, ServiceStats) and stats.bank_size == 2 and stats.last_ended_step == 0
    assert isinstance(client.health(), Health)
    assert handle.calls == ["apply_ops", "search", "submit", "end_step", "end_step", "stats", "health"]
