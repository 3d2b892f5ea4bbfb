"""The experience service's client for the verl loops and tools of one process (no verl import).

verl builds a new agent loop per sample (``hydra.utils.instantiate`` in ``AgentLoopWorker``) and one
tool object per worker; both reach ``crl-experience serve`` through one :class:`RemoteClient` per
(url, token) and process, made on first use, so its connection pool and sender thread are shared.
The url comes from the loop's or tool's config (``service_url``), else from ``CRL_EXPERIENCE_URL``;
the token from ``token_file``, else from ``CRL_EXPERIENCE_TOKEN`` (as ``crl-experience serve``).

>>> service_client(None)  # doctest: +ELLIPSIS +NORMALIZE_WHITESPACE
Traceback (most recent call last):
...
ValueError: no experience service: give service_url in the agent loop's (or tool's) config,
    or set CRL_EXPERIENCE_URL
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from crl_gym.clients import TOKEN_ENV, RemoteClient

URL_ENV = "CRL_EXPERIENCE_URL"
"""Environment variable with the service's url when the config gives none."""
DEFAULT_TIMEOUT_S = 60.0

_CLIENTS: dict[tuple[str, str | None], RemoteClient] = {}
_LOCK = threading.Lock()


def resolve_url(url: str | None) -> str:
    """``url``, else ``$CRL_EXPERIENCE_URL``; neither is a ``ValueError`` naming both."""
    found = url or os.environ.get(URL_ENV)
    if not found:
        raise ValueError(
            f"no experience service: give service_url in the agent loop's (or tool's) config, "
            f"or set {URL_ENV}"
        )
    return str(found)


def resolve_token(token_file: str | None) -> str | None:
    """The token in ``token_file`` (stripped; an empty file is an error), else
    ``$CRL_EXPERIENCE_TOKEN``."""
    if token_file:
        token = Path(token_file).read_text(encoding="utf-8").strip()
        if not token:
            raise ValueError(f"token file {token_file} is empty")
        return token
    return os.environ.get(TOKEN_ENV) or None


def service_client(
    url: str | None, token_file: str | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S
) -> RemoteClient:
    """This process's client of the service at ``url`` (made on first use, then shared)."""
    key = (resolve_url(url), resolve_token(token_file))
    with _LOCK:
        client = _CLIENTS.get(key)
        if client is None:
            client = _CLIENTS[key] = RemoteClient(key[0], timeout=timeout_s, token=key[1])
        return client


def close_clients() -> None:
    """Flush and close every client this process made (what could not be delivered is spilled)."""
    with _LOCK:
        clients = list(_CLIENTS.values())
        _CLIENTS.clear()
    for client in clients:
        client.close()


__all__ = ["URL_ENV", "close_clients", "resolve_token", "resolve_url", "service_client"]
