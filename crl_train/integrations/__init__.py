"""Other RL libraries' trainers with Complementary RL's actor side (split-subgroup advantages).

Each submodule imports its library itself; importing this package imports none of them.
``crl_train.integrations.trl``: ``ComplementaryGRPOTrainer``, TRL's GRPOTrainer (docs/wrappers.md).
``crl_train.integrations.verl``: verl's ``crl_split_subgroup`` estimator and ``crl_sync`` trainer.
"""
