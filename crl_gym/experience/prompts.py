"""The prompts of the experience layer, built for the Complementary RL setting.

* the **distillation** prompt: the extractor reads one finished episode R = (τ, g, o, m) and
  answers with Add / Update / Return ops in the format :func:`crl_gym.experience.ops.parse_ops`
  reads;
* the **refinement** prompt of ``search_and_ask``: the actor's own query q′, the entry m found
  for it and the recent context → advice for this exact situation;
* the **merge** prompt: one chunk of the bank (plus what the previous chunk produced) → keep /
  merge / discard decisions as JSON (read by :mod:`crl_gym.experience.merge`);
* the **experience template** the actor sees, and the text of the ``search_and_ask`` tool.

The template texts themselves live in :mod:`crl_gym.templates` (re-exported here under the same
names); this module builds prompts from them. Templates are filled by :func:`fill`, which replaces
``{name}`` placeholders in one pass and never interprets braces inside the values (the authors'
fallback prompt used ``str.format`` on text with literal braces and raised ``KeyError``). Literal
JSON in a template is therefore fine.

>>> fill("Task: {task} / {missing}", task="print {x}")
'Task: print {x} / {missing}'
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

from crl_gym.experience.ops import DEFAULT_MAX_LEN, MAX_INPUT_CHARS, clean_text, strip_think
from crl_gym.experience.schemas import MAX_ACTION_SLOT, MAX_OPS, MAX_SLOT_ACTIONS, slot_action
from crl_gym.protocol import DistillationRequest, ExperienceRef, Step, Trajectory
from crl_gym.templates import (
    DISTILLATION_SLOT_TEMPLATE,
    DISTILLATION_TEMPLATE,
    EMPTY_TRAJECTORY,
    EXPERIENCE_TEMPLATE,
    GIVEN_ENTRY_TEMPLATE,
    MERGE_TEMPLATE,
    NO_EXPERIENCE,
    NO_SUCCESSFUL_EPISODE,
    OMITTED_TURNS_TEMPLATE,
    OUTCOME_TEMPLATE,
    REFINEMENT_TEMPLATE,
    REFLECTION_TEMPLATE,
    SEARCH_AND_ASK_TOOL,
    SEARCH_ANSWER_TEMPLATE,
    SEARCH_NO_RESULT,
    SEARCH_STEP_TEMPLATE,
    STEP_TEMPLATE,
    UPDATE_RULE_FREE,
    UPDATE_RULE_GUIDED,
    UPDATE_RULE_GUIDED_SLOT,
)

# Old private names, kept for importers.
_UPDATE_RULE_GUIDED = UPDATE_RULE_GUIDED
_UPDATE_RULE_FREE = UPDATE_RULE_FREE

_PLACEHOLDER = re.compile(r"\{([a-z_][a-z0-9_]*)\}")
_FENCE_EDGE = re.compile(r"^```[^\n]*\n|```\s*$")
"""A code fence's opening line or closing marks (linear: each ``` starts one bounded scan)."""
_ADVICE_PREFIX = re.compile(r"^(?:refined\s+)?advice\s*:\s*", re.IGNORECASE)


def fill(template: str, **values: object) -> str:
    """Replace ``{name}`` by ``str(values[name])`` in a single pass.

    Unknown placeholders are left as they are and substituted values are never re-scanned, so
    braces in a task, an observation or an entry cannot break a prompt.
    """

    def sub(m: re.Match[str]) -> str:
        key = m.group(1)
        return str(values[key]) if key in values else m.group(0)

    return _PLACEHOLDER.sub(sub, template)


def truncate_middle(text: str, max_chars: int, marker: str = " … ") -> str:
    """Keep the head and the tail of ``text`` within ``max_chars`` characters.

    >>> truncate_middle("abcdefghij", 7)
    'ab … ij'
    """
    if max_chars <= 0:
        return ""
    if len(text) <= max_chars:
        return text
    if max_chars <= len(marker):
        return text[:max_chars]
    keep = max_chars - len(marker)
    head = (keep + 1) // 2
    return text[:head] + marker + text[len(text) - (keep - head) :]


# --------------------------------------------------------------------------------------------
# What the actor sees
# --------------------------------------------------------------------------------------------


def render_experience(
    experience: str, observation: str, template: str = EXPERIENCE_TEMPLATE
) -> str:
    """First observation of a guided episode: the entry, then the env's observation.

    >>> render_experience("Keys open doors {always}.", "You see a door.").splitlines()[1]
    'Keys open doors {always}.'
    """
    return fill(template, experience=experience.strip(), observation=observation)


def render_search_answer(query: str, answer: str | None) -> str:
    """Observation returned for a ``search_and_ask`` call (``None``: nothing found)."""
    if answer is None or not answer.strip():
        return fill(SEARCH_NO_RESULT, query=query.strip())
    return fill(SEARCH_ANSWER_TEMPLATE, query=query.strip(), answer=answer.strip())


