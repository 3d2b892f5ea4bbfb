"""Every prompt and observation template of the project, in one place.

One module so that a wording change is one edit, the tokenizer of the tiny preset can be trained
on exactly what the models read, and a reviewer sees every text a model is shown side by side.
The modules that fill them (:mod:`crl_gym.wrappers.experience`,
:mod:`crl_gym.wrappers.search_and_ask`, :mod:`crl_gym.experience.prompts`, the trainer) import
them from here and keep their old names as re-exports.

Placeholders are ``{name}``. The observation templates of the wrappers are filled with
``str.format`` (checked up front by ``check_template``: a literal brace is written ``{{ }}``);
the extractor's prompts are filled with :func:`crl_gym.experience.prompts.fill`, which leaves
braces in the template alone, so those may hold literal JSON. Neither re-reads the substituted
values, so braces in a task, an observation or an entry are always safe.

>>> gate = GATE_TEMPLATE.format(task="Open the door.", success_rate="0.25",
...                             experience="Keys open doors.")
>>> gate.splitlines()[-1]
'Before you start: will this experience help you? Answer accept, refine or reject.'
"""

from __future__ import annotations

# --------------------------------------------------------------------------------------------
# What the actor sees: guided first observation (ExperienceWrapper)
# --------------------------------------------------------------------------------------------

GUIDED_OBSERVATION_TEMPLATE = (
    "Experience from similar tasks (use it if it helps):\n{experience}\n\n{observation}"
)
"""``ExperienceWrapper``'s default guided first observation (``DEFAULT_TEMPLATE``);
``{experience}``, ``{observation}``."""

TURN_OBSERVATION_TEMPLATE = (
    "Experience for this step (use it if it helps):\n{experience}\n\n{observation}"
)
"""A guided turn's observation behind its entry (``ExperienceWrapper(retrieve="turn")``);
``{experience}``, ``{observation}``."""

# --------------------------------------------------------------------------------------------
# What the actor sees: the search_and_ask tool (SearchAndAskWrapper, str.format)
# --------------------------------------------------------------------------------------------

SEARCH_AND_ASK_ANSWER_TEMPLATE = "Answer to search_and_ask[{query}]:\n{answer}\n\n{observation}"
"""Observation after an answered ``search_and_ask`` call; ``{query}``, ``{answer}``,
``{observation}``."""

SEARCH_AND_ASK_NO_ENTRY_TEMPLATE = (
    "search_and_ask[{query}]: no relevant experience found.\n\n{observation}"
)
"""Observation after a ``search_and_ask`` call that found no entry; ``{query}``,
``{observation}``."""

SEARCH_AND_ASK_OVER_CAP_TEMPLATE = (
    "search_and_ask refused: you have used all {max_calls} calls of this episode; "
    "take an environment action.\n\n{observation}"
)
"""Observation after a ``search_and_ask`` call over the per-episode cap; ``{max_calls}``,
``{observation}``."""

SEARCH_AND_ASK_EMPTY_QUERY_TEMPLATE = (
    "search_and_ask needs a query: write search_and_ask[<where you are stuck>].\n\n{observation}"
)
"""Observation after a ``search_and_ask[]`` call without a query; ``{observation}``."""

SEARCH_AND_ASK_ERROR_TEMPLATE = (
    "search_and_ask is unavailable right now; take an environment action.\n\n{observation}"
)
"""Observation after a ``search_and_ask`` call whose search failed (client down);
``{observation}``."""

SEARCH_AND_ASK_MALFORMED_TEMPLATE = (
    "Your search_and_ask call was cut off or malformed ({query}); nothing was done. Write "
    "search_and_ask[<where you are stuck>] with its closing bracket, or an environment "
    "action.\n\n{observation}"
)
"""Observation after a cut-off call (``search_and_ask[open``), never sent to the env:
``{query}``, ``{observation}``."""

# --------------------------------------------------------------------------------------------
# What the actor sees: the trainer's system prompts, tool action and gate (crl_train)
# --------------------------------------------------------------------------------------------

SYSTEM_CONSTRAINED = "You are an agent in a text environment. Answer with one action."
"""System prompt of a constrained actor (it picks one admissible action, token by token)."""

SYSTEM_REACT = (
    "You are an agent in a text environment. Think briefly, then give exactly one action inside "
    "<action>...</action>. You may also write search_and_ask[<your question>] inside the tags to "
    "ask the experience bank for advice."
)
"""System prompt of a free-text (ReAct-style) actor, which may call ``search_and_ask``."""

