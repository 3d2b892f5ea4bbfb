"""crl_gym: experience-augmented Gymnasium wrappers, the experience bank and text environments.

Importing the package registers the ``crl/`` environments with Gymnasium.
"""

from crl_gym import envs as _envs  # noqa: F401  (registers crl/ ids)

__version__ = "0.1.0"
