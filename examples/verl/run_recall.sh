#!/usr/bin/env bash
# Complementary RL in verl 0.9.1 on one GPU: verl's v1 trainer (FSDP actor, vLLM rollout server) with
# the crl_agent loop on crl/Recall-v0 and crl-experience serve --extractor tiny.
#
#   examples/verl/run_recall.sh [PYTHON] [STEPS]    PYTHON: an interpreter with verl 0.9.1, vLLM and
#                                                    this project (default python3); STEPS default 2
#
# Starts the service (unless CRL_EXPERIENCE_URL names one), writes the dataset (prepare.py), runs
# `python -m verl.trainer.main_ppo` with the settings below and prints the service's /stats as its
# last line (one JSON object). Everything Complementary RL adds to verl's own config is marked "crl".
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${1:-python3}"
STEPS="${2:-2}"
OUT="${CRL_VERL_OUT:-runs/verl}"
PORT="${CRL_VERL_PORT:-8765}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [[ -z "${CRL_EXPERIENCE_URL:-}" ]]; then
  "$PY" -m crl_gym.cli serve --bank "$OUT/bank" --port "$PORT" --extractor tiny >"$OUT/serve.log" 2>&1 &
  SERVER=$!
  trap 'kill "$SERVER" 2>/dev/null || true' EXIT
  export CRL_EXPERIENCE_URL="http://127.0.0.1:$PORT"
  "$PY" - <<'PYEOF'
import os, time
from crl_gym.clients import RemoteClient
client, deadline = RemoteClient(os.environ["CRL_EXPERIENCE_URL"]), time.monotonic() + 300
while True:
    try:
        if client.health()["status"] == "ok":
            break
    except Exception:
        if time.monotonic() > deadline:
            raise
        time.sleep(1)
PYEOF
fi
read -r TRAIN VAL N MODEL < <("$PY" examples/verl/prepare.py --out "$OUT" --group-size 4 |
  "$PY" -c 'import json, sys; d = json.load(sys.stdin); print(d["train"], d["val"], d["rollout_n"], d["model"])')
sed "s#http://127.0.0.1:8765#$CRL_EXPERIENCE_URL#" examples/verl/agent_loops.yaml >"$OUT/agent_loops.yaml"

"$PY" -m verl.trainer.main_ppo \
  data.train_files="$TRAIN" data.val_files="$VAL" data.train_batch_size=4 \
  data.max_prompt_length=512 data.max_response_length=256 data.shuffle=false \
  actor_rollout_ref.model.path="$MODEL" \
  actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.ppo_mini_batch_size=4 \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 actor_rollout_ref.actor.use_kl_loss=false \
  actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean \
  actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.gpu_memory_utilization=0.4 \
  actor_rollout_ref.rollout.tensor_model_parallel_size=1 actor_rollout_ref.rollout.n="$N" \
  actor_rollout_ref.rollout.prompt_length=512 actor_rollout_ref.rollout.response_length=256 \
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4 \
  actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4 \
  actor_rollout_ref.rollout.agent.num_workers=1 \
  actor_rollout_ref.rollout.agent.agent_loop_config_path="$OUT/agent_loops.yaml" `# crl: the loop` \
  actor_rollout_ref.rollout.agent.default_agent_loop=crl_agent `# crl` \
  algorithm.adv_estimator=crl_split_subgroup algorithm.use_kl_in_reward=false `# crl: the advantages` \
  trainer.use_v1=true trainer.v1.trainer_mode=crl_sync `# crl: end_step once per step` \
  +crl.service_url="$CRL_EXPERIENCE_URL" `# crl` \
  +ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=crl_train.integrations.verl.setup_worker `# crl` \
  trainer.n_gpus_per_node=1 trainer.nnodes=1 trainer.total_training_steps="$STEPS" trainer.total_epochs=100 \
  trainer.val_before_train=false trainer.test_freq="$STEPS" trainer.save_freq=-1 \
  trainer.logger='[console]' trainer.project_name=crl trainer.experiment_name=recall \
  >"$OUT/verl.log" 2>&1 || { tail -n 60 "$OUT/verl.log" >&2; exit 1; }

"$PY" -c 'import json, os; from crl_gym.clients import RemoteClient
s = RemoteClient(os.environ["CRL_EXPERIENCE_URL"]).stats()
print(json.dumps({"check": "verl_vllm", "ok": s["steps_ended"] > 0 and s["distilled"] > 0, **{k: s[k] for k in
      ("submitted", "steps_ended", "held_out_requests", "distilled", "credited", "extractor_updates")}}))'