# --------------------------------------------------------------------------------------------
# Distillation
# --------------------------------------------------------------------------------------------


def _render_step(i: int, step: Step, max_obs_chars: int, max_action_chars: int) -> str:
    obs = truncate_middle(step.observation.strip(), max_obs_chars)
    act = truncate_middle(step.action.strip(), max_action_chars)
    if step.kind == "search_and_ask":
        return fill(SEARCH_STEP_TEMPLATE, i=i, action=act, observation=obs)
    reward = f" (reward {step.reward:+g})" if step.reward else ""
    return fill(STEP_TEMPLATE, i=i, observation=obs, action=act, reward=reward)


def render_trajectory(
    trajectory: Trajectory,
    max_chars: int = 8000,
    *,
    max_obs_chars: int = 600,
    max_action_chars: int = 300,
) -> str:
    """Compact text of an episode within ``max_chars``.

    Each observation keeps its head and tail; when the episode is still too long the first two
    turns and as many final turns as fit are kept (the end is where the outcome was decided)
    and the middle is replaced by a count of omitted turns.

    >>> t = Trajectory(steps=[Step("room", "north", 0.0), Step("stairs", "down", 1.0)])
    >>> print(render_trajectory(t))
    [1] observation: room
        action: north
    [2] observation: stairs
        action: down (reward +1)
    """
    lines = [
        _render_step(i + 1, s, max_obs_chars, max_action_chars)
        for i, s in enumerate(trajectory.steps)
    ]
    if not lines:
        return EMPTY_TRAJECTORY
    text = "\n".join(lines)
    if len(text) <= max_chars:
        return text
    head = lines[:2]
    budget = max_chars - sum(len(x) + 1 for x in head) - 40
    tail: list[str] = []
    for line in reversed(lines[2:]):
        if budget - (len(line) + 1) < 0:
            break
        tail.insert(0, line)
        budget -= len(line) + 1
    omitted = len(lines) - len(head) - len(tail)
    parts = head + ([fill(OMITTED_TURNS_TEMPLATE, omitted=omitted)] if omitted else []) + tail
    return truncate_middle("\n".join(parts), max_chars)


def _render_outcome(request: DistillationRequest) -> str:
    verdict = "SUCCESS" if request.success else "FAILURE"
    turns = request.trajectory.num_actions
    return fill(OUTCOME_TEMPLATE, verdict=verdict, outcome=f"{request.outcome:+g}", turns=turns)


def build_distillation_prompt(
    request: DistillationRequest,
    max_chars: int = 12000,
    *,
    max_ops: int = MAX_OPS,
    max_entry_chars: int = DEFAULT_MAX_LEN,
    action_slot: int = 0,
) -> str:
    """The prompt that asks the extractor to distil ``request`` into Add / Update / Return ops.

    The entry contract comes first and is the same for every request with the same ``max_ops`` and
    ``max_entry_chars`` (the bounds of the answer's schema, ``schemas.ops_schema``); the episode's
    task, outcome, given entry and trajectory follow it, so requests batched together share all
    the instructions as their common prefix. The trajectory is shrunk to keep the whole prompt near
    ``max_chars`` characters. Parse the answer with
    ``parse_ops(text, allowed_update_ids=distillation_update_ids(request))``.

    ``action_slot`` N > 0 (``experience.action_slot``) asks for the action slot: the answer's shape
    names its ``actions`` field, up to N of the episode's admissible actions
    (:func:`distillation_slot_actions`; give 0 for a request that has none, whose schema has
    no slot).

    >>> from crl_gym.protocol import Trajectory, Step
    >>> r = DistillationRequest(task="reach > {fast}", trajectory=Trajectory(
    ...     steps=[Step("@ . >", "east", 1.0)]), outcome=1.0, success=True, experience=None)
    >>> p = build_distillation_prompt(r)
    >>> "reach > {fast}" in p and '"op":"update"' not in p
    True
    >>> head = distillation_instructions()
    >>> p.startswith(head) and p.index("reach > {fast}") >= len(head)
    True
    """
    if max_ops < 1 or max_entry_chars < 1:
        raise ValueError(
            f"build_distillation_prompt: max_ops and max_entry_chars must be >= 1, got {max_ops}, "
            f"{max_entry_chars}"
        )
    template = _distillation_template(action_slot)
    m = request.experience
    if m is None:
        experience = f"{NO_EXPERIENCE} {UPDATE_RULE_FREE}"
    else:
        rule = UPDATE_RULE_GUIDED_SLOT if action_slot else UPDATE_RULE_GUIDED
        experience = fill(
            GIVEN_ENTRY_TEMPLATE,
            id=m.id,
            version=m.version,
            text=truncate_middle(m.text, 2000),
            update_rule=fill(rule, id=m.id),
        )
    task = truncate_middle(request.task.strip(), 2000)
    parts = {
        "task": task,
        "outcome": _render_outcome(request),
        "experience": experience,
        "max_ops": max_ops,
        "max_entry_chars": max_entry_chars,
        "action_slot": action_slot,
    }
    frame = fill(template, **parts, trajectory="")
    traj = render_trajectory(request.trajectory, max(500, max_chars - len(frame)))
    return fill(template, **parts, trajectory=traj)


