"""SWE-bench tasks: instances in SWE-bench's own format, loaded with swebench's loader.

A task source is a ``.jsonl`` / ``.json`` file (each line / element one instance), a list of
instance dicts, or a hub dataset id (``princeton-nlp/SWE-bench_Verified``) where a network
exists. Every instance needs ``instance_id``, ``repo``, ``base_commit``,
``problem_statement``, ``test_patch``, ``FAIL_TO_PASS`` and ``PASS_TO_PASS``; this project adds
three optional keys for instances without a swebench image: ``repo_path`` / ``repo_tarball``
(the repository, relative paths resolved against the file's directory) and ``test_cmd``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NotRequired, TypedDict, cast

from swebench.harness.utils import load_swebench_dataset

REQUIRED = (
    "instance_id",
    "repo",
    "base_commit",
    "problem_statement",
    "test_patch",
    "FAIL_TO_PASS",
    "PASS_TO_PASS",
)
LIST_FIELDS = ("FAIL_TO_PASS", "PASS_TO_PASS")
PATH_FIELDS = ("repo_path", "repo_tarball")


class SWEInstance(TypedDict):
    """One checked SWE-bench instance (:func:`normalize_instance`): the fields this package reads.
    An instance keeps every other field its source has (``hints_text``, ``created_at``, ...)."""

    instance_id: str
    repo: str
    base_commit: str
    problem_statement: str
    test_patch: str
    FAIL_TO_PASS: list[str]
    """Test ids, decoded from the JSON string of the hub data."""
    PASS_TO_PASS: list[str]
    version: NotRequired[str]
    patch: NotRequired[str]
    image: NotRequired[str]
    """A prebuilt image to run the instance in (before swebench's own image names)."""
    repo_path: NotRequired[str]
    """A git checkout of the repository (relative paths resolved against the task file)."""
    repo_tarball: NotRequired[str]
    test_cmd: NotRequired[str]
    eval_script: NotRequired[str]
    log_parser: NotRequired[str]
    eval_type: NotRequired[str]


class TaskFormatError(ValueError):
    """An instance is missing a field or has one of the wrong type; the message says where."""


def normalize_instance(instance: object, where: str = "instance") -> SWEInstance:
    """Check the required fields and decode the test lists (JSON strings in the hub data).

    >>> inst = normalize_instance({"instance_id": "a__b-1", "repo": "a/b", "base_commit": "abc",
    ...     "problem_statement": "bug", "test_patch": "", "FAIL_TO_PASS": '["t::x"]',
    ...     "PASS_TO_PASS": "[]"})
    >>> inst["FAIL_TO_PASS"], inst["PASS_TO_PASS"]
    (['t::x'], [])
    """
    if not isinstance(instance, dict):
        raise TaskFormatError(
            f"{where}: an instance must be a JSON object, got {type(instance).__name__}"
        )
    missing = [k for k in REQUIRED if k not in instance]
    if missing:
        raise TaskFormatError(f"{where}: missing field(s) {', '.join(missing)}")
    out = dict(instance)
    for key in LIST_FIELDS:
        value = out[key]
        if isinstance(value, str):
            try:
                value = json.loads(value) if value.strip() else []
            except json.JSONDecodeError as exc:
                raise TaskFormatError(f"{where}: field {key} is not a JSON list: {exc}") from exc
        if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
            raise TaskFormatError(f"{where}: field {key} must be a list of test ids")
        out[key] = value
    for key in ("instance_id", "repo", "base_commit", "problem_statement", "test_patch"):
        if not isinstance(out[key], str):
            raise TaskFormatError(f"{where}: field {key} must be a string")
    return cast("SWEInstance", out)  # the fields SWEInstance requires are checked above


def _check_file(path: Path) -> None:
    """Name the first bad line of a local file before swebench's loader sees it."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                raise TaskFormatError(f"{path}:{lineno}: empty line (one JSON object per line)")
            try:
                normalize_instance(json.loads(line), f"{path}:{lineno}")
            except json.JSONDecodeError as exc:
                raise TaskFormatError(f"{path}:{lineno}: invalid JSON: {exc}") from exc
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TaskFormatError(f"{path}: invalid JSON: {exc}") from exc
        if not isinstance(data, list):
            raise TaskFormatError(f"{path}: a .json task file must hold a list of instances")
        for i, item in enumerate(data):
            normalize_instance(item, f"{path}[{i}]")


def load_tasks(
    source: str | Path | Sequence[Mapping[str, object]],
    split: str = "test",
    instance_ids: list[str] | None = None,
) -> list[SWEInstance]:
    """Load and check instances from a file, a list, or a hub dataset id."""
    if not isinstance(source, (str, Path)):
        tasks = [normalize_instance(t, f"instance {i}") for i, t in enumerate(source)]
        if instance_ids:
            wanted = set(instance_ids)
            unknown = wanted - {t["instance_id"] for t in tasks}
            if unknown:
                raise TaskFormatError(f"unknown instance id(s): {', '.join(sorted(unknown))}")
            tasks = [t for t in tasks if t["instance_id"] in wanted]
        return tasks
    path = Path(source).expanduser()
    base_dir: Path | None = None
    if path.suffix in (".jsonl", ".json"):
        if not path.is_file():
            raise FileNotFoundError(f"task file {path} does not exist")
        _check_file(path)
        base_dir = path.resolve().parent
        raw = load_swebench_dataset(str(path), split=split, instance_ids=instance_ids)
    else:
        try:
            raw = load_swebench_dataset(str(source), split=split, instance_ids=instance_ids)
        except Exception as exc:
            raise RuntimeError(
                f"could not load the dataset {source!r} (split {split!r}) with swebench's loader: "
                f"{exc}. Without a network, pass a local .jsonl file of instances instead."
            ) from exc
    tasks = [
        normalize_instance(dict(t), f"{source}: {t.get('instance_id', i)}")
        for i, t in enumerate(raw)
    ]
    if base_dir is not None:
        for t in tasks:
            if t.get("repo_path"):
                t["repo_path"] = _against(base_dir, t["repo_path"])
            if t.get("repo_tarball"):
                t["repo_tarball"] = _against(base_dir, t["repo_tarball"])
    return tasks


def _against(base_dir: Path, path: str) -> str:
    """A relative path of a task file (one of :data:`PATH_FIELDS`) against the file's directory;
    an absolute one as it is."""
    return path if Path(path).expanduser().is_absolute() else str(base_dir / path)


def write_tasks(tasks: Sequence[SWEInstance], path: str | Path) -> None:
    """Write instances as JSONL (the format :func:`load_tasks` reads)."""
    with Path(path).open("w", encoding="utf-8") as f:
        for t in tasks:
            f.write(json.dumps(t) + "\n")
