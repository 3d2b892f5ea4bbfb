#!/usr/bin/env bash
# GPU check: the hf backend on CUDA and, when vLLM imports, the vLLM generator, TRL and verl with vLLM (one GPU).
#
#   scripts/gpu_check.sh [PYTHON]        PYTHON: an interpreter with torch (CUDA) and transformers;
#                                        default .venv/bin/python if it exists, else python3
#
# 1. hf backend: a mid-size random-initialised Qwen2 (~180M parameters, byte-level tokenizer trained
#    on the spot) on cuda:0 — generation, then a few train_step calls (clip surrogate, sequence-level
#    ratio) on the generated sequences. Prints step time and tokens/s.
# 2. vLLM generator (crl_train/policy/vllm_engine.py), skipped with a note when vLLM does not import:
#    the keyword arguments we pass checked against the installed vLLM's LLM / SamplingParams / EngineArgs,
#    the engine built from the policy's weights, LLM.generate with token log-probs (tokens/s, and
#    how far its log-probs are from HFPolicy.logprobs on the same sequences), a weight sync after one
#    update (collective_rpc or the in-process load_weights path) and generation after it.
# 3. TRL with vLLM (examples/trl_grpo.py --vllm, < 5 minutes), skipped with a note when vLLM does not
#    import: TRL's GRPOTrainer with use_vllm=True (colocate) for two steps on SmolLM2 through the
#    crl_gym.integrations.trl adapter against crl-experience serve --extractor tiny; the TRL path the
#    CPU tests cannot run (trl/generation/vllm_generation.py raises ImportError without vLLM).
# 4. verl with vLLM (examples/verl/run_recall.sh, < 10 minutes), skipped with a note when verl or vLLM
#    does not import: `python -m verl.trainer.main_ppo` with the crl_agent loop, the crl_split_subgroup
#    estimator and the crl_sync trainer for two steps on SmolLM2 against crl-experience serve
#    --extractor tiny; the verl path the CPU tests cannot run (verl's rollout servers are vLLM/SGLang on
#    a GPU; the CPU tests drive verl's AgentLoopWorker with a CPU generator instead). It needs an
#    interpreter with verl 0.9.1 and its declared dependencies (transformers<5.11; docs/wrappers.md,
#    "From verl"), given as VERL_PYTHON (default: PYTHON).
# One JSON object per line on stdout; anything that fails exits non-zero with the error.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
timeout 480 "$PY" - <<'PYEOF'
import importlib.util
import inspect
import json
import sys
import tempfile
import time
from pathlib import Path

import torch


def emit(**kw):
    print(json.dumps(kw), flush=True)


if not torch.cuda.is_available():
    emit(check="cuda", ok=False, error="no CUDA device visible to torch", torch=torch.__version__)
    sys.exit(2)
emit(check="cuda", ok=True, device=torch.cuda.get_device_name(0), torch=torch.__version__,
     memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1))

from crl_train.algorithms import clip_surrogate_loss  # noqa: E402
from crl_train.policy.base import OptimConfig, SamplingConfig, TokenSequence, TrainBatch  # noqa: E402
from crl_train.policy.hf import HFPolicy  # noqa: E402
from crl_train.policy.tiny import build_tiny_model, train_tiny_tokenizer  # noqa: E402

torch.manual_seed(0)
texts = [f"turn {i}: go north, then east; the exit is {i % 7} cells away." for i in range(2000)]
tokenizer = train_tiny_tokenizer(texts, vocab_size=4096)
model = build_tiny_model(tokenizer, hidden=1024, layers=16, heads=16, kv_heads=4, intermediate=2816,
                         max_positions=4096, seed=0)
params = sum(p.numel() for p in model.parameters())
policy = HFPolicy(model, tokenizer, device="cuda", sampling=SamplingConfig(seed=0),
                  optim=OptimConfig(lr=1e-5, micro_batch_size=8))

# ---- hf generation
B, PROMPT, NEW = 32, 512, 128
prompts = [torch.randint(260, len(tokenizer), (PROMPT,)).tolist() for _ in range(B)]
policy.generate(prompts[:2], 8)  # warm-up
torch.cuda.synchronize()
t0 = time.perf_counter()
gens = policy.generate(prompts, NEW)
torch.cuda.synchronize()
gen_s = time.perf_counter() - t0
new_tokens = sum(len(g.token_ids) for g in gens)
emit(check="hf_generate", ok=True, params_m=round(params / 1e6, 1), sequences=B, prompt_tokens=PROMPT,
     new_tokens=new_tokens, seconds=round(gen_s, 3), tokens_per_s=round(new_tokens / gen_s, 1))

# ---- hf train_step
seqs = []
for g in gens:
    s = TokenSequence()
    s.append_context(g.prompt_ids)
    s.append_generation(g)
    seqs.append(s)
adv = torch.randn(B).tolist()
batch = TrainBatch.from_sequences(seqs, adv, policy.pad_token_id)
tokens = int(batch.attention_mask.sum())
times = []
for _ in range(4):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    metrics = policy.train_step(batch, clip_surrogate_loss, clip_eps=0.2, ratio_level="sequence")
    torch.cuda.synchronize()
    times.append(time.perf_counter() - t0)
    if not all(v == v for v in metrics.values()):  # NaN
        emit(check="hf_train_step", ok=False, error=f"non-finite metrics {metrics}")
        sys.exit(1)
