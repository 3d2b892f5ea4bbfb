"""``str_replace_editor`` semantics over a small file-system interface.

The same :class:`Editor` works on a local directory (:class:`LocalFS`, used by the pure tests)
and inside a container (:class:`crl_gym.envs.swebench.sandbox.ContainerFS`). Every path is
resolved (symlinks included) and must stay inside the work tree; anything else is refused.
In a container that check is made again where the file is opened, as the agent's uid and
without following symlinks, so a path swapped after this check cannot lead a write out.

>>> import tempfile
>>> tmp = tempfile.TemporaryDirectory()
>>> ed = Editor(LocalFS(tmp.name))
>>> _ = ed.run({"command": "create", "path": "a.py", "file_text": "x = 1\\ny = 2\\n"})
>>> view = {"command": "view", "path": "a.py", "view_range": "[2, 2]"}
>>> print(ed.run(view))  # doctest: +ELLIPSIS +NORMALIZE_WHITESPACE
Here's the result of running `cat -n` on ...a.py:
     2	y = 2
>>> tmp.cleanup()
"""

from __future__ import annotations

import json
import os
import posixpath
from pathlib import Path
from typing import Protocol

from crl_gym.envs.swebench.tools import EDITOR_COMMANDS, ToolCallError

SNIPPET_LINES = 4
MAX_VIEW_CHARS = 200_000


class FileSystem(Protocol):
    """What the editor needs from a file system; paths are absolute POSIX strings."""

    root: str
    """The work tree; nothing outside it may be read or written."""

    def realpath(self, path: str) -> str: ...
    def kind(self, path: str) -> str:
        """``"file"``, ``"dir"``, ``"missing"`` or ``"other"``."""
        ...

    def read_text(self, path: str) -> str: ...
    def write_text(self, path: str, text: str) -> None: ...
    def list_dir(self, path: str, depth: int = 2) -> list[str]: ...


class LocalFS:
    """A local directory as the work tree (tests, and agents run without Docker)."""

    def __init__(self, root: str | Path) -> None:
        self.root = str(Path(root).resolve())

    def realpath(self, path: str) -> str:
        return os.path.realpath(path)

    def kind(self, path: str) -> str:
        p = Path(path)
        if p.is_file():
            return "file"
        if p.is_dir():
            return "dir"
        return "missing" if not p.exists() else "other"

    def read_text(self, path: str) -> str:
        return Path(path).read_text(encoding="utf-8", errors="replace")

    def write_text(self, path: str, text: str) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text, encoding="utf-8")

    def list_dir(self, path: str, depth: int = 2) -> list[str]:
        out: list[str] = []
        base = Path(path)
        for dirpath, dirnames, filenames in os.walk(base):
            rel_depth = len(Path(dirpath).relative_to(base).parts)
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            if rel_depth >= depth:
                dirnames[:] = []
            for name in sorted(dirnames) + sorted(f for f in filenames if not f.startswith(".")):
                out.append(str(Path(dirpath) / name))
        return sorted(out)


def _numbered(text: str, start: int) -> str:
    return "\n".join(f"{i:6}\t{line}" for i, line in enumerate(text.split("\n"), start=start))