SYSTEM_TOOLS = (
    "You play a text game. Each turn, call the take_action tool with exactly one of the admissible "
    "actions. Use any experience you are shown."
)
"""System prompt of an actor that answers by calling tools (TRL's environments: ``take_action``)."""

SEARCH_ACTION = "search_and_ask[what should I do next?]"
"""The tool call offered to a constrained (tiny) actor when search_and_ask is on."""

GATE_TEMPLATE = (
    "Task: {task}\nYour success rate on this task so far: {success_rate}\nExperience: "
    "{experience}\nBefore you start: will this experience help you? Answer accept, refine "
    "or reject."
)
"""Actor-critic gate: the actor judges an entry before its episode (``{task}``,
``{success_rate}``, ``{experience}``)."""
GATE_REFINE_TEMPLATE = (
    "Task: {task}\nExperience: {experience}\n"
    "Rewrite this experience so that it fits the task better, in one or two sentences."
)
"""The actor's rewrite of an entry it chose to refine; the episode is guided by the rewrite."""

# --------------------------------------------------------------------------------------------
# Actor-facing texts of crl_gym.experience.prompts (filled with fill())
# --------------------------------------------------------------------------------------------

EXPERIENCE_TEMPLATE = (
    "Experience distilled from earlier episodes (advice that may not fit this exact "
    "situation; use your judgement):\n{experience}\n\n{observation}"
)
"""``render_experience``'s guided first observation (the wrapper's default is
``GUIDED_OBSERVATION_TEMPLATE``)."""

SEARCH_AND_ASK_TOOL = (
    "Besides the normal actions you may call the tool search_and_ask[your question] at any "
    "turn. Describe where you are and what is blocking you; the reply is advice drawn from "
    "experience of earlier episodes, and calling the tool does not advance the environment."
)
"""Description of the ``search_and_ask`` tool for an actor's instructions."""

SEARCH_ANSWER_TEMPLATE = 'Advice for "{query}":\n{answer}'
"""``render_search_answer`` for a found answer; ``{query}``, ``{answer}``."""

SEARCH_NO_RESULT = 'No stored experience matches "{query}". Continue with your own plan.'
"""``render_search_answer`` when nothing was found; ``{query}``."""

# --------------------------------------------------------------------------------------------
# The extractor: distillation (crl_gym.experience.prompts.build_distillation_prompt)
# --------------------------------------------------------------------------------------------

ENTRY_CONTRACT = """An entry has at most {max_entry_chars} characters, no double quotes or \
backslashes, and is either
- a fact about one task, for when it comes again: the task's name and what won or lost it, \
such as the winning actions in order; or
- a lesson for other tasks too: when X, do Y."""
"""What an entry may record, the same for every method and extractor: a fact about a task that
will recur, or a transferable lesson (docs/experience.md, "The entry contract");
``{max_entry_chars}``."""

DISTILLATION_TEMPLATE = (
    """You write the experience bank of an agent: before a task it reads the entry that best \
matches it, and you are rewarded when it then succeeds.
"""
    + ENTRY_CONTRACT
    + """
Answer with a JSON list of 1 to {max_ops} operations and nothing else, shaped like \
[{"op":"add","text":"Task name: the fact or the lesson."}], \
or [{"op":"return","reason":"nothing new"}] to add nothing.

## Task
{task}

## Outcome
{outcome}

## Entry the actor was given
{experience}

## Trajectory
{trajectory}"""
)
"""The extractor's prompt for one finished episode R = (τ, g, o, m): fixed instructions and
contract first, the episode's parts last (a batch shares the instructions as its prefix); answer:
``schemas.ops_schema``, read by ``parse_structured_ops`` / ``parse_ops``."""

ANSWER_SHAPE = '[{"op":"add","text":"Task name: the fact or the lesson."}]'
"""The answer's shape as ``DISTILLATION_TEMPLATE`` shows it (the action slot's prompt
replaces it)."""

ACTION_SLOT_SHAPE = (
    '[{"op":"add","actions":["the action to play"],"text":"Task name: the fact or the lesson."}]'
)
"""The answer's shape under the action slot (``experience.action_slot``): the chosen actions come
before the text."""

