"""Where a suite's numbers come from: the commit and the packages each cell ran with, the commit
that wrote the report, and the machine.

A cell records :func:`code_commit` and :func:`package_versions` in its ``cell.json`` when it
finishes, so a report written later by newer code (``crl-experiment --report-only``) or in a fresh
environment still names what produced each cell: a suite that spans several sessions may see a
dependency resolve to a newer release between them.
"""

from __future__ import annotations

import os
import platform
import subprocess
from collections.abc import Callable, Sequence
from importlib import metadata
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


PACKAGES = ("torch", "transformers", "peft", "sentence-transformers", "usearch", "numpy")
"""The installed packages whose release can change a cell's numbers."""


def package_versions() -> dict[str, str]:
    """``{name: version}`` of :data:`PACKAGES`, ``"absent"`` for one that is not installed."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "absent"
    return versions


def _packages_line(packages: dict[str, str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in packages.items())


def _grouped(
    records: Sequence[CellRecord], label: Callable[[CellRecord], str | None], what: str
) -> list[str]:
    """One bullet per ``label`` the cells share, then one for the cells an older cell.json labels
    None (``what``: what it does not record, e.g. "commit is")."""
    groups: dict[str | None, list[str]] = {}
    for r in records:
        groups.setdefault(label(r), []).append(f"{r['method']} {r['seed']}")
    return [
        f"* cells {key}: {len(names)} ({', '.join(names)})"
        if key is not None
        else f"* cells whose {what} not recorded (an older cell.json): {len(names)} "
        f"({', '.join(names)})"
        for key, names in sorted(groups.items(), key=lambda kv: (kv[0] is None, kv[0] or ""))
    ]


def provenance(records: Sequence[CellRecord] = ()) -> list[str]:
    """Markdown bullets: the commit(s) and package sets the cells ran with, the report's commit, the
    machine."""
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    cells = _grouped(
        records, lambda r: f"run at `{r['commit']}`" if "commit" in r else None, "commit is"
    )
    packages = _grouped(
        records,
        lambda r: f"run with {_packages_line(r['packages'])}" if "packages" in r else None,
        "packages are",
    )
    return [
        *cells,
        *packages,
        f"* report written at `{code_commit()}`",
        f"* machine: {platform.platform()}, Python {platform.python_version()}, {os.cpu_count()} "
        f"CPUs, GPU: {gpu}; installed now: {_packages_line(package_versions())}",
    ]
