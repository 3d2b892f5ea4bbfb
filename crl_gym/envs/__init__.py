"""Text environments of the paper, registered with Gymnasium under the ``crl/`` namespace, and
:func:`make` / :func:`resolve` of any Gymnasium id (:mod:`crl_gym.envs.ids`)."""

from crl_gym.envs.ids import ENTRY_POINT_GROUP, UnknownEnvError, resolve
from crl_gym.envs.registry import ENVS, MissingExtraError, make, register_all

register_all()

__all__ = [
    "ENTRY_POINT_GROUP",
    "ENVS",
    "MissingExtraError",
    "UnknownEnvError",
    "make",
    "register_all",
    "resolve",
]
