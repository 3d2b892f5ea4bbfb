"""The size limits of the experience service, applied the same way by every face.

* A search query is shortened, never refused: to ``ManagerConfig.max_query_chars`` (default
  :data:`MAX_QUERY_CHARS`) by the manager, and to the client's ``max_query_chars`` (same
  default) by :class:`~crl_gym.clients.RemoteClient` before it is sent, so a 1 MB observation
  searches the same way in process and over HTTP.
* ``search_many`` takes any number of queries; a ``RemoteClient`` sends them in calls of at most
  :data:`MAX_BATCH`.
* A distillation request whose text alone is larger than the server's body limit
  (:data:`MAX_BODY_BYTES`, ``crl-experience serve --max-body-bytes``) can never be delivered:
  ``submit`` refuses it at once with :class:`~crl_gym.errors.RequestTooLarge` on both clients
  (the wrappers count and log it as rejected, and the request stays in
  ``info["distillation_request"]``). One that passes that check but still encodes above the
  limit is spilled by the ``RemoteClient``'s sender with the same error, never dropped.
* Texts of ``/search``, ``/ask`` and ``/apply_ops`` bodies hold at most :data:`MAX_TEXT` characters.

>>> from crl_gym.protocol import DistillationRequest, Trajectory
>>> request = DistillationRequest("t" * 10, Trajectory(initial_observation="x" * 100), 0.0,
...                               False, None)
>>> request_text_chars(request)
110
>>> check_request_size(request, max_bytes=64)  # doctest: +ELLIPSIS +NORMALIZE_WHITESPACE
Traceback (most recent call last):
...
crl_gym.errors.RequestTooLarge: request ... holds 110 characters of text,
    more than the body limit of 64 bytes: ...
"""

from __future__ import annotations

from typing import Any

from crl_gym.errors import RequestTooLarge
from crl_gym.protocol import DistillationRequest

MAX_BODY_BYTES = 4 * 1024 * 1024
"""Default largest request body of the HTTP server, in bytes (``--max-body-bytes``)."""
MAX_TEXT = 1_000_000
"""Longest query, context or entry text one HTTP body field may hold, in characters."""
MAX_BATCH = 4096
"""Most queries / requests / ops in one HTTP call."""
MAX_QUERY_CHARS = 2000
"""Default length queries are shortened to before they are embedded
(``ManagerConfig.max_query_chars``)."""


def request_text_chars(request: DistillationRequest) -> int:
    """Characters of the request's task, observations and actions: a lower bound of its encoded
    size in bytes (UTF-8 takes at least a byte per character), read without encoding it."""
    record: list[Any] | None = getattr(request, "_record", None)
    total = len(request.task)
    if (
        record is not None
    ):  # a RecordedRequest not yet materialised: [obs0, a1, r1, info1, obs1, ...]
        return (
            total
            + sum(len(x) for x in record[0::4] if isinstance(x, str))
            + sum(len(x) for x in record[1::4] if isinstance(x, str))
        )
    trajectory = request.trajectory
    total += len(trajectory.initial_observation)
    for step in trajectory.steps:
        total += len(step.observation) + len(step.action)
    return total


def check_request_size(request: DistillationRequest, max_bytes: int) -> None:
    """Raise :class:`RequestTooLarge` when ``request`` cannot fit a body of ``max_bytes``."""
    chars = request_text_chars(request)
    if chars > max_bytes:
        raise RequestTooLarge(
            f"request {request.request_id} holds {chars} characters of text, more than the body "
            f"limit of {max_bytes} bytes: it can never be delivered as it is (raise the server's "
            "--max-body-bytes and the client's max_request_bytes, or shorten the env's "
            "observations)"
        )