class Editor:
    """The ``str_replace_editor`` tool: view / create / str_replace / insert / undo_edit."""

    def __init__(self, fs: FileSystem) -> None:
        self.fs = fs
        self._history: dict[str, list[str]] = {}

    # -- paths ---------------------------------------------------------------------------
    def resolve(self, path: str) -> str:
        """Absolute, normalised, symlink-resolved path; refused unless inside the work tree."""
        if not path.strip():
            raise ToolCallError("path must not be empty.")
        joined = posixpath.normpath(posixpath.join(self.fs.root, path))
        real = self.fs.realpath(joined)
        for candidate in (joined, real):
            if candidate != self.fs.root and not candidate.startswith(
                self.fs.root.rstrip("/") + "/"
            ):
                raise ToolCallError(f"Refused: {path!r} is outside the work tree {self.fs.root}.")
        return joined

    # -- dispatch ------------------------------------------------------------------------
    def run(self, params: dict[str, str]) -> str:
        """Run one editor command; errors come back as :class:`ToolCallError`."""
        command = params.get("command", "")
        if command not in EDITOR_COMMANDS:
            raise ToolCallError(
                f"Unknown editor command {command!r}. Allowed: {', '.join(EDITOR_COMMANDS)}."
            )
        path = self.resolve(params.get("path", ""))
        kind = self.fs.kind(path)
        if command == "view":
            return self._view(path, kind, params.get("view_range"))
        if command == "create":
            return self._create(path, kind, params)
        if kind == "missing":
            raise ToolCallError(f"The path {path} does not exist.")
        if kind != "file":
            raise ToolCallError(
                f"The path {path} is not a regular file; `{command}` works on files only."
            )
        if command == "str_replace":
            return self._str_replace(path, params)
        if command == "insert":
            return self._insert(path, params)
        return self._undo(path)

    # -- commands ------------------------------------------------------------------------
    def _view(self, path: str, kind: str, view_range: str | None) -> str:
        if kind == "missing":
            raise ToolCallError(f"The path {path} does not exist.")
        if kind == "dir":
            if view_range:
                raise ToolCallError("view_range is not allowed when path is a directory.")
            entries = self.fs.list_dir(path, depth=2)
            listing = "\n".join(entries)
            return (
                f"Files and directories up to 2 levels deep in {path}, hidden items "
                f"excluded:\n{listing}"
            )
        if kind != "file":
            raise ToolCallError(f"The path {path} is not a regular file or directory.")
        text = self.fs.read_text(path)
        lines = text.split("\n")
        start = 1
        if view_range:
            try:
                rng = json.loads(view_range)
                start, end = int(rng[0]), int(rng[1])
                if len(rng) != 2:
                    raise ValueError
            except (ValueError, TypeError, IndexError, json.JSONDecodeError) as exc:
                raise ToolCallError(
                    f"view_range must be two integers like [3, 10], got {view_range!r}."
                ) from exc
            n = len(lines)
            if not 1 <= start <= n:
                raise ToolCallError(
                    f"Invalid view_range {view_range}: start {start} must be within [1, {n}]."
                )
            if end == -1:
                end = n
            if end < start or end > n:
                raise ToolCallError(
                    f"Invalid view_range {view_range}: end {end} must be -1 or within "
                    f"[{start}, {n}]."
                )
            lines = lines[start - 1 : end]
        body = _numbered("\n".join(lines), start)
        if len(body) > MAX_VIEW_CHARS:
            body = (
                body[:MAX_VIEW_CHARS] + "\n[... file too long: use view_range to see the rest ...]"
            )
        return f"Here's the result of running `cat -n` on {path}:\n{body}"

    def _create(self, path: str, kind: str, params: dict[str, str]) -> str:
        if "file_text" not in params:
            raise ToolCallError("Parameter `file_text` is required for command: create.")
        if kind != "missing":
            raise ToolCallError(
                f"File already exists at: {path}. Cannot overwrite files using command `create`."
            )
        self.fs.write_text(path, params["file_text"])
        self._history.setdefault(path, []).append("")  # undo of a create empties the file
        return f"File created successfully at: {path}"

    def _str_replace(self, path: str, params: dict[str, str]) -> str:
        if "old_str" not in params or params["old_str"] == "":
            raise ToolCallError(
                "Parameter `old_str` is required (and non-empty) for command: str_replace."
            )
        old, new = params["old_str"], params.get("new_str", "")
        text = self.fs.read_text(path)
        count = text.count(old)
        if count == 0:
            raise ToolCallError(
                f"No replacement was performed, old_str `{old}` did not appear verbatim in {path}."
            )
        if count > 1:
            lines = [i + 1 for i, line in enumerate(text.split("\n")) if old.split("\n")[0] in line]
            raise ToolCallError(
                f"No replacement was performed. Multiple occurrences ({count}) of old_str `{old}` "
                f"in lines {lines}. Please ensure it is unique."
            )
        new_text = text.replace(old, new, 1)
        self._history.setdefault(path, []).append(text)
        self.fs.write_text(path, new_text)
        first = text.split(old)[0].count("\n") + 1
        return self._snippet_message(path, new_text, first, new.count("\n"))

    def _insert(self, path: str, params: dict[str, str]) -> str:
        if "new_str" not in params:
            raise ToolCallError("Parameter `new_str` is required for command: insert.")
        if "insert_line" not in params:
            raise ToolCallError("Parameter `insert_line` is required for command: insert.")
        try:
            at = int(params["insert_line"])
        except ValueError as exc:
            raise ToolCallError(
                f"insert_line must be an integer, got {params['insert_line']!r}."
            ) from exc
        text = self.fs.read_text(path)
        lines = text.split("\n")
        # A trailing newline leaves an empty last element; it is not a line the agent can see.
        n = len(lines) - 1 if text.endswith("\n") else len(lines)
        if not 0 <= at <= n:
            raise ToolCallError(f"Invalid insert_line {at}: it must be within [0, {n}].")
        new_lines = params["new_str"].split("\n")
        updated = "\n".join(lines[:at] + new_lines + lines[at:])
        self._history.setdefault(path, []).append(text)
        self.fs.write_text(path, updated)
        return self._snippet_message(path, updated, at + 1, len(new_lines) - 1)

    def _undo(self, path: str) -> str:
        history = self._history.get(path)
        if not history:
            raise ToolCallError(f"No edit history found for {path}.")
        previous = history.pop()
        self.fs.write_text(path, previous)
        return (
            f"Last edit to {path} undone successfully. "
            f"{self._snippet_message(path, previous, 1, previous.count(chr(10)))}"
        )

    def _snippet_message(self, path: str, text: str, first_line: int, extra_lines: int) -> str:
        lines = text.split("\n")
        start = max(1, first_line - SNIPPET_LINES)
        end = min(len(lines), first_line + extra_lines + SNIPPET_LINES)
        snippet = _numbered("\n".join(lines[start - 1 : end]), start)
        return (
            f"The file {path} has been edited. Here's the result of running `cat -n` on a snippet "
            f"of {path}:\n{snippet}\nReview the changes and make sure they are as expected."
        )
