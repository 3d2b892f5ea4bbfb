"""``crl/SWEBench-v0``: resolve a GitHub issue inside a locked-down Docker container.

The observation is text: first the issue and the tool instructions, then each tool's result.
The action is the model's text holding ONE tool call (format: :mod:`crl_gym.envs.swebench.tools`).
A malformed call is a turn whose observation is the error. ``submit`` takes ``git diff`` of the
work tree, grades it in a fresh container with swebench's grading (:mod:`.grading`) and ends the
episode: reward 1 when resolved, else 0, with the report under ``info["grading"]``.

Example (needs Docker and the base image; see ``docs/swebench.md``)::

    env = SWEBenchEnv(tasks="tasks.jsonl")
    obs, info = env.reset(options={"instance_id": "calc__calc-1"})
    obs, reward, terminated, truncated, info = env.step(
        '<function=execute_bash><parameter=command>pytest -q</parameter></function>')
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from crl_gym.envs.base import MAX_TEXT, TextEnv, to_charset
from crl_gym.envs.swebench.editor import Editor
from crl_gym.envs.swebench.grading import GradeResult, grade_patch, grading_config
from crl_gym.envs.swebench.image import ImageChoice, instance_image
from crl_gym.envs.swebench.pool import SandboxPool
from crl_gym.envs.swebench.sandbox import (
    DockerSandbox,
    EpisodeTimeoutError,
    SandboxConfig,
    docker_client,
)
from crl_gym.envs.swebench.tasks import SWEInstance, load_tasks
from crl_gym.envs.swebench.tools import (
    TOOL_FORMAT_HELP,
    ToolCallError,
    parse_timeout,
    parse_tool_call,
)
from crl_gym.json_types import EnvInfo, EnvOptions
from crl_gym.templates import SWEBENCH_TASK_TEMPLATE

log = logging.getLogger(__name__)

PROMPT = SWEBENCH_TASK_TEMPLATE


def episode_config(base: SandboxConfig, image: ImageChoice) -> SandboxConfig:
    """The limits of an episode's container: ``base`` with the image's own set-up."""
    return SandboxConfig(
        **{**base.__dict__, "env_setup": image.env_setup, "chown_workdir": image.chown_workdir}
    )


def _start_in_background(sandbox: DockerSandbox) -> Future[DockerSandbox]:
    """``sandbox.start()`` in a thread of its own; the future holds the started sandbox."""
    future: Future[DockerSandbox] = Future()

    def run() -> None:
        try:
            future.set_result(sandbox.start())
        except BaseException as exc:  # start() has removed what it made
            future.set_exception(exc)

    threading.Thread(target=run, name="crl-sandbox-prestart").start()
    return future


def _close_started(future: Future[DockerSandbox]) -> None:
    if future.exception() is None:
        future.result().close()


class SWEBenchEnv(TextEnv):
    """SWE-bench instances as a Gymnasium text env with a Docker sandbox per episode."""

    def __init__(
        self,
        tasks: str | Path | Sequence[Mapping[str, object]] | None = None,
        *,
        split: str = "test",
        instance_ids: list[str] | None = None,
        max_turns: int = 50,
        sandbox_config: SandboxConfig | None = None,
        grading_timeout: float = 900.0,
        render_mode: str | None = None,
        client: Any = None,
        prompt_template: str = PROMPT,
        prestart_grading: bool = True,
        pool: SandboxPool | None = None,
    ) -> None:
        super().__init__(max_turns=max_turns, render_mode=render_mode)
        if tasks is None:
            raise ValueError(
                "SWEBenchEnv needs tasks: a .jsonl/.json file of SWE-bench instances, a list, or a "
                "dataset id"
            )
        self.tasks = load_tasks(tasks, split=split, instance_ids=instance_ids)
        if not self.tasks:
            raise ValueError(f"no tasks loaded from {tasks!r}")
        self._by_id = {t["instance_id"]: t for t in self.tasks}
        self.sandbox_config = sandbox_config or SandboxConfig()
        self.grading_timeout = grading_timeout
        self.prompt_template = prompt_template
        self._client = client
        self.prestart_grading = prestart_grading
        """Start the grading container in the background as soon as the episode's is up, so that
        ``submit`` finds it ready (grading still gets a fresh container; see ``docs/swebench.md``).
        With a ``pool``, ``submit`` takes a fresh spare from it instead."""
        self._grader: Future[DockerSandbox] | None = None
        self.pool = pool
        """Where reset takes its container (:class:`~crl_gym.envs.swebench.pool.SandboxPool`: booted
        ahead, shared by the envs of a batch); ``None`` boots one at each reset."""
        self.sandbox: DockerSandbox | None = None
        self.editor: Editor | None = None
        self.instance: SWEInstance | None = None
        self.image: ImageChoice | None = None
        self._patch = ""
        self.stats: dict[str, int] = {
            "episodes": 0,
            "malformed_calls": 0,
            "sandbox_errors": 0,
            "timeouts": 0,
        }

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = docker_client()
        return self._client

    # -- episode -------------------------------------------------------------------------
    def reset(
        self, *, seed: int | None = None, options: EnvOptions | None = None
    ) -> tuple[str, EnvInfo]:
        super().reset(seed=seed)
        self._close_sandbox()
        options = options or {}
        if "instance_id" in options:
            if options["instance_id"] not in self._by_id:
                raise KeyError(
                    f"unknown instance_id {options['instance_id']!r}; known: "
                    f"{', '.join(self._by_id)}"
                )
            instance = self._by_id[options["instance_id"]]
        elif "index" in options:
            instance = self.tasks[int(options["index"]) % len(self.tasks)]
        else:
            instance = self.tasks[int(self.np_random.integers(len(self.tasks)))]
        self.instance = instance
        self.image = instance_image(self.client, instance)
        cfg = episode_config(self.sandbox_config, self.image)
        if self.pool is not None:
            self.sandbox = self.pool.acquire(self.image.name, cfg)
        else:
            self.sandbox = DockerSandbox(self.image.name, cfg, self.client).start()
        if (
            self.prestart_grading and self.pool is None
        ):  # with a pool, grading takes a spare at submit
            self._grader = _start_in_background(
                DockerSandbox(self.image.name, self._grading_config(), self.client)
            )
        self.editor = Editor(self.sandbox.fs)
        self.turn = 0
        self.stats["episodes"] += 1
        obs = self.prompt_template.format(
            workdir=cfg.workdir,
            problem_statement=instance["problem_statement"],
            tool_help=TOOL_FORMAT_HELP,
        )
        self._last_obs = self._fit(obs)
        info = {
            "task": instance["problem_statement"],
            "instance_id": instance["instance_id"],
            "turn": 0,
            "image": self.image.name,
            "latency": {"container_start": self.sandbox.start_latency},
        }
        return self._last_obs, info

    def step(self, action: str) -> tuple[str, float, bool, bool, EnvInfo]:
        if self.sandbox is None or self.instance is None:
            raise RuntimeError(
                "call reset() before step() (the episode has ended or never started)"
            )
        self.turn += 1
        info: EnvInfo = {
            "task": self.instance["problem_statement"],
            "instance_id": self.instance["instance_id"],
            "turn": self.turn,
        }
        reward, terminated, truncated = 0.0, False, False
        t0 = time.monotonic()
        restarts = self.sandbox.shell_restarts
        try:
            call = parse_tool_call(action)
            info["tool"] = call.name
            if call.name == "submit":
                result = self._submit()
                obs = f"Submitted. {result.reason}"
                reward, terminated = result.reward, True
                info.update(success=result.resolved, grading=result.to_info(), patch=self._patch)
                info["latency"] = {"grading": result.duration}
            elif call.name == "execute_bash":
                cfg = self.sandbox.config
                res = self.sandbox.exec(
                    call.params["command"],
                    parse_timeout(
                        call.params.get("timeout"), cfg.command_timeout, cfg.max_command_timeout
                    ),
                )
                obs = f"{res.output}\n[exit code: {res.exit_code}]" + (
                    f"\n{res.note}" if res.note else ""
                )
                self.stats["timeouts"] += int(res.timed_out)
                info["exit_code"], info["timed_out"] = res.exit_code, res.timed_out
            else:
                assert self.editor is not None
                obs = self.editor.run(call.params)
            if (
                self.sandbox is not None
            ):  # the shell was restarted during this call: the agent is told
                notices = self.sandbox.take_notices()
                if notices:
                    obs += "\n" + " ".join(notices)
                if self.sandbox.shell_restarts != restarts:
                    info["shell_restarted"] = True
        except ToolCallError as exc:
            self.stats["malformed_calls"] += 1
            obs = f"ERROR: {exc}" + (
                "\n\n" + TOOL_FORMAT_HELP if "tool call" in str(exc).lower() else ""
            )
            info["error"] = str(exc)
        except EpisodeTimeoutError as exc:
            obs, truncated = f"Episode stopped: {exc}.", True
            info["error"] = str(exc)
        except (
            Exception
        ) as exc:  # the engine failed under us: end the episode, never crash the trainer
            self.stats["sandbox_errors"] += 1
            log.exception("sandbox error in %s", self.instance["instance_id"])
            obs, truncated = f"Episode stopped: sandbox error ({type(exc).__name__}: {exc}).", True
            info["error"] = f"{type(exc).__name__}: {exc}"
        info.setdefault("latency", {})["tool_call"] = time.monotonic() - t0
        if not terminated and not truncated and self.turn >= self.max_turns:
            truncated = True
            info["error"] = f"turn limit of {self.max_turns} reached without submit"
        if terminated or truncated:
            info.setdefault("success", False)
            self._close_sandbox()
        self._last_obs = self._fit(obs)
        return self._last_obs, reward, terminated, truncated, info

    def _grading_config(self) -> SandboxConfig:
        assert self.image is not None
        return grading_config(episode_config(self.sandbox_config, self.image), self.grading_timeout)

    def _submit(self) -> GradeResult:
        assert self.sandbox is not None and self.instance is not None and self.image is not None
        self._patch = self.sandbox.diff()
        # grading runs in a fresh container; the agent's goes (its removal off the grading's path)
        done, self.sandbox, self.editor = self.sandbox, None, None
        threading.Thread(target=done.close, name="crl-sandbox-close").start()
        grader, self._grader = self._grader, None
        ready = (
            self.pool.acquire(self.image.name, self._grading_config())
            if self.pool is not None
            else None
        )
        if grader is not None:
            try:
                ready = grader.result()
            except Exception as exc:  # a failed prestart: grade_patch starts one itself
                log.warning("the prestarted grading container failed (%s); starting another", exc)
        return grade_patch(
            self.instance,
            self._patch,
            self.image.name,
            client=self.client,
            config=self._grading_config(),
            timeout=self.grading_timeout,
            sandbox=ready,
        )

    def _fit(self, text: str) -> str:
        text = to_charset(text)
        if len(text) > MAX_TEXT:
            cut = len(text) - MAX_TEXT + 100
            text = (
                text[: MAX_TEXT - 100] + f"\n[... observation truncated: {cut} characters cut ...]"
            )
        return text

    def _close_sandbox(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()
        self.sandbox, self.editor = None, None
        grader, self._grader = self._grader, None
        if grader is not None:  # an unused prestarted grading container
            grader.add_done_callback(_close_started)

    def close(self) -> None:
        self._close_sandbox()
        super().close()
