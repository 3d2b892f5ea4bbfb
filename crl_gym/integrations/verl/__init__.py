"""Our wrapped envs and the experience service inside verl 0.9.1 (``verl.experimental.agent_loop``).

* :mod:`~crl_gym.integrations.verl.agent_loop`: :class:`ExperienceAgentLoop`, registered as
  ``crl_agent``: one episode of a wrapped env per dataset row copy, the model reached through
  verl's ``server_manager``.
* :mod:`~crl_gym.integrations.verl.tool`: :class:`SearchAndAskTool`, the ``search_and_ask`` tool
  as a verl ``BaseTool`` (verl's own ``ToolAgentLoop`` runs it).
* :mod:`~crl_gym.integrations.verl.rows`: the dataset rows these read (no verl import).

The trainer side (split-subgroup advantages, ``end_step`` once per training step) is
``crl_train.integrations.verl``. Importing this package imports no verl module; the two
submodules that subclass verl's classes import verl themselves, inside :func:`verl_required`
(docs/wrappers.md, "From verl").
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

VERL_REQUIREMENT = "verl==0.9.1"
"""The verl release these integrations are written against."""


@contextmanager
def verl_required(module: str) -> Iterator[None]:
    """Import verl inside it: an ``ImportError`` becomes one that says ``module`` needs verl and
    how to install it (for this package's modules and ``crl_train.integrations.verl``).

    >>> with verl_required("crl_gym.integrations.verl.example"):  # doctest: +NORMALIZE_WHITESPACE
    ...     import a_module_that_is_not_installed
    Traceback (most recent call last):
    ...
    ImportError: crl_gym.integrations.verl.example needs verl==0.9.1
        (pip install 'complementary-rl[verl]'; this project's tests: make install-verl)
    """
    try:
        yield
    except ImportError as exc:  # pragma: no cover - exercised only without verl
        raise ImportError(
            f"{module} needs {VERL_REQUIREMENT} (pip install 'complementary-rl[verl]'; "
            "this project's tests: make install-verl)"
        ) from exc


__all__ = ["VERL_REQUIREMENT", "verl_required"]
