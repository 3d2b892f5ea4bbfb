"""The agent's three tools and the ONE text format its calls are parsed from.

A turn of the model may contain free text (its reasoning) and exactly one tool call::

    I will look at the failing module first.
    <function=str_replace_editor>
    <parameter=command>view</parameter>
    <parameter=path>/testbed/calc/ops.py</parameter>
    </function>

Tools (parameters marked * are required):

* ``execute_bash``: ``command``*, ``timeout`` (seconds; capped by the env).
* ``str_replace_editor``: ``command``* (``view`` | ``create`` | ``str_replace`` | ``insert`` |
  ``undo_edit``), ``path``*, ``file_text`` (create), ``old_str`` / ``new_str`` (str_replace),
  ``insert_line`` / ``new_str`` (insert), ``view_range`` (view, e.g. ``[3, 10]``; ``-1`` = to
  the end).
* ``submit``: no parameters; ends the episode and grades ``git diff`` of the work tree.

One newline right after ``<parameter=...>`` and one right before ``</parameter>`` are dropped,
so multi-line values can sit on their own lines; everything else is kept verbatim (the
``str_replace`` unique-match rule is exact). A turn that breaks these rules is not an exception:
:func:`parse_tool_call` raises :class:`ToolCallError` whose message the env shows the agent.

>>> call = parse_tool_call(
...     "<function=execute_bash>\\n<parameter=command>ls</parameter>\\n</function>")
>>> call.name, call.params
('execute_bash', {'command': 'ls'})
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

TOOLS: dict[str, dict[str, bool]] = {
    # tool name -> {parameter: required}
    "execute_bash": {"command": True, "timeout": False},
    "str_replace_editor": {
        "command": True,
        "path": True,
        "file_text": False,
        "old_str": False,
        "new_str": False,
        "insert_line": False,
        "view_range": False,
    },
    "submit": {},
}
EDITOR_COMMANDS = ("view", "create", "str_replace", "insert", "undo_edit")

_FUNCTION_RE = re.compile(r"<function=([^>\s]*)>(.*?)</function>", re.DOTALL)
_OPEN_RE = re.compile(r"<function=")
_PARAM_RE = re.compile(r"<parameter=([^>\s]*)>(.*?)</parameter>", re.DOTALL)

TOOL_FORMAT_HELP = """\
Call exactly one tool per turn, in this format (free text before the call is allowed):
<function=TOOL_NAME>
<parameter=PARAM_NAME>value</parameter>
</function>
Tools:
- execute_bash: run a bash command in the repository. Parameters: command (required), \
timeout (seconds, optional).
- str_replace_editor: view/create/edit files. Parameters: command (required: view | create | \
str_replace | insert | undo_edit), path (required, inside /testbed), file_text (create), old_str \
and new_str (str_replace; old_str must match exactly once), insert_line and new_str (insert: new \
text goes after that line, 0 = top), view_range (view, e.g. [3, 10]; -1 means to the end).
- submit: no parameters; finish and have your changes (git diff of /testbed) graded."""


class ToolCallError(ValueError):
    """A malformed tool call; the message is what the agent sees."""


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's name and its string parameters."""

    name: str
    params: dict[str, str] = field(default_factory=dict)
    thought: str = ""
    """Free text the model wrote before the call."""


def _strip_one_newline(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def parse_tool_call(text: str) -> ToolCall:
    """Parse the single tool call in a model turn (see the module docstring for the format).

    Raises :class:`ToolCallError` with a message for the agent when the turn has no call, more
    than one, an unknown tool or parameter, a repeated parameter or a missing required one.
    """
    matches = list(_FUNCTION_RE.finditer(text))
    if not matches:
        if _OPEN_RE.search(text):
            raise ToolCallError(
                "Malformed tool call: '<function=...>' is not closed by '</function>'."
            )
        raise ToolCallError("No tool call found in your message.")
    if len(matches) > 1 or len(_OPEN_RE.findall(text)) > 1:
        raise ToolCallError(
            f"Found {len(_OPEN_RE.findall(text))} tool calls; call exactly one tool per turn."
        )
    match = matches[0]
    name = match.group(1)
    if name not in TOOLS:
        raise ToolCallError(f"Unknown tool {name!r}. Available tools: {', '.join(TOOLS)}.")
    body = match.group(2)
    params: dict[str, str] = {}
    for pm in _PARAM_RE.finditer(body):
        pname, value = pm.group(1), _strip_one_newline(pm.group(2))
        if pname not in TOOLS[name]:
            allowed = ", ".join(TOOLS[name]) or "(none)"
            raise ToolCallError(
                f"Unknown parameter {pname!r} for {name}. Allowed parameters: {allowed}."
            )
        if pname in params:
            raise ToolCallError(f"Parameter {pname!r} given twice for {name}.")
        params[pname] = value
    leftover = _PARAM_RE.sub("", body)
    if "<parameter=" in leftover:
        raise ToolCallError(
            "Malformed parameter: '<parameter=...>' is not closed by '</parameter>'."
        )
    missing = [p for p, required in TOOLS[name].items() if required and p not in params]
    if missing:
        raise ToolCallError(f"Missing required parameter(s) for {name}: {', '.join(missing)}.")
    return ToolCall(name=name, params=params, thought=text[: match.start()].strip())


def format_tool_call(name: str, **params: object) -> str:
    """The text of a call in the documented format (what a scripted agent writes).

    >>> print(format_tool_call("execute_bash", command="pwd"))
    <function=execute_bash>
    <parameter=command>pwd</parameter>
    </function>
    """
    lines = [f"<function={name}>"]
    lines += [f"<parameter={k}>{v}</parameter>" for k, v in params.items()]
    lines.append("</function>")
    return "\n".join(lines)


def parse_timeout(value: str | None, default: float, cap: float) -> float:
    """The ``timeout`` parameter of ``execute_bash`` in seconds, clipped to ``(0, cap]``."""
    if value is None or not value.strip():
        return min(default, cap)
    try:
        seconds = float(value)
    except ValueError as exc:
        raise ToolCallError(f"timeout must be a number of seconds, got {value!r}.") from exc
    if seconds <= 0:
        raise ToolCallError(f"timeout must be positive, got {value!r}.")
    return min(seconds, cap)


def truncate_output(text: str, limit: int) -> str:
    """Keep the head and tail of ``text`` within ``limit`` characters and say how much was cut.

    >>> truncate_output("a" * 10 + "b" * 10, 8)
    'aaaa\\n[... output truncated: 12 of 20 characters cut ...]\\nbbbb'
    """
    if limit < 2:
        raise ValueError(f"limit must be >= 2, got {limit}")
    if len(text) <= limit:
        return text
    head, tail = limit // 2, limit - limit // 2
    cut = len(text) - head - tail
    return (
        f"{text[:head]}\n[... output truncated: {cut} of {len(text)} characters cut "
        f"...]\n{text[len(text) - tail :]}"
    )