ACTION_SLOT_RULE = (
    "actions: up to {action_slot} actions to play in order, from the episode's admissible actions."
)
"""The one sentence the action slot adds after the answer's shape line; ``{action_slot}``."""

DISTILLATION_SLOT_TEMPLATE = DISTILLATION_TEMPLATE.replace(
    ANSWER_SHAPE, ACTION_SLOT_SHAPE, 1
).replace("to add nothing.\n", "to add nothing.\n" + ACTION_SLOT_RULE + "\n", 1)
"""``DISTILLATION_TEMPLATE`` with the action slot (docs/experience.md, "The action slot"): its
shape line names ``actions`` and ``ACTION_SLOT_RULE`` follows; instructions still first;
distillation only."""

UPDATE_RULE_GUIDED_SLOT = (
    "If it was wrong, misleading or incomplete, rewrite it with "
    '{"op":"update","id":{id},"actions":[...],"text":"..."} '
    "(the whole new text); an update can only be the first operation."
)
"""``UPDATE_RULE_GUIDED`` under the action slot: an update chooses its actions too."""

UPDATE_RULE_GUIDED = (
    "If it was wrong, misleading or incomplete, rewrite it with "
    '{"op":"update","id":{id},"text":"..."} '
    "(the whole new text); an update can only be the first operation."
)
"""Follows a guided episode's entry in ``{experience}``: the given entry ``{id}`` may
be rewritten."""

UPDATE_RULE_FREE = "There is nothing to update."
"""Follows ``NO_EXPERIENCE`` in a free episode's ``{experience}``: there is no entry to update."""

NO_EXPERIENCE = "None: this episode ran without retrieved experience."
"""``{experience}`` of a free episode."""

GIVEN_ENTRY_TEMPLATE = "Entry id {id} (version {version}):\n{text}\n{update_rule}"
"""``{experience}`` of a guided episode: the entry it was given and how to rewrite it; ``{id}``,
``{version}``, ``{text}``, ``{update_rule}``."""

OUTCOME_TEMPLATE = "{verdict}: episode return {outcome} after {turns} actions."
"""``{outcome}`` of the distillation prompt; ``{verdict}`` (SUCCESS / FAILURE), ``{outcome}``
(signed), ``{turns}``."""

STEP_TEMPLATE = "[{i}] observation: {observation}\n    action: {action}{reward}"
"""One env turn of a rendered trajectory; ``{reward}`` is `` (reward +1)`` or empty."""

SEARCH_STEP_TEMPLATE = "[{i}] asked for advice: {action}\n    advice received: {observation}"
"""One ``search_and_ask`` turn of a rendered trajectory."""

EMPTY_TRAJECTORY = "(the episode ended before the actor acted)"
"""A rendered trajectory without turns."""

OMITTED_TURNS_TEMPLATE = "… ({omitted} turns omitted) …"
"""Stands for the middle turns cut from a trajectory too long for the prompt; ``{omitted}``."""

# --------------------------------------------------------------------------------------------
# The extractor: refinement for search_and_ask (build_refinement_prompt)
# --------------------------------------------------------------------------------------------

REFINEMENT_TEMPLATE = """You are the experience extractor of a reinforcement-learning agent.
In the middle of an episode the agent asked for advice. Rewrite the stored experience so that it
answers the agent's question for its current situation.

## The agent's question
{query}

## Stored experience found for it
{entry}

## Recent turns of the episode
{context}

Answer with one JSON object, {"advice":"..."}, and nothing after it. The advice is one to four
plain sentences (no double quotes, no backslashes), concrete for this situation: say what to do
next and why. If the stored experience does not apply, say so and give the best general advice
you can."""
"""The extractor's prompt to rewrite entry m for the actor's own query q′; answer:
``schemas.refinement_schema``, read by ``extract_refined_advice``."""

# --------------------------------------------------------------------------------------------
# The extractor: Merge (build_merge_prompt)
# --------------------------------------------------------------------------------------------

