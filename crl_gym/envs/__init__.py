"""Text environments of the paper, registered with Gymnasium under the ``crl/`` namespace."""

from crl_gym.envs.registry import ENVS, MissingExtraError, make, register_all

register_all()

__all__ = ["ENVS", "MissingExtraError", "make", "register_all"]