step_s = sum(times[1:]) / len(times[1:])  # the first step also builds AdamW's states
emit(check="hf_train_step", ok=True, sequences=B, tokens=tokens, first_step_s=round(times[0], 3),
     step_s=round(step_s, 3), tokens_per_s=round(tokens / step_s, 1), loss=metrics.get("loss"),
     grad_norm=metrics.get("grad_norm"), peak_memory_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2))

# ---- vLLM generator
if importlib.util.find_spec("vllm") is None:
    emit(check="vllm", ok=None, skipped="vLLM is not installed here (pip install 'complementary-rl[vllm]')")
    sys.exit(0)
try:
    import vllm
except Exception as exc:  # noqa: BLE001 - reported, not fatal for the hf part
    emit(check="vllm", ok=None, skipped=f"vLLM does not import: {type(exc).__name__}: {exc}")
    sys.exit(0)

from crl_train.policy.checkpoint import MODEL_DIR  # noqa: E402
from crl_train.policy.vllm_engine import VLLMGenerator, sampling_params_kwargs  # noqa: E402

# the API we call, as the installed vLLM defines it
engine_fields = set(inspect.signature(vllm.EngineArgs).parameters)
llm_params = set(inspect.signature(vllm.LLM.__init__).parameters)
missing = [k for k in ("worker_extension_cls", "logprobs_mode", "max_model_len", "structured_outputs_config")
           if k not in engine_fields | llm_params]
sp_fields = set(vllm.SamplingParams.__struct_fields__) if hasattr(vllm.SamplingParams, "__struct_fields__") else \
    set(inspect.signature(vllm.SamplingParams).parameters)
missing += [f"SamplingParams.{k}" for k in sampling_params_kwargs(SamplingConfig(stop=("x",), seed=1), 8, [1])
            if k not in sp_fields]
rpc = inspect.signature(vllm.LLM.collective_rpc).parameters
missing += [f"collective_rpc({k})" for k in ("method", "args") if k not in rpc]
emit(check="vllm_api", ok=not missing, vllm=vllm.__version__, missing=missing)

with tempfile.TemporaryDirectory(prefix="crl_gpu_check_") as tmp:
    policy.save(tmp)
    t0 = time.perf_counter()
    gen = VLLMGenerator(str(Path(tmp) / MODEL_DIR), tokenizer, sampling=SamplingConfig(seed=0),
                        gpu_memory_utilization=0.45, max_model_len=2048, enforce_eager=True, dtype="float32")
    start_s = time.perf_counter() - t0
emit(check="vllm_start", ok=True, seconds=round(start_s, 1), logprobs_exact=gen.logprobs_exact)

vprompts = [torch.randint(260, len(tokenizer), (PROMPT,)).tolist() for _ in range(64)]
gen.generate(vprompts[:2], 8)
t0 = time.perf_counter()
outs = gen.generate(vprompts, 256)
v_s = time.perf_counter() - t0
v_tokens = sum(len(o.token_ids) for o in outs)
# the engine's log-probs against the trainer's on the same sequences
check = []
for o in outs[:8]:
    s = TokenSequence()
    s.append_context(o.prompt_ids)
    s.append_generation(o)
    check.append(s)
cb = TrainBatch.from_sequences(check, [0.0] * len(check), policy.pad_token_id)
hf_lp = policy.logprobs(cb)
diffs = (hf_lp - cb.old_logprobs).abs()[cb.loss_mask.bool()]
emit(check="vllm_generate", ok=True, sequences=len(vprompts), new_tokens=v_tokens, seconds=round(v_s, 3),
     tokens_per_s=round(v_tokens / v_s, 1), logprob_abs_diff_mean=round(float(diffs.mean()), 5),
     logprob_abs_diff_max=round(float(diffs.max()), 5))

t0 = time.perf_counter()
policy.attach_generator(gen)  # pushes the weights now
policy.train_step(batch, clip_surrogate_loss, clip_eps=0.2, ratio_level="sequence")  # and again after this update
sync_s = time.perf_counter() - t0
after = gen.generate(vprompts[:8], 32)
emit(check="vllm_sync", ok=gen.syncs >= 2 and all(len(o.token_ids) > 0 for o in after), syncs=gen.syncs,
     update_and_sync_s=round(sync_s, 3))
PYEOF
if "$PY" -c "import vllm, trl" 2>/dev/null; then
  timeout 300 "$PY" examples/trl_grpo.py --steps 2 --vllm | tail -n 1
else
  echo '{"check": "trl_vllm", "ok": true, "skipped": "vllm or trl does not import"}'
fi
VERL_PY="${VERL_PYTHON:-$PY}"
if "$VERL_PY" -c "import vllm, verl.trainer.main_ppo" 2>/dev/null; then
  timeout 600 examples/verl/run_recall.sh "$VERL_PY" 2 | tail -n 1
else
  echo '{"check": "verl_vllm", "ok": true, "skipped": "vllm or verl does not import"}'
fi
