"""``crl-experiment``: a grid of methods × seeds × env mixtures, each cell a normal crl-train run.

A suite file (YAML) names the grid; every cell is a run directory under ``OUT/cells/`` written by
the same :class:`~crl_train.run.trainer.Trainer` as ``crl-train``, then evaluated on held-out seeds
as ``crl-eval`` does. Interrupting is safe: a finished cell (``cell.json`` written after its
evaluation) is kept, a cell with a checkpoint resumes from it, a cell without one starts over.
A cell holds a lock file while it runs, so several ``crl-experiment`` processes can share one
``--out`` (one per core, say): each skips the cells another one is running and comes back to them
at the end, when they are finished (or resumes one whose process stopped).
Cells run one after another, or each as a Ray task with the resources the suite asks for
(``--ray local`` or ``--ray ADDRESS``): Ray schedules them across a cluster.

A named *variant* is a reference line that is not a method of its own: a method run with extra
overrides (the oracle extractor on a diagnostic env, say). It gets cells on every seed and env
mixture under its own name and its own row in the report, paired difference to grpo included.

>>> s = suite_from_dict({"name": "demo", "methods": ["grpo", "complementary"], "seeds": [0, 1]})
>>> [c.name for c in cells(s)]  # doctest: +NORMALIZE_WHITESPACE
['grpo/MiniHack-Room-5x5-v0/seed0', 'grpo/MiniHack-Room-5x5-v0/seed1',
 'complementary/MiniHack-Room-5x5-v0/seed0', 'complementary/MiniHack-Room-5x5-v0/seed1']
>>> oracle = {"method": "static_online", "set": ["extractor.model=oracle"]}
>>> s = suite_from_dict({"name": "demo", "methods": ["grpo"], "seeds": [0],
...                      "variants": {"oracle": oracle}})
>>> s.rows, [c.name for c in cells(s)]
(('grpo', 'oracle'), ['grpo/MiniHack-Room-5x5-v0/seed0', 'oracle/MiniHack-Room-5x5-v0/seed0'])
"""

from __future__ import annotations

import fcntl
import json
import logging
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NotRequired, TypedDict

from crl_train.config import METHOD_NAMES, ConfigError, TrainConfig, load_config
from crl_train.config.io import build_dataclass, read_yaml
from crl_train.config.names import MethodName
from crl_train.experiment.provenance import code_commit, package_versions

log = logging.getLogger(__name__)

CELL_FILE = "cell.json"
"""Written last in a cell's directory: the cell is finished (trained and evaluated)."""
RESUMES_FILE = "resumes.jsonl"
"""One line per start of a cell that resumed from a checkpoint (its step): the report says which
cells were resumed."""
LOCKS_DIR = "locks"
"""``OUT/locks/``: one lock file per cell, held while a process runs the cell."""
VARIANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
"""A variant's name is a directory name of its cells."""


@dataclass(frozen=True)
class Variant:
    """A named reference line: a method run with its own overrides, reported as a row of its own."""

    method: str
    """The method its cells run (``crl_train.methods``)."""
    set: tuple[str, ...] = ()
    """``--set`` overrides of its cells, applied after the suite's ``set``."""