def _distillation_template(action_slot: int) -> str:
    if not 0 <= action_slot <= MAX_ACTION_SLOT:
        raise ValueError(
            f"distillation prompt: action_slot must be in [0, {MAX_ACTION_SLOT}], got {action_slot}"
        )
    return DISTILLATION_SLOT_TEMPLATE if action_slot else DISTILLATION_TEMPLATE


def distillation_instructions(
    *, max_ops: int = MAX_OPS, max_entry_chars: int = DEFAULT_MAX_LEN, action_slot: int = 0
) -> str:
    """The fixed part of every distillation prompt with these bounds: the entry contract and the
    answer format, everything before the first of the episode's own parts.

    >>> distillation_instructions().rstrip().endswith("## Task")
    True
    >>> "up to 2 actions" in distillation_instructions(action_slot=2)
    True
    """
    template = _distillation_template(action_slot)
    head = template[: template.index("{task}")]
    return fill(head, max_ops=max_ops, max_entry_chars=max_entry_chars, action_slot=action_slot)


def distillation_slot_actions(request: DistillationRequest) -> tuple[str, ...]:
    """The actions an action slot may choose for ``request``: the union, in first-seen order, of
    ``info["admissible_actions"]`` over the trajectory's env steps. A value that is not a list (or
    tuple) is ignored, and so is an item the grammar cannot write (``schemas.slot_action``: not a
    plain string); at most ``MAX_SLOT_ACTIONS`` are kept. Empty: the env lists no actions.

    >>> from crl_gym.protocol import Trajectory, Step
    >>> steps = [Step("a", "east", 0.0, {"admissible_actions": ["east", "west"]}),
    ...          Step("b", "west", 0.0, {"admissible_actions": ("west", "north", 7)})]
    >>> r = DistillationRequest(task="t", trajectory=Trajectory(steps=steps), outcome=0.0,
    ...                         success=False, experience=None)
    >>> distillation_slot_actions(r)
    ('east', 'west', 'north')
    """
    seen: dict[str, None] = {}
    for step in request.trajectory.steps:
        value = (
            step.info.get("admissible_actions")
            if step.kind == "env" and isinstance(step.info, dict)
            else None
        )
        if isinstance(value, list | tuple):
            seen.update((a, None) for a in value if slot_action(a))
    return tuple(seen)[:MAX_SLOT_ACTIONS]


