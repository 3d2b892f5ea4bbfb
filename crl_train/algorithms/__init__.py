"""Pure-torch algorithms: advantages, losses, extractor rewards, reweighting, EDGE.

Importing this package registers every estimator and loss in
:data:`~crl_train.algorithms.registry.ADVANTAGES` and :data:`~crl_train.algorithms.registry.LOSSES`.
"""

from crl_train.algorithms import edge, extractor_rewards, losses, reweighting
from crl_train.algorithms.advantages import (
    FREE,
    GUIDED,
    grpo_advantages,
    sequence_weights,
    split_subgroup_advantages,
)
from crl_train.algorithms.edge import (
    EdgeAdvantageParams,
    edge_pooled_advantages,
    edge_train_mask,
    ema_utility,
    gain_gate,
    marginal_gain,
    prune_mask,
)
from crl_train.algorithms.extractor_rewards import (
    GATE_SCORES,
    PERPLEXITY_TRANSFORMS,
    batch_advantages,
    entry_mean_rewards,
    entry_rewards,
    episode_rewards,
    free_baselines,
    outcome_rewards,
    perplexity_bonus,
    relative_outcomes,
)
from crl_train.algorithms.losses import (
    CispoParams,
    ClipParams,
    CoefParams,
    cispo_loss,
    clip_surrogate_loss,
    loss_scale_for,
    reverse_kl_sampled_loss,
    reverse_kl_support_loss,
    reverse_kl_topk_loss,
    self_distill_nll_loss,
)
from crl_train.algorithms.registry import (
    ADVANTAGES,
    LOSSES,
    AdvantageEstimator,
    AdvantageParams,
    LossParams,
    PolicyLoss,
)
from crl_train.algorithms.reweighting import training_count_weights

__all__ = [
    "ADVANTAGES",
    "LOSSES",
    "AdvantageEstimator",
    "AdvantageParams",
    "EdgeAdvantageParams",
    "CispoParams",
    "ClipParams",
    "CoefParams",
    "LossParams",
    "PolicyLoss",
    "FREE",
    "GUIDED",
    "GATE_SCORES",
    "grpo_advantages",
    "split_subgroup_advantages",
    "sequence_weights",
    "edge_pooled_advantages",
    "edge_train_mask",
    "ema_utility",
    "gain_gate",
    "marginal_gain",
    "prune_mask",
    "batch_advantages",
    "entry_rewards",
    "episode_rewards",
    "free_baselines",
    "entry_mean_rewards",
    "relative_outcomes",
    "perplexity_bonus",
    "PERPLEXITY_TRANSFORMS",
    "outcome_rewards",
    "cispo_loss",
    "clip_surrogate_loss",
    "loss_scale_for",
    "reverse_kl_topk_loss",
    "reverse_kl_sampled_loss",
    "reverse_kl_support_loss",
    "self_distill_nll_loss",
    "training_count_weights",
    "edge",
    "extractor_rewards",
    "losses",
    "reweighting",
]
