"""The README's code examples run as written (with the bank directory moved to a temp dir)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_opens_with_the_two_setup_commands() -> None:
    head = README.read_text().split("\n## ", 1)[0]
    assert "make run" in head and "make test" in head


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(_python_blocks())))
def test_readme_python_example_runs(index: int, tmp_path: Path) -> None:
    code = _python_blocks()[index].replace('"runs/bank"', repr(str(tmp_path / "bank")))
    script = tmp_path / "example.py"
    script.write_text(code)
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=600,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "walk along the walls" in result.stdout
