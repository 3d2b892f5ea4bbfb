"""The method registry: what each method trains."""

import pytest

from crl_train.algorithms import AdvantageEstimator
from crl_train.config import METHOD_NAMES
from crl_train.methods import METHODS, get_method


def test_every_config_method_is_registered() -> None:
    assert sorted(m.value for m in METHODS.names()) == sorted(METHOD_NAMES)


@pytest.mark.parametrize(
    ("name", "exp", "actor", "distill", "extractor", "adv"),
    [
        ("grpo", False, True, False, False, AdvantageEstimator.GRPO),
        ("complementary", True, True, True, True, AdvantageEstimator.SPLIT_SUBGROUP),
        ("static_online", True, True, True, False, AdvantageEstimator.SPLIT_SUBGROUP),
        ("exp_only", True, False, True, True, AdvantageEstimator.SPLIT_SUBGROUP),
        ("offline_exp", True, True, False, False, AdvantageEstimator.SPLIT_SUBGROUP),
        ("edge", True, True, True, False, AdvantageEstimator.EDGE_POOLED),
    ],
)
def test_method_specs(name: str, exp: bool, actor: bool, distill: bool, extractor: bool, adv: AdvantageEstimator) -> None:
    m = get_method(name)
    assert (m.uses_experience, m.train_actor, m.distill_online, m.train_extractor, m.advantage) == (exp, actor, distill, extractor, adv)
    assert m.offline_bank == (name == "offline_exp") and m.edge == (name == "edge")


def test_unknown_method() -> None:
    with pytest.raises(KeyError, match="accepted: grpo"):
        get_method("ppo")
