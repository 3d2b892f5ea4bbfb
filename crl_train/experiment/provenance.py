"""Where a suite's numbers come from: the commit each cell ran at, the one that wrote the report,
and the machine.

A cell records :func:`code_commit` in its ``cell.json`` when it finishes, so a report written
later by newer code (``crl-experiment --report-only``) still names the code that produced each
cell.
"""

from __future__ import annotations

import os
import platform
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from crl_train.experiment.suite import CellRecord


def _git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", *args],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=Path(__file__).resolve().parent,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def code_commit() -> str:
    """The commit of this code, ``+dirty`` when tracked files differ from it; ``unknown`` outside a
    git checkout."""
    commit = _git("rev-parse", "HEAD")
    if not commit:
        return "unknown"
    return commit + ("+dirty" if _git("status", "--porcelain", "--untracked-files=no") else "")


def provenance(records: Sequence[CellRecord] = ()) -> list[str]:
    """Markdown bullets: the commit(s) the cells ran at, the report's commit, the machine."""
    import torch

    ran: dict[str, list[str]] = {}
    for r in records:
        ran.setdefault(r.get("commit", "not recorded"), []).append(f"{r['method']} {r['seed']}")
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    cells = [
        f"* cells run at `{commit}`: {len(names)} ({', '.join(names)})"
        if commit != "not recorded"
        else f"* cells whose commit is not recorded (an older cell.json): {len(names)} "
        f"({', '.join(names)})"
        for commit, names in sorted(ran.items())
    ]
    return [
        *cells,
        f"* report written at `{code_commit()}`",
        f"* machine: {platform.platform()}, Python {platform.python_version()}, {os.cpu_count()} "
        f"CPUs, torch {torch.__version__}, GPU: {gpu}",
    ]
