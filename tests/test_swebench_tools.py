"""Tool-call parsing, output truncation and the str_replace_editor semantics (no Docker)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from crl_gym.envs.swebench.editor import Editor, LocalFS
from crl_gym.envs.swebench.tools import (
    ToolCallError,
    format_tool_call,
    parse_timeout,
    parse_tool_call,
    truncate_output,
)

# -- parsing -------------------------------------------------------------------------------


def test_parse_call_with_thought_and_multiline_value() -> None:
    text = (
        "Let me fix it.\n<function=str_replace_editor>\n<parameter=command>str_replace</parameter>\n"
        "<parameter=path>/testbed/a.py</parameter>\n<parameter=old_str>\n  x = 1\n</parameter>\n"
        "<parameter=new_str>\n  x = 2\n\n</parameter>\n</function>"
    )
    call = parse_tool_call(text)
    assert call.name == "str_replace_editor"
    assert call.thought == "Let me fix it."
    # exactly one leading and one trailing newline are dropped; inner whitespace is kept
    assert call.params["old_str"] == "  x = 1"
    assert call.params["new_str"] == "  x = 2\n"


def test_format_and_parse_round_trip() -> None:
    call = parse_tool_call(format_tool_call("execute_bash", command="echo 'a<b>'", timeout="5"))
    assert call.params == {"command": "echo 'a<b>'", "timeout": "5"}
    assert parse_tool_call(format_tool_call("submit")).params == {}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("just text", "No tool call found"),
        ("<function=execute_bash><parameter=command>ls</parameter>", "not closed"),
        ("<function=rm_rf></function>", "Unknown tool 'rm_rf'"),
        ("<function=execute_bash><parameter=cmd>ls</parameter></function>", "Unknown parameter 'cmd'"),
        ("<function=execute_bash></function>", "Missing required parameter(s) for execute_bash: command"),
        ("<function=submit></function><function=submit></function>", "exactly one"),
        ("<function=execute_bash><parameter=command>a</parameter><parameter=command>b</parameter></function>",
         "given twice"),
        ("<function=execute_bash><parameter=command>ls</function>", "not closed by '</parameter>'"),
    ],
)
def test_malformed_calls_raise_with_a_message(text: str, message: str) -> None:
    with pytest.raises(ToolCallError, match=None) as err:
        parse_tool_call(text)
    assert message in str(err.value)


def test_parse_timeout_caps_and_validates() -> None:
    assert parse_timeout(None, 60, 600) == 60
    assert parse_timeout("5", 60, 600) == 5
    assert parse_timeout("9999", 60, 600) == 600
    with pytest.raises(ToolCallError, match="number"):
        parse_timeout("soon", 60, 600)
    with pytest.raises(ToolCallError, match="positive"):
        parse_timeout("-1", 60, 600)


def test_truncate_output_says_how_much_was_cut() -> None:
    # 26 letters, limit 10 -> head 5 ("abcde"), tail 5 ("vwxyz"), 26 - 10 = 16 cut
    out = truncate_output("abcdefghijklmnopqrstuvwxyz", 10)
    assert out == "abcde\n[... output truncated: 16 of 26 characters cut ...]\nvwxyz"
    assert truncate_output("short", 10) == "short"


# -- editor --------------------------------------------------------------------------------


@pytest.fixture()
def editor(tmp_path: Path) -> Editor:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("one\ntwo\nthree\ntwo\n")
    (tmp_path / "pkg" / "deep" / "deeper").mkdir(parents=True)
    (tmp_path / "pkg" / "deep" / "deeper" / "x.py").write_text("")
    (tmp_path / ".hidden").write_text("")
    return Editor(LocalFS(tmp_path))


def test_view_file_is_line_numbered_with_ranges(editor: Editor) -> None:
    root = editor.fs.root
    full = editor.run({"command": "view", "path": "pkg/a.py"})
    assert f"{root}/pkg/a.py" in full
    assert "     1\tone\n     2\ttwo\n     3\tthree" in full
    part = editor.run({"command": "view", "path": "pkg/a.py", "view_range": "[2, 3]"})
    assert part.endswith("     2\ttwo\n     3\tthree")
    to_end = editor.run({"command": "view", "path": "pkg/a.py", "view_range": "[4, -1]"})
    assert "     4\ttwo" in to_end and "three" not in to_end


@pytest.mark.parametrize("rng", ["[0, 2]", "[3, 2]", "[1, 99]", "[1]", "two"])
def test_view_rejects_bad_ranges(editor: Editor, rng: str) -> None:
    with pytest.raises(ToolCallError, match="view_range"):
        editor.run({"command": "view", "path": "pkg/a.py", "view_range": rng})


def test_view_directory_lists_two_levels_without_hidden(editor: Editor) -> None:
    out = editor.run({"command": "view", "path": "."})
    root = editor.fs.root
    assert f"{root}/pkg/a.py" in out and f"{root}/pkg/deep" in out
    assert "deeper/x.py" not in out  # level 3
    assert ".hidden" not in out


def test_create_refuses_to_overwrite(editor: Editor) -> None:
    assert "created" in editor.run({"command": "create", "path": "pkg/new/b.py", "file_text": "b\n"})
    assert Path(editor.fs.root, "pkg/new/b.py").read_text() == "b\n"
    with pytest.raises(ToolCallError, match="already exists"):
        editor.run({"command": "create", "path": "pkg/a.py", "file_text": "x"})


def test_str_replace_unique_match_rule(editor: Editor) -> None:
    path = Path(editor.fs.root, "pkg/a.py")
    with pytest.raises(ToolCallError, match=r"Multiple occurrences \(2\).*lines \[2, 4\]"):
        editor.run({"command": "str_replace", "path": "pkg/a.py", "old_str": "two", "new_str": "2"})
    with pytest.raises(ToolCallError, match="did not appear verbatim"):
        editor.run({"command": "str_replace", "path": "pkg/a.py", "old_str": "four", "new_str": "4"})
    assert path.read_text() == "one\ntwo\nthree\ntwo\n"  # failed edits change nothing
    out = editor.run({"command": "str_replace", "path": "pkg/a.py", "old_str": "two\nthree", "new_str": "2\n3"})
    assert path.read_text() == "one\n2\n3\ntwo\n"
    assert "     2\t2\n     3\t3" in out


def test_insert_and_undo(editor: Editor) -> None:
    path = Path(editor.fs.root, "pkg/a.py")
    editor.run({"command": "insert", "path": "pkg/a.py", "insert_line": "0", "new_str": "zero"})
    assert path.read_text() == "zero\none\ntwo\nthree\ntwo\n"
    editor.run({"command": "insert", "path": "pkg/a.py", "insert_line": "5", "new_str": "five"})
    assert path.read_text() == "zero\none\ntwo\nthree\ntwo\nfive\n"
    with pytest.raises(ToolCallError, match=r"within \[0, 6\]"):
        editor.run({"command": "insert", "path": "pkg/a.py", "insert_line": "7", "new_str": "x"})
    editor.run({"command": "undo_edit", "path": "pkg/a.py"})
    editor.run({"command": "undo_edit", "path": "pkg/a.py"})
    assert path.read_text() == "one\ntwo\nthree\ntwo\n"
    with pytest.raises(ToolCallError, match="No edit history"):
        editor.run({"command": "undo_edit", "path": "pkg/a.py"})


def test_paths_outside_the_work_tree_are_refused(editor: Editor, tmp_path: Path) -> None:
    outside = tmp_path.parent / "outside.txt"
    outside.write_text("secret")
    os.symlink(outside, tmp_path / "link.txt")
    for path in ("/etc/passwd", "../outside.txt", "pkg/../../outside.txt", "link.txt"):
        with pytest.raises(ToolCallError, match="outside the work tree"):
            editor.run({"command": "view", "path": path})
    with pytest.raises(ToolCallError, match="outside the work tree"):
        editor.run({"command": "create", "path": "/tmp/evil.py", "file_text": "x"})


def test_unknown_command_and_missing_file(editor: Editor) -> None:
    with pytest.raises(ToolCallError, match="Unknown editor command"):
        editor.run({"command": "delete", "path": "pkg/a.py"})
    with pytest.raises(ToolCallError, match="does not exist"):
        editor.run({"command": "str_replace", "path": "pkg/none.py", "old_str": "a"})
    with pytest.raises(ToolCallError, match="not a regular file"):
        editor.run({"command": "insert", "path": "pkg", "insert_line": "0", "new_str": "a"})