@dataclass(frozen=True)
class Suite:
    """One experiment grid (see the module docstring)."""

    name: str
    """Shown in the report."""
    methods: tuple[str, ...]
    """Methods to compare (``crl_train.methods``); ``grpo`` is the reference of the
    paired differences."""
    seeds: tuple[int, ...]
    """Seeds of every (method, env mixture): the run's ``seed`` and ``env.seed``."""
    envs: tuple[tuple[str, ...], ...] = (("crl/MiniHack-Room-5x5-v0",),)
    """Env mixtures: each is one run's ``env.ids`` (several ids = multi-task)."""
    config: str | None = None
    """Base crl-train YAML config of every cell (relative to the suite file); None = the
    tiny preset."""
    set: tuple[str, ...] = ()
    """``--set`` overrides of every cell, e.g. ``train.steps=40``."""
    method_set: dict[str, Any] = field(default_factory=dict)
    """Extra overrides per method: ``{offline_exp: [experience.offline_source=...]}``."""
    variants: dict[str, Variant] = field(default_factory=dict)
    """Named reference lines, ``{oracle: {method: static_online, set: [extractor.model=oracle]}}``:
    each runs on every seed and env mixture like a method and has its own report row."""
    eval_episodes: int = 32
    """Held-out episodes per mode evaluated after training."""
    eval_memory: tuple[str, ...] = ("frozen", "none")
    """Memory modes of that evaluation (``crl-eval --memory``: ``none``, ``frozen``, ``online``);
    every mode plays the same held-out tasks."""
    resources: dict[str, Any] = field(default_factory=lambda: {"num_cpus": 1, "num_gpus": 0})
    """Ray resources of one cell (``--ray``): ``num_cpus``, ``num_gpus``."""
    description: str = ""
    """What the suite reproduces (a figure or table of the papers)."""
    reading: str | None = None
    """A Markdown file (relative to the suite file) the report opens with: what the run shows and
    what it cannot, written after reading the tables; absent or None: the report opens with
    the tables."""
    contrasts: tuple[tuple[str, str], ...] = ()
    """Paired differences ``a − b`` (rows of the suite, over the same seeds) of the report's tables
    per fifth of training; empty: complementary − static_online when the suite has both."""

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in METHOD_NAMES]
        if unknown or not self.methods:
            raise ConfigError(
                f"methods: unknown or empty {unknown or list(self.methods)}; accepted: "
                f"{', '.join(METHOD_NAMES)}"
            )
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ConfigError(f"seeds must be distinct and at least one, got {list(self.seeds)}")
        if not self.envs or any(not e for e in self.envs):
            raise ConfigError(
                "envs must list at least one env mixture, each with at least one env id"
            )
        if self.eval_episodes < 1:
            raise ConfigError(f"eval_episodes must be >= 1, got {self.eval_episodes}")
        if not self.eval_memory or any(
            m not in ("none", "frozen", "online") for m in self.eval_memory
        ):
            raise ConfigError(
                f"eval_memory: a list of none, frozen, online; got {list(self.eval_memory)}"
            )
        for m, extra in self.method_set.items():
            if (
                m not in self.methods
                or not isinstance(extra, list | tuple)
                or not all(isinstance(x, str) for x in extra)
            ):
                raise ConfigError(
                    f"method_set.{m}: a method of the suite mapped to a list of KEY=VALUE strings"
                )
        for name, v in self.variants.items():
            if (
                not isinstance(name, str)
                or not VARIANT_NAME.fullmatch(name)
                or name in METHOD_NAMES
            ):
                raise ConfigError(
                    f"variants.{name}: a variant's name must be a directory name (letters, digits, "
                    f"'_', '.', '-') and not a method's ({', '.join(METHOD_NAMES)})"
                )
            if not isinstance(v, Variant) or v.method not in METHOD_NAMES:
                raise ConfigError(
                    f"variants.{name}: needs method, one of {', '.join(METHOD_NAMES)}, "
                    f"got {getattr(v, 'method', v)!r}"
                )

        for pair in self.contrasts:
            if len(pair) != 2 or pair[0] == pair[1] or not all(x in self.rows for x in pair):
                raise ConfigError(
                    "contrasts: each is [a, b], two different rows of the suite "
                    f"({', '.join(self.rows)}), got {list(pair)}"
                )

    @property
    def pairs(self) -> tuple[tuple[str, str], ...]:
        """The contrasts the report shows (see ``contrasts``)."""
        if self.contrasts:
            return tuple((a, b) for a, b in self.contrasts)
        pair = (MethodName.COMPLEMENTARY.value, MethodName.STATIC_ONLINE.value)
        return (pair,) if set(pair) <= set(self.rows) else ()

    @property
    def rows(self) -> tuple[str, ...]:
        """What the report compares: the methods, then the variants (each a cell name's
        first part)."""
        return (*self.methods, *self.variants)


@dataclass(frozen=True)
class Cell:
    """One run of the grid."""

    method: str
    seed: int
    envs: tuple[str, ...]

    @property
    def env_tag(self) -> str:
        return "+".join(e.split("/")[-1] for e in self.envs)

    @property
    def name(self) -> str:
        return f"{self.method}/{self.env_tag}/seed{self.seed}"


