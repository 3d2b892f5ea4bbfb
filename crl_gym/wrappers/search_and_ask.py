"""``SearchAndAskWrapper``: the agent's ``search_and_ask[<query>]`` tool.

Instead of an env action the agent may write ``search_and_ask[<what it is stuck on>]``. The
wrapper does not step the env: it retrieves the best entry for the query, asks the client to
have the extractor refine it for the agent's situation (the raw entry when no extractor is
attached) and returns the answer, followed by the unchanged current observation, as the next
observation, with reward 0. Calls per episode are capped (``max_calls``, default 2); a call
over the cap gets an observation saying so and still does not step the env. A call cut off
before its bracket closes (``search_and``, ``search_and_ask[where is``: the model's token budget
ran out) is answered as a tool error, never sent to the env, counted in ``malformed_count`` and
logged once (:func:`is_malformed_call`).

One call per action: when an action holds several ``search_and_ask[...]``, the first is taken
and the rest of the action is ignored. With the default pattern brackets inside a query nest
(``search_and_ask[what does [x] mean?]`` asks ``what does [x] mean?``). A query longer than
``max_query_chars`` (default 500) is cut to that length before it is searched and echoed. When
the observation space is a ``Text`` space, the answer observation fits it by shortening the
echoed query first and then the answer: the current observation is never cut off, nor changed
(only the query and the answer are fitted to the space's charset).

Every intercepted turn carries ``info["search_and_ask"] = {"status", "query", "call",
"calls_left"}`` where ``call`` is a :class:`~crl_gym.protocol.SearchCall` (``None`` when
nothing was retrieved). An outer :class:`~crl_gym.wrappers.ExperienceWrapper` records such
turns as ``Step(kind="search_and_ask")`` and the calls in ``Trajectory.search_calls``, so the
trainer can credit them — wrap in this order: ``ExperienceWrapper(SearchAndAskWrapper(env))``
(or use :func:`crl_gym.wrappers.wrap`).

>>> from crl_gym.clients import LocalClient
>>> from crl_gym.experience.bank import ExperienceBank
>>> from crl_gym.experience.embedders import HashingEmbedder
>>> from crl_gym.experience.manager import ExperienceManager
>>> from crl_gym.wrappers.examples import CorridorEnv
>>> emb = HashingEmbedder(64); bank = ExperienceBank(None, dim=64)
>>> hint = "In a corridor, keep walking east."
>>> _ = bank.add(hint, emb.encode([hint])[0])
>>> manager = ExperienceManager(bank, emb)
>>> env = SearchAndAskWrapper(CorridorEnv(length=2), LocalClient(manager))
>>> obs, info = env.reset(seed=0)
>>> obs, reward, terminated, truncated, info = env.step("search_and_ask[which way is the exit?]")
>>> print(obs)
Answer to search_and_ask[which way is the exit?]:
In a corridor, keep walking east.
<BLANKLINE>
You are at cell 0 of a corridor; the exit is at cell 2, to the east.
>>> info["search_and_ask"]["status"], info["search_and_ask"]["calls_left"], env.unwrapped.turn
('answered', 1, 0)
>>> manager.close()
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING, Any, SupportsFloat

import gymnasium as gym
from gymnasium import spaces

from crl_gym.clients.keeping import reraise_misuse
from crl_gym.json_types import EnvInfo, EnvOptions
from crl_gym.protocol import SearchCall
from crl_gym.templates import (
    SEARCH_AND_ASK_ANSWER_TEMPLATE,
    SEARCH_AND_ASK_EMPTY_QUERY_TEMPLATE,
    SEARCH_AND_ASK_ERROR_TEMPLATE,
    SEARCH_AND_ASK_MALFORMED_TEMPLATE,
    SEARCH_AND_ASK_NO_ENTRY_TEMPLATE,
    SEARCH_AND_ASK_OVER_CAP_TEMPLATE,
)
from crl_gym.wrappers.accepted_envs import require_gym_env, require_text_spaces
from crl_gym.wrappers.text_actions import Shared, TextFitter, check_template, unshare

if TYPE_CHECKING:
    from crl_gym.clients import ExperienceClient

logger = logging.getLogger(__name__)

DEFAULT_PATTERN = r"search_and_ask\[(?P<query>.*?)\]"
"""Regex with a ``query`` group (or one group) that finds the first call anywhere in the action
text. Given as this string (the default), brackets inside the query nest (:func:`first_query`)."""
_GREEDY_PATTERN = r"search_and_ask\[(?P<query>.*)\]"
"""The default of earlier versions (documented, so copied into callers' code): read as
the default."""
MARKER = "search_and_ask["
MIN_CUT_CALL = len("search_and")
"""A cut-off call is an action that is a prefix of the marker at least this long (``search_and``,
``search_and_ask``): shorter prefixes (``search``) may be env actions."""
MAX_QUERY_CHARS = 500
"""Longest query searched and echoed; a longer one is cut (a runaway generation must not fill
the context)."""


def first_query(action: str) -> str | None:
    """The query of the first ``search_and_ask[...]`` call in ``action``; None when there is none.

    Brackets inside the query nest; an unbalanced query ends at its first ``]``.

    >>> first_query("search_and_ask[where is [the] key?] then search_and_ask[again]")
    'where is [the] key?'
    >>> first_query("search_and_ask[a [b] search_and_ask[c]"), first_query("search_and_ask[open")
    ('a [b', None)
    """
    start = action.find(MARKER)
    if start < 0:
        return None
    begin = start + len(MARKER)
    depth = 1
    for i in range(begin, len(action)):
        c = action[i]
        if c == "[":
            depth += 1
        elif c == "]":
            depth -= 1
            if depth == 0:
                return action[begin:i]
    close = action.find("]", begin)
    return None if close < 0 else action[begin:close]


def is_malformed_call(action: str) -> bool:
    """Whether ``action`` is a ``search_and_ask`` call that cannot be read: cut off before its
    bracket opens (a prefix of ``search_and_ask[`` of at least :data:`MIN_CUT_CALL` characters) or
    before it closes (``search_and_ask[`` without a ``]`` after it). Such an action is the model's
    tool call cut by its token budget, never an env action.

    >>> (is_malformed_call("search_and"), is_malformed_call("search_and_ask[where is the"),
    ...  is_malformed_call("search"))
    (True, True, False)
    >>> is_malformed_call("search_and_ask[key]"), is_malformed_call("go east")
    (False, False)
    """
    text = action.strip()
    if len(text) >= MIN_CUT_CALL and MARKER.startswith(text):
        return True
    start = text.find(MARKER)
    return start >= 0 and first_query(text[start:]) is None


# The observation texts live in crl_gym.templates; these names are this module's public API.
ANSWER_TEMPLATE = SEARCH_AND_ASK_ANSWER_TEMPLATE
NO_ENTRY_TEMPLATE = SEARCH_AND_ASK_NO_ENTRY_TEMPLATE
OVER_CAP_TEMPLATE = SEARCH_AND_ASK_OVER_CAP_TEMPLATE
EMPTY_QUERY_TEMPLATE = SEARCH_AND_ASK_EMPTY_QUERY_TEMPLATE
ERROR_TEMPLATE = SEARCH_AND_ASK_ERROR_TEMPLATE
MALFORMED_TEMPLATE = SEARCH_AND_ASK_MALFORMED_TEMPLATE

_FIELDS = ("query", "answer", "observation", "max_calls")


class SearchAndAskWrapper(gym.Wrapper, gym.utils.RecordConstructorArgs):
    """Give the agent a ``search_and_ask`` tool (see the module docstring).

    Args:
        env: a Gymnasium env with text actions.
        client: an :class:`~crl_gym.clients.ExperienceClient`.
        max_calls: answered calls allowed per episode (default 2, as in the paper's setup).
        pattern: regex (str or compiled) with a group named ``query`` or exactly one group.
        answer_template, no_entry_template, over_cap_template, empty_query_template,
        error_template: observations for each outcome; fields ``{query}``, ``{answer}``,
            ``{observation}`` (the current, unchanged observation), ``{max_calls}``.
    """

    def __init__(
        self,
        env: gym.Env,
        client: ExperienceClient | Shared[ExperienceClient],
        max_calls: int = 2,
        pattern: str | re.Pattern[str] = DEFAULT_PATTERN,
        answer_template: str = ANSWER_TEMPLATE,
        no_entry_template: str = NO_ENTRY_TEMPLATE,
        over_cap_template: str = OVER_CAP_TEMPLATE,
        empty_query_template: str = EMPTY_QUERY_TEMPLATE,
        error_template: str = ERROR_TEMPLATE,
        max_query_chars: int = MAX_QUERY_CHARS,
        malformed_template: str = MALFORMED_TEMPLATE,
    ) -> None:
        gym.utils.RecordConstructorArgs.__init__(
            self,
            client=Shared(unshare(client)),
            max_calls=max_calls,
            pattern=pattern,
            answer_template=answer_template,
            no_entry_template=no_entry_template,
            over_cap_template=over_cap_template,
            empty_query_template=empty_query_template,
            error_template=error_template,
            max_query_chars=max_query_chars,
            malformed_template=malformed_template,
        )
        require_gym_env(env, "SearchAndAskWrapper")
        require_text_spaces(env, "SearchAndAskWrapper")
        gym.Wrapper.__init__(self, env)
        if max_calls < 0:
            raise ValueError(f"max_calls must be >= 0, got {max_calls}")
        if max_query_chars < 1:
            raise ValueError(f"max_query_chars must be >= 1, got {max_query_chars}")
        self.max_query_chars = int(max_query_chars)
        self.client = unshare(client)
        self.max_calls = max_calls
        regex = re.compile(pattern, re.DOTALL) if isinstance(pattern, str) else pattern
        if "query" not in regex.groupindex and regex.groups != 1:
            raise ValueError(
                f"pattern {regex.pattern!r} needs a group named 'query' or exactly one group"
            )
        self.pattern = regex
        self._group: int | str = "query" if "query" in regex.groupindex else 1
        # The default pattern cannot match without this text: a substring test (C speed) skips
        # the parse on ordinary actions, which are nearly all of them.
        default = (
            regex.pattern in (DEFAULT_PATTERN, _GREEDY_PATTERN) and not regex.flags & re.IGNORECASE
        )
        self._marker = MARKER if default else ""
        self._fit = TextFitter(self.observation_space)
        space = self.observation_space
        self._max_length = int(space.max_length) if isinstance(space, spaces.Text) else None
        self.templates = {
            name: check_template(t, name, _FIELDS)
            for name, t in (
                ("answer_template", answer_template),
                ("no_entry_template", no_entry_template),
                ("over_cap_template", over_cap_template),
                ("empty_query_template", empty_query_template),
                ("error_template", error_template),
                ("malformed_template", malformed_template),
            )
        }
        self.calls_used = 0
        self.error_count = 0
        self.malformed_count = 0
        """Cut-off or malformed calls answered as a tool error (never sent to the env); the first
        is logged."""
        self._call_error: str | None = None
        self._turn = 0
        # The last (obs, reward, terminated, truncated, info) the env gave: a search_and_ask turn
        # shows its observation again and keeps its info keys. One reference per step.
        self._last: tuple[Any, ...] = ("", 0.0, False, False, {})
        self._warn_if_recorder_inside(env)

    @staticmethod
    def _warn_if_recorder_inside(env: gym.Env) -> None:
        from crl_gym.wrappers.experience import ExperienceWrapper

        inner: gym.Env = env
        while isinstance(inner, gym.Wrapper):
            if isinstance(inner, ExperienceWrapper):
                logger.warning(
                    "SearchAndAskWrapper wraps an ExperienceWrapper: its calls will not be "
                    "recorded in the trajectory; wrap as "
                    "ExperienceWrapper(SearchAndAskWrapper(env)) instead"
                )
                return
            inner = inner.env

    def reset(
        self, *, seed: int | None = None, options: EnvOptions | None = None
    ) -> tuple[Any, EnvInfo]:
        obs, info = self.env.reset(seed=seed, options=options)
        self.calls_used = 0
        self._turn = 0
        self._last = (obs, 0.0, False, False, info)
        return obs, info

    def step(self, action: object) -> tuple[Any, SupportsFloat, bool, bool, EnvInfo]:
        if isinstance(action, str) and self._marker in action:
            if self._marker:
                query = first_query(action)
            else:
                match = self.pattern.search(action)
                query = None if match is None else str(match.group(self._group))
            if query is not None:
                return self._search_and_ask(query.strip()[: self.max_query_chars].rstrip())
        if self._marker and isinstance(action, str) and is_malformed_call(action):
            return self._malformed(action)
        # The env's own tuple goes back untouched: the common turn costs one lookup and two stores.
        out = self._last = self.env.step(action)
        self._turn += 1
        return out

    def _malformed(self, action: str) -> tuple[Any, float, bool, bool, EnvInfo]:
        """A cut-off call: a tool error (the env is not stepped, no call is used), counted,
        logged once."""
        self.malformed_count += 1
        if self.malformed_count == 1:
            logger.warning(
                "search_and_ask: a cut-off or malformed call %r was answered as a tool error, not "
                "sent to the env (counted in malformed_count; raise max_new_tokens if calls "
                "are cut)",
                action[:80],
            )
        turn_query = action.strip()[: self.max_query_chars]
        self._turn += 1
        obs = self._render(self.templates["malformed_template"], turn_query, "")
        info = {
            **self._last[4],
            "search_and_ask": {
                "status": "malformed",
                "query": turn_query,
                "call": None,
                "calls_left": self.max_calls - self.calls_used,
            },
        }
        return obs, 0.0, False, False, info

    @property
    def _last_obs(self) -> object:
        return self._last[0]

    def _search_and_ask(self, query: str) -> tuple[Any, float, bool, bool, EnvInfo]:
        turn = self._turn
        self._turn += 1
        self._call_error = None
        call: SearchCall | None = None
        answer = ""
        if not query:
            status = "empty_query"
        elif self.calls_used >= self.max_calls:
            status = "over_cap"
        else:
            self.calls_used += 1
            status, call = self._retrieve_and_ask(query, turn)
            answer = call.answer if call is not None else ""
        template = self.templates[
            {
                "answered": "answer_template",
                "no_entry": "no_entry_template",
                "over_cap": "over_cap_template",
                "empty_query": "empty_query_template",
                "error": "error_template",
            }[status]
        ]
        obs = self._render(template, query, answer)
        # The env was not stepped: its state, and so its info keys, are those of the last turn.
        info = {
            **self._last[4],
            "search_and_ask": {
                "status": status,
                "query": query,
                "call": call,
                "calls_left": self.max_calls - self.calls_used,
            },
        }
        if self._call_error is not None:
            info["experience_error"] = self._call_error
        return obs, 0.0, False, False, info

    def _render(self, template: str, query: str, answer: str) -> str:
        """The observation of a call, fitted to a ``Text`` space by shortening the echoed query,
        then the answer; the current observation is kept whole."""
        obs, calls = self._last_obs, self.max_calls
        # the wrapper's own text is fitted to the charset; the env's observation never is
        query, answer = self._fit(query), self._fit(answer)
        text = template.format(query=query, answer=answer, observation=obs, max_calls=calls)
        limit = self._max_length
        if limit is None or len(text) <= limit:
            return text
        room = limit - len(template.format(query="", answer="", observation=obs, max_calls=calls))
        if room < 0:  # not even the template's own words fit beside the observation
            return str(obs)
        n_query, n_answer = template.count("{query}"), template.count("{answer}")
        if n_query:
            query = query[: max(0, room - n_answer * len(answer)) // n_query]
        if n_answer:
            answer = answer[: max(0, room - n_query * len(query)) // n_answer]
        return template.format(query=query, answer=answer, observation=obs, max_calls=calls)

    def _retrieve_and_ask(self, query: str, turn: int) -> tuple[str, SearchCall | None]:
        status, call, failure = retrieve_and_ask(self.client, query, str(self._last_obs), turn)
        if failure is not None:
            self._error(*failure)
        return status, call

    def _error(self, what: str, exc: BaseException) -> None:
        self.error_count += 1
        self._call_error = f"search_and_ask {what} failed: {type(exc).__name__}: {exc}"
        logger.warning("%s (episode continues)", self._call_error)


def retrieve_and_ask(
    client: ExperienceClient, query: str, situation: str, turn: int
) -> tuple[str, SearchCall | None, tuple[str, BaseException] | None]:
    """One ``search_and_ask`` call: the best entry for ``query``, refined by ``client.ask`` for the
    agent's ``situation`` (the raw entry when the ask fails or no extractor is attached).

    Returns ``(status, call, failure)``: status ``"answered"`` (with the call), ``"no_entry"`` or
    ``"error"`` (the search failed); ``failure`` is ``(what, exception)`` for a failed search or
    ask, for the caller to count and log. The wrapper and the verl tool
    (``crl_gym.integrations.verl.tool``) both answer through this function.
    """
    try:
        entry = client.search(query)
    except Exception as exc:  # noqa: BLE001 - a down client costs the answer, not the episode
        reraise_misuse(exc)
        return "error", None, ("search", exc)
    if entry is None:
        return "no_entry", None, None
    failure: tuple[str, BaseException] | None = None
    try:
        answer, provenance = client.ask(query, entry, situation)
    except Exception as exc:  # noqa: BLE001 - the raw entry is still a useful answer
        reraise_misuse(exc)
        failure = ("ask", exc)
        answer, provenance = entry.text, None
    refined = provenance is not None or answer != entry.text
    call = SearchCall(
        query=query, answer=answer, entry=entry, turn=turn, refined=refined, provenance=provenance
    )
    return "answered", call, failure
