"""docs/wrappers.md's "Your own env" adapters run as written: a turn-based game API and a
question set with a scoring function, each through the wrappers."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "wrappers.md"


def _section_blocks() -> list[str]:
    text = DOC.read_text()
    start = text.index("\n## Your own env\n")
    end = text.index("\n## ", start + 1)
    return re.findall(r"```python\n(.*?)```", text[start:end], flags=re.S)


def test_the_section_holds_both_adapters() -> None:
    blocks = _section_blocks()
    assert len(blocks) == 2
    assert "reset(num_players=2" in blocks[0] and "get_observation()" in blocks[0] and ".close()" in blocks[0]
    assert "score_answer(action, self.entry)" in blocks[1]


@pytest.mark.parametrize("index, expected", [
    (0, "user/Nim-v0 guided True 1.0"),
    (1, "[('guided', 0.2, False), ('free', 0.2, False)]"),
])
def test_an_adapter_from_the_docs_runs(index: int, expected: str, tmp_path: Path) -> None:
    script = tmp_path / "adapter.py"
    script.write_text(_section_blocks()[index])
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                            env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(DOC.parents[1])},
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == expected