class CellRecord(TypedDict):
    """A finished cell's ``cell.json``: what the report reads of one run."""

    method: str
    seed: int
    envs: list[str]
    steps: int
    run_method: str
    eval: dict[str, Any]
    """The run's ``eval.json`` (:func:`crl_train.run.evaluate.evaluate_run`)."""
    resumed_from: list[int]
    """The checkpoint steps its starts resumed from ([]: it ran in one go)."""
    commit: NotRequired[str]
    """The code's commit when the cell finished (:func:`~crl_train.experiment.provenance.
    code_commit`); absent in an older cell.json."""
    packages: NotRequired[dict[str, str]]
    """The versions of the packages that can change its numbers (:func:`~crl_train.experiment.
    provenance.package_versions`); absent in an older cell.json."""


def record_dir(out: Path, record: CellRecord) -> Path:
    """The run directory of the cell a ``cell.json`` record describes."""
    return out / "cells" / Cell(record["method"], int(record["seed"]), tuple(record["envs"])).name


def suite_from_dict(data: dict[str, Any]) -> Suite:
    if not isinstance(data, dict):
        raise ConfigError(f"a suite must be a mapping at the top level, got {type(data).__name__}")
    data = dict(data)
    if "envs" in data:  # a bare env id is a mixture of one
        data["envs"] = [[e] if isinstance(e, str) else e for e in data["envs"]]
    if isinstance(data.get("variants"), dict):
        data["variants"] = {
            k: build_dataclass(Variant, v, f"variants.{k}") if isinstance(v, dict) else v
            for k, v in data["variants"].items()
        }
    suite: Suite = build_dataclass(Suite, data)
    return suite


def load_suite(path: Path) -> Suite:
    """A suite file; its ``config`` and ``reading`` paths are resolved against the file's folder."""
    suite = suite_from_dict(read_yaml(path))
    for key in ("config", "reading"):
        value = getattr(suite, key)
        if value is not None and not Path(value).is_absolute():
            suite = Suite(**{**suite.__dict__, key: str((path.parent / value).resolve())})
    return suite


def cells(suite: Suite) -> list[Cell]:
    """Every cell: ``Cell.method`` is the row (a method's name or a variant's)."""
    return [Cell(m, s, e) for e in suite.envs for m in suite.rows for s in suite.seeds]


def cell_config(suite: Suite, cell: Cell) -> TrainConfig:
    """The cell's config: the suite's base config, its overrides, the method's (or the variant's),
    then the cell's own."""
    ids = "[" + ", ".join(f'"{e}"' for e in cell.envs) + "]"
    variant = suite.variants.get(cell.method)
    method, extra = (
        (variant.method, variant.set)
        if variant
        else (cell.method, suite.method_set.get(cell.method, ()))
    )
    overrides = [
        *suite.set,
        *extra,
        f"method={method}",
        f"seed={cell.seed}",
        f"env.seed={cell.seed}",
        f"env.ids={ids}",
        "train.eval_episodes=0",
    ]
    from crl_train.methods import check_method_config

    cfg = load_config(Path(suite.config) if suite.config else None, overrides)
    check_method_config(cfg)
    return cfg


def is_finished(cell_dir: Path) -> bool:
    return (cell_dir / CELL_FILE).is_file()


def finished_records(suite: Suite, out: Path) -> list[CellRecord]:
    """The ``cell.json`` of every cell of ``suite`` finished under ``out``, in the suite's order
    (what ``crl-experiment --report-only`` reports on)."""
    records: list[CellRecord] = []
    for cell in cells(suite):
        path = out / "cells" / cell.name / CELL_FILE
        if path.is_file():
            records.append(json.loads(path.read_text(encoding="utf-8")))
    return records


def resumed_from(cell_dir: Path) -> list[int]:
    """The checkpoint steps the cell's starts resumed from, in order ([]: it ran in one go)."""
    path = cell_dir / RESUMES_FILE
    if not path.exists():
        return []
    return [
        int(json.loads(line)["checkpoint_step"])
        for line in path.read_text(encoding="utf-8").splitlines()
        if line
    ]


def lock_path(out: Path, cell: Cell) -> Path:
    return out / LOCKS_DIR / (cell.name.replace("/", "__") + ".lock")


