"""The CPU split of the two tracks (pure function) and pinning this process."""

from __future__ import annotations

import os

import pytest

from crl_train.policy.affinity import CpuSplit, available_cpus, pin_process, split_cpus


def test_default_split_halves_the_cores_actor_takes_the_larger_half() -> None:
    # 2 cores: one each (the paper's "own GPUs" on this machine)
    assert split_cpus((0, 1)) == CpuSplit((0,), (1,), (0, 1))
    # 5 cores: ceil(5/2) = 3 for the actor (the critical path), 2 for the extractor
    assert split_cpus((4, 0, 2, 1, 3)) == CpuSplit((0, 1, 2), (3, 4), (0, 1, 2, 3, 4))
    # a restricted affinity mask (e.g. taskset 2,5): the split is of what this process may use
    assert split_cpus((5, 2)) == CpuSplit((2,), (5,), (2, 5))


def test_one_core_or_pinning_off_pins_nothing() -> None:
    assert split_cpus((3,)) == CpuSplit(None, None, (3,))
    assert split_cpus((0, 1, 2, 3), pin=False) == CpuSplit(None, None, (0, 1, 2, 3))
    assert "no pinning" in split_cpus((0,)).describe() and "pinning off" in split_cpus((0, 1), pin=False).describe()


def test_given_cores_are_used_and_the_other_track_gets_the_rest() -> None:
    assert split_cpus((0, 1, 2, 3), actor_cpus=(1,), extractor_cpus=(3, 2)) == CpuSplit((1,), (2, 3), (0, 1, 2, 3))
    assert split_cpus((0, 1, 2, 3), actor_cpus=(0, 1, 2)) == CpuSplit((0, 1, 2), (3,), (0, 1, 2, 3))
    assert split_cpus((0, 1, 2, 3), extractor_cpus=(0,)) == CpuSplit((1, 2, 3), (0,), (0, 1, 2, 3))
    assert "actor (trainer process) cores (1, 2, 3)" in split_cpus((0, 1, 2, 3), extractor_cpus=(0,)).describe()


@pytest.mark.parametrize(("actor", "extractor", "message"), [
    ((7,), None, "experience.actor_cpus: cores [7] are not available"),
    (None, (0, 9), "experience.extractor_cpus: cores [9] are not available"),
    ((0, 1), (1,), "share cores [1]"),
    ((0, 1), None, "leaves no core for the other track"),
    ((), None, "experience.actor_cpus is empty"),
])
def test_bad_splits_name_the_field(actor: tuple[int, ...] | None, extractor: tuple[int, ...] | None, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        split_cpus((0, 1), actor, extractor)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
def test_pin_process_pins_and_returns_the_previous_cores() -> None:
    before = available_cpus()
    target = (before[-1],)
    assert pin_process(target) == before
    try:
        assert tuple(sorted(os.sched_getaffinity(0))) == target
    finally:
        assert pin_process(before) == target
    assert available_cpus() == before
    assert pin_process(None) is None
