#!/usr/bin/env bash
# agentkv bench on one GPU: a prefill and a decode vLLM engine share the GPU (40% of its memory
# each), bench runs each mode's router in front of them and writes results to $OUT.
# Sized for a short run (~10 min on one H100/H200 with an 8B model); see docs/benchmarks.md.
#
#   scripts/gpu_bench.sh                       # defaults below
#   MODEL=Qwen/Qwen3-32B HISTORY=8000,24000 scripts/gpu_bench.sh
#
# Needs: vLLM with CUDA and NIXL (pip install vllm nixl) and agentkv installed in one Python env.
set -euo pipefail

MODEL=${MODEL:-Qwen/Qwen3-8B}
HISTORY=${HISTORY:-2000,8000}      # initial history sweep (tokens)
SESSIONS=${SESSIONS:-10}
TURNS=${TURNS:-10}
REPEATS=${REPEATS:-1}
GPU_SHARE=${GPU_SHARE:-0.40}       # --gpu-memory-utilization per engine
OUT=${OUT:-bench-results/gpu-$(date +%Y%m%d-%H%M%S)}
PYTHON=${PYTHON:-python}
P_PORT=8100 D_PORT=8200 ROUTER_PORT=8000
export AGENTKV_SECRET=${AGENTKV_SECRET:-$(head -c 18 /dev/urandom | base64 | tr '+/' '-_')}
mkdir -p "$OUT"

transfer_config() {  # $1: engine id; the launcher's own --kv-transfer-config (bundle/launcher.py)
  "$PYTHON" -c 'import json, sys
from agentkv_server.bundle.launcher import AGENTKV_CONNECTOR
print(json.dumps(AGENTKV_CONNECTOR.transfer_config(sys.argv[1])))' "$1"
}

# P without prefix caching (one P shared by many sessions keeps little of them; it is also how
# vLLM measured bidirectional transfer); D keeps it: it is the aggregated mode's engine too.
start_engine() {  # $1: role, $2: port, $3: NIXL side-channel port, $4: role's own flag
  VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1 VLLM_NIXL_SIDE_CHANNEL_PORT=$3 \
  AGENTKV_ROUTER_URL=http://127.0.0.1:$ROUTER_PORT \
    setsid "$PYTHON" -m vllm.entrypoints.openai.api_server --model "$MODEL" \
      --host 127.0.0.1 --port "$2" --gpu-memory-utilization "$GPU_SHARE" \
      --max-model-len 32768 --enable-prompt-tokens-details "$4" \
      --kv-transfer-config "$(transfer_config "$1-$2")" >"$OUT/$1.log" 2>&1 &
  echo $!
}

P_PID=$(start_engine prefill $P_PORT 5600 --no-enable-prefix-caching)
D_PID=$(start_engine decode $D_PORT 5700 --enable-prefix-caching)
trap 'kill -- -$P_PID -$D_PID 2>/dev/null || true' EXIT

for port in $P_PORT $D_PORT; do
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
    sleep 1
  done
  curl -sf "http://127.0.0.1:$port/health" >/dev/null || { tail -50 "$OUT"/*.log; exit 1; }
done

agentkv bench --preset vllm --sessions "$SESSIONS" --turns "$TURNS" --history-tokens "$HISTORY" \
  --repeats "$REPEATS" --model "$MODEL" --tokenizer "$("$PYTHON" - "$MODEL" <<'PY'
import sys
from huggingface_hub import snapshot_download
print(snapshot_download(sys.argv[1], allow_patterns=["tokenizer.json"]))
PY
)" \
  --prefill-url http://127.0.0.1:$P_PORT --decode-url http://127.0.0.1:$D_PORT \
  --router-port $ROUTER_PORT --secret "$AGENTKV_SECRET" --out "$OUT"