@contextmanager
def cell_lock(out: Path, cell: Cell, *, wait: bool) -> Iterator[bool]:
    """Hold the cell's lock (an ``flock`` on ``OUT/locks/<cell>.lock``) for the ``with`` block;
    yields False at once when another process holds it and ``wait`` is False. The lock file lives
    outside the cell's directory, which a fresh start deletes; the kernel releases the lock if
    the process dies."""
    path = lock_path(out, cell)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def run_cell(
    suite: Suite, cell: Cell, out: Path, *, env_factory: Callable[[str], Any] | None = None
) -> CellRecord:
    """Train and evaluate one cell (or resume it); returns what ``cell.json`` holds."""
    from crl_train.run.checkpoints import resolve_checkpoint
    from crl_train.run.evaluate import evaluate_run
    from crl_train.run.trainer import Trainer

    cell_dir = out / "cells" / cell.name
    if is_finished(cell_dir):
        done: CellRecord = json.loads((cell_dir / CELL_FILE).read_text(encoding="utf-8"))
        return done
    cfg = cell_config(suite, cell)
    resume = cell_dir.is_dir() and resolve_checkpoint(cell_dir) is not None
    if cell_dir.exists() and not resume:
        shutil.rmtree(cell_dir)  # a start without any checkpoint: nothing to keep
    trainer = Trainer(cfg, cell_dir, resume=resume, progress=False, env_factory=env_factory)
    try:
        if resume:  # the trainer has loaded the checkpoint: this start continues after its step
            with (cell_dir / RESUMES_FILE).open("a", encoding="utf-8") as f:
                f.write(json.dumps({"checkpoint_step": trainer.start_step - 1}) + "\n")
        trainer.run()
        result = evaluate_run(trainer, suite.eval_episodes, memory=suite.eval_memory)
    finally:
        trainer.close()
    record: CellRecord = {
        "method": cell.method,
        "seed": cell.seed,
        "envs": list(cell.envs),
        "steps": cfg.train.steps,
        "run_method": cfg.method,
        "eval": result,
        "resumed_from": resumed_from(cell_dir),
        "commit": code_commit(),
        "packages": package_versions(),
    }
    tmp = cell_dir / (CELL_FILE + ".tmp")
    tmp.write_text(json.dumps(record, indent=2), encoding="utf-8")
    tmp.replace(cell_dir / CELL_FILE)
    return record


def _ray_cell(suite: Suite, cell: Cell, out: str) -> CellRecord:
    return run_cell(suite, cell, Path(out))


def run_suite(
    suite: Suite,
    out: Path,
    *,
    ray_address: str | None = None,
    progress: bool = True,
    env_factory: Callable[[str], Any] | None = None,
) -> list[CellRecord]:
    """Every cell (finished ones are read back); returns the cells' records in grid order."""
    from tqdm import tqdm

    out.mkdir(parents=True, exist_ok=True)
    grid = cells(suite)
    finished = {c.name for c in grid if is_finished(out / "cells" / c.name)}
    bar = tqdm(
        total=len(grid),
        initial=len(finished),
        desc=f"{suite.name} cells",
        unit="cell",
        disable=not progress,
    )
    records: dict[str, CellRecord] = {}

    def run(c: Cell) -> None:
        records[c.name] = run_cell(suite, c, out, env_factory=env_factory)
        if c.name not in finished:
            bar.update(1)

    try:
        if ray_address is None:
            busy = []  # cells another process on this --out is running: back to them at the end
            for c in grid:
                with cell_lock(out, c, wait=False) as mine:
                    if mine:
                        run(c)
                    else:
                        log.info(
                            "cell %s is running in another process; coming back to it at the end",
                            c.name,
                        )
                        busy.append(c)
            for c in busy:
                with cell_lock(out, c, wait=True):
                    run(c)  # finished by then, or resumed here if that process stopped
        else:
            records = _run_on_ray(suite, grid, out, ray_address, bar)
    finally:
        bar.close()
    return [records[c.name] for c in grid]


def _run_on_ray(
    suite: Suite, grid: list[Cell], out: Path, address: str, bar: Any
) -> dict[str, CellRecord]:
    """Each unfinished cell as one Ray task with ``suite.resources`` (Ray is the scheduler)."""
    import ray

    ray.init(
        address=None if address == "local" else address,
        ignore_reinit_error=True,
        log_to_driver=False,
    )
    task = ray.remote(**{k: v for k, v in suite.resources.items() if v is not None})(_ray_cell)
    records: dict[str, CellRecord] = {}
    pending: dict[Any, str] = {}
    for c in grid:
        if is_finished(out / "cells" / c.name):
            records[c.name] = run_cell(suite, c, out)
        else:
            pending[task.remote(suite, c, str(out))] = c.name
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1)
        for ref in ready:
            records[pending.pop(ref)] = ray.get(ref)
            bar.update(1)
    return records