def build_reflection_prompt(
    category: str,
    failures: Sequence[DistillationRequest],
    successes: Sequence[DistillationRequest],
    *,
    max_entries: int = 3,
    max_chars: int = 12000,
    max_episodes: int = 3,
    max_entry_chars: int = DEFAULT_MAX_LEN,
) -> str:
    """EDGE's reflection: contrast a low-success category's failed and successful episodes of one
    step (at most ``max_episodes`` of each, their trajectories shrunk to keep the prompt near
    ``max_chars``) and ask for up to ``max_entries`` new entries under the entry contract (the same
    as distillation's, ``max_entry_chars`` its schema's bound).

    >>> from crl_gym.protocol import Trajectory, Step
    >>> bad = DistillationRequest(task="pick up the key",
    ...                           trajectory=Trajectory(steps=[Step("a key", "north", 0.0)]),
    ...                           outcome=0.0, success=False, experience=None)
    >>> p = build_reflection_prompt("alfworld/pick", [bad], [])
    >>> "succeeded in 0 of 1" in p and "(none in this step)" in p
    True
    """
    fail, win = list(failures)[:max_episodes], list(successes)[:max_episodes]
    per = max(300, max_chars // max(1, 2 * max(len(fail), len(win), 1)))

    def episodes(reqs: Sequence[DistillationRequest]) -> str:
        return "\n\n".join(
            f"Task: {truncate_middle(r.task.strip(), 500)}\n{_render_outcome(r)}\n"
            f"{render_trajectory(r.trajectory, per)}"
            for r in reqs
        )

    return fill(
        REFLECTION_TEMPLATE,
        category=category,
        successes=len(successes),
        max_entry_chars=max_entry_chars,
        episodes=len(failures) + len(successes),
        max_entries=max_entries,
        failures=episodes(fail),
        successes_text=episodes(win) if win else NO_SUCCESSFUL_EPISODE,
    )


def distillation_update_ids(request: DistillationRequest) -> frozenset[int]:
    """Ids the extractor may update for ``request``: only the retrieved entry m, if any."""
    return frozenset() if request.experience is None else frozenset({request.experience.id})


# --------------------------------------------------------------------------------------------
# Refinement (search_and_ask)
# --------------------------------------------------------------------------------------------


def build_refinement_prompt(
    query: str, entry: ExperienceRef | str, context: str, max_chars: int = 6000
) -> str:
    """Prompt for refining entry m for the actor's query q′ (the ``search_and_ask`` tool).

    Any text is safe here, braces included:

    >>> p = build_refinement_prompt("where is {the key}?", "Keys {k} open doors", "{}{0}{")
    >>> "where is {the key}?" in p and "Keys {k} open doors" in p
    True
    """
    text = entry.text if isinstance(entry, ExperienceRef) else str(entry)
    query = truncate_middle(str(query).strip(), 1000)
    text = truncate_middle(text.strip(), 2000)
    budget = max(200, max_chars - len(REFINEMENT_TEMPLATE) - len(query) - len(text))
    # Keep the end of the context: the latest turns describe the current situation.
    ctx = str(context).strip()
    if len(ctx) > budget:
        ctx = "…" + ctx[len(ctx) - budget + 1 :]
    return fill(REFINEMENT_TEMPLATE, query=query, entry=text, context=ctx or "(none)")


def extract_refined_advice(response: str, fallback: str, max_chars: int = 1500) -> str:
    """The advice in a refinement response; ``fallback`` (entry m) when there is none.

    The schema's form (``{"advice": "..."}``, :func:`~crl_gym.experience.schemas.refinement_schema`)
    or, from an unconstrained model, plain text. Cleaned like an entry (``clean_text``).

    >>> extract_refined_advice('{"advice":"Go east."}', "m")
    'Go east.'
    >>> extract_refined_advice("<think>..</think>\\nAdvice: go east.", "m")
    'go east.'
    >>> extract_refined_advice("<think>cut off", "Keys open doors.")
    'Keys open doors.'
    """
    if not isinstance(response, str):
        return fallback
    answer, ok = strip_think(response[-MAX_INPUT_CHARS:])
    if not ok:
        return fallback
    try:
        obj = json.loads(answer)
    except (ValueError, RecursionError):
        obj = None
    if isinstance(obj, dict) and set(obj) == {"advice"}:
        advice = obj["advice"]
        advice = clean_text(advice).strip() if isinstance(advice, str) else ""
        return truncate_middle(advice, max_chars) if advice else fallback
    answer = clean_text(_FENCE_EDGE.sub("", answer.strip())).strip()
    answer = _ADVICE_PREFIX.sub("", answer).strip()
    if not answer:
        return fallback
    return truncate_middle(answer, max_chars)


# --------------------------------------------------------------------------------------------
# Merge
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MergeItem:
    """One entry as the merge prompt shows it."""

    label: str
    """Short name in the prompt (``E3`` for a bank entry, ``M2`` for an earlier merge result)."""
    text: str
    tags: tuple[str, ...] = ()
    uses: int = 0
    """How often retrieval returned it (a hint of how established it is)."""


def render_merge_item(item: MergeItem) -> str:
    """One line block of the merge prompt."""
    meta = []
    if item.tags:
        meta.append("tags: " + ", ".join(item.tags))
    if item.uses:
        meta.append(f"retrieved {item.uses}x")
    suffix = f" ({'; '.join(meta)})" if meta else ""
    return f"[{item.label}]{suffix} {item.text.strip()}"


def build_merge_prompt(items: Sequence[MergeItem]) -> str:
    """The prompt for one merge window (carried results first, then the new chunk).

    >>> p = build_merge_prompt([MergeItem("E1", "a {b}"), MergeItem("E2", "c")])
    >>> "[E1] a {b}" in p and '"merged"' in p
    True
    """
    body = "\n".join(render_merge_item(i) for i in items) or "(none)"
    return fill(MERGE_TEMPLATE, entries=body)


__all__ = [
    "DISTILLATION_TEMPLATE",
    "EXPERIENCE_TEMPLATE",
    "MERGE_TEMPLATE",
    "REFINEMENT_TEMPLATE",
    "SEARCH_AND_ASK_TOOL",
    "SEARCH_ANSWER_TEMPLATE",
    "SEARCH_NO_RESULT",
    "MergeItem",
    "build_distillation_prompt",
    "build_merge_prompt",
    "build_refinement_prompt",
    "distillation_instructions",
    "distillation_slot_actions",
    "distillation_update_ids",
    "extract_refined_advice",
    "fill",
    "render_experience",
    "render_merge_item",
    "render_search_answer",
    "render_trajectory",
    "truncate_middle",
]