MERGE_TEMPLATE = """You are the experience extractor of a reinforcement-learning agent and you
curate its experience bank. Several episodes of the same task run in parallel, so the bank
collects entries that repeat or contradict each other, which makes retrieval worse. Below is one
chunk of the bank. Each entry has a label in square brackets.

## Entries
{entries}

## What to do
Decide which entries say the same thing, which contradict each other (keep the better-supported
advice), and which are vague, wrong or useless. Then answer with one JSON object, and nothing
after it, that gives every entry one decision, in the order the entries are listed above, and
ends with the merged text:
```json
{"E1":"keep","E2":"merge","E3":"merge","E4":"discard",\
"merged":"one entry that says what E2 and E3 said, without losing any distinct advice"}
```
- "keep": the entry stays unchanged.
- "merge": the entry is replaced, together with every other entry marked merge, by the one text
  under "merged" (a single entry marked merge is rewritten to it). Merged text follows the entry
  style: one to three actionable plain sentences, no double quotes, no backslashes.
- "discard": the entry is wrong, useless, or fully covered by another entry.
Use every label shown above exactly once. Always write "merged" (it is ignored when no entry is
marked merge)."""
"""The extractor's prompt for one Merge window of the bank; answer: ``schemas.merge_schema``,
read by ``parse_merge_decision``."""

SWEBENCH_TASK_TEMPLATE = """You are working in a Linux sandbox on the repository at {workdir} \
(no network access).
Resolve the following issue by editing the source code (not the tests) so that it is fixed.

<issue>
{problem_statement}
</issue>

{tool_help}
When you are done, call submit."""
"""The SWE-Bench env's first observation (fields ``{workdir}``, ``{problem_statement}``,
``{tool_help}``)."""
WEBSHOP_SEARCH_ACTION = "search[<query>]"
"""How WebShop lists its free-text search action among the admissible ones."""

REFLECTION_TEMPLATE = (
    """You are the experience extractor of a reinforcement-learning agent.
The actor keeps failing one kind of task ({category}): it succeeded in {successes} of {episodes}
episodes of it in the last training step. Compare what went wrong with what worked, and write up to
{max_entries} new entries for the shared experience bank that would make the actor succeed on \
this kind of task.
"""
    + ENTRY_CONTRACT
    + """

## Failed episodes
{failures}

## Successful episodes
{successes_text}

Answer with a JSON list of operations, and nothing after it:
- {"op":"add","text":"..."} adds a new entry.
- {"op":"return","reason":"..."} adds nothing; use it when the episodes teach nothing new."""
)
"""EDGE's reflection on a task category with a low success rate (read by ``parse_ops``)."""
NO_SUCCESSFUL_EPISODE = "(none in this step)"
"""What the reflection prompt shows when no episode of the category succeeded."""

__all__ = [
    "ACTION_SLOT_RULE",
    "ACTION_SLOT_SHAPE",
    "ANSWER_SHAPE",
    "DISTILLATION_SLOT_TEMPLATE",
    "UPDATE_RULE_GUIDED_SLOT",
    "DISTILLATION_TEMPLATE",
    "EMPTY_TRAJECTORY",
    "ENTRY_CONTRACT",
    "EXPERIENCE_TEMPLATE",
    "GATE_REFINE_TEMPLATE",
    "GATE_TEMPLATE",
    "GIVEN_ENTRY_TEMPLATE",
    "GUIDED_OBSERVATION_TEMPLATE",
    "MERGE_TEMPLATE",
    "TURN_OBSERVATION_TEMPLATE",
    "NO_EXPERIENCE",
    "OMITTED_TURNS_TEMPLATE",
    "OUTCOME_TEMPLATE",
    "REFINEMENT_TEMPLATE",
    "REFLECTION_TEMPLATE",
    "NO_SUCCESSFUL_EPISODE",
    "SEARCH_ACTION",
    "SEARCH_AND_ASK_ANSWER_TEMPLATE",
    "SEARCH_AND_ASK_EMPTY_QUERY_TEMPLATE",
    "SEARCH_AND_ASK_ERROR_TEMPLATE",
    "SEARCH_AND_ASK_MALFORMED_TEMPLATE",
    "SEARCH_AND_ASK_NO_ENTRY_TEMPLATE",
    "SEARCH_AND_ASK_OVER_CAP_TEMPLATE",
    "SEARCH_AND_ASK_TOOL",
    "SEARCH_ANSWER_TEMPLATE",
    "SEARCH_NO_RESULT",
    "SEARCH_STEP_TEMPLATE",
    "STEP_TEMPLATE",
    "SYSTEM_CONSTRAINED",
    "SWEBENCH_TASK_TEMPLATE",
    "SYSTEM_REACT",
    "SYSTEM_TOOLS",
    "UPDATE_RULE_FREE",
    "UPDATE_RULE_GUIDED",
    "WEBSHOP_SEARCH_ACTION",
]
