#!/usr/bin/env bash
# GPU check for the vLLM backend (one GPU, run from the repository root, about 3-5 minutes).
#
#   bash bench/gpu_check.sh            # figures to $OUT/gpu_check.json when $OUT is set
#
# Needs the project installed with its gpu and test extras (`pip install -e '.[gpu,test]'`, e.g.
# from a local wheel cache); it installs nothing. Steps, each bounded by `timeout`:
#   1. `import vllm` (stops here, saying so, when it is missing);
#   2. build and save the tiny Qwen3-VL to /tmp/tiny;
#   3. start `vllm serve /tmp/tiny` on 127.0.0.1 with VLLM_SERVER_DEV_MODE=1 (VLLMPolicy.refresh
#      uses the dev-mode routes /collective_rpc, /reset_prefix_cache, /reset_encoder_cache) and wait
#      for /health;
#   4. tests/test_local_policy.py -k vllm_live against it;
#   5. save perturbed weights to /tmp/tiny_v1, time VLLMPolicy.refresh to them, check generation
#      works after and that the weights changed; reload the originals without cache resets, then
#      with, to see whether stale KV/encoder caches are visible and the reload is exact;
#   6. the trainer's entry point (`torchrun ... -m trainer.train --help`), which may not exist yet.
# The server is killed by its PID (its process group) on every exit path.
# Environment: PY (python, default .venv/bin/python), PORT (default: a free one),
# VLLM_EXTRA_ARGS (default below), HEALTH_TIMEOUT_S (default 300).
set -euo pipefail

PY=${PY:-.venv/bin/python}
[[ -x $PY ]] || PY=$(command -v python3 || command -v python)
WORK=$(mktemp -d /tmp/gpu_check.XXXXXX)
NOTES=$WORK/notes.tsv
SERVER_LOG=$WORK/vllm_server.log
SERVER_PID=""
STEP="start"
: >"$NOTES"
T_START=$(date +%s)
VLLM_EXTRA_ARGS=${VLLM_EXTRA_ARGS:---dtype bfloat16 --enforce-eager --gpu-memory-utilization 0.5 --max-model-len 8192}
HEALTH_TIMEOUT_S=${HEALTH_TIMEOUT_S:-300}

note() { printf '%s\t%s\n' "$1" "$2" >>"$NOTES"; }  # key, value (JSON if it parses, else a string)
now_ns() { date +%s%N; }
since() { local ns=$(($(now_ns) - $1)); printf '%d.%03d' $((ns / 1000000000)) $(((ns / 1000000) % 1000)); }
healthy() {  # curl if there is one, else python
  if command -v curl >/dev/null; then curl -sf -m 5 "$1/health" >/dev/null 2>&1
  else "$PY" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + "/health", timeout=5)' "$1" 2>/dev/null
  fi
}
log() { printf '[gpu_check %3ss] %s\n' "$(($(date +%s) - T_START))" "$*"; }

stop_server() {
  [[ -n $SERVER_PID ]] || return 0
  if kill -0 "$SERVER_PID" 2>/dev/null; then
    log "stopping vLLM server (pid $SERVER_PID)"
    kill -TERM "$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 30); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
  fi
  # Its engine-core and worker children share the process group setsid gave it (pgid = its pid).
  kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
  wait "$SERVER_PID" 2>/dev/null || true
  SERVER_PID=""
}

finish() {
  local rc=$?
  stop_server
  note exit_code "$rc"
  note failed_step "$([[ $rc == 0 ]] && echo null || echo "\"$STEP\"")"
  note total_s "$(($(date +%s) - T_START))"
  "$PY" - "$NOTES" "$WORK" <<'EOF' || true
import glob, json, os, sys
notes, work = sys.argv[1], sys.argv[2]
out = {}
for path in sorted(glob.glob(os.path.join(work, "part_*.json"))):
    out.update(json.load(open(path)))
for line in open(notes):
    key, _, value = line.rstrip("\n").partition("\t")
    try:
        out[key] = json.loads(value)
    except ValueError:
        out[key] = value
text = json.dumps(out, indent=2, sort_keys=True)
print(text)
if os.environ.get("OUT"):
    os.makedirs(os.environ["OUT"], exist_ok=True)
    open(os.path.join(os.environ["OUT"], "gpu_check.json"), "w").write(text + "\n")
EOF
  if [[ -n ${OUT:-} && -f $SERVER_LOG ]]; then tail -n 400 "$SERVER_LOG" >"$OUT/vllm_server.log" || true; fi
  log "done (exit $rc${STEP:+, last step: $STEP})"
}
trap finish EXIT
trap 'exit 130' INT TERM

trainer_hook() {
  STEP="trainer_entry_point"
  log "trainer entry point"
  local torchrun=(torchrun)
  [[ -x $(dirname "$PY")/torchrun ]] && torchrun=("$(dirname "$PY")/torchrun")
  command -v "${torchrun[0]}" >/dev/null || torchrun=("$PY" -m torch.distributed.run)
  if timeout 120 "${torchrun[@]}" --nproc_per_node 1 -m trainer.train --help >"$WORK/trainer_help.txt" 2>&1; then
    note trainer_entry_point '"ok"'
  else
    echo "trainer entry point missing"
    tail -n 5 "$WORK/trainer_help.txt" || true
    note trainer_entry_point '"missing"'
  fi
}

# --- 1. vLLM importable? ---------------------------------------------------------------------
STEP="import_vllm"
log "python: $PY"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -n 1 \
  | { read -r gpu && note gpu "\"$gpu\""; } || note gpu '"nvidia-smi unavailable"'
if ! VLLM_VERSION=$(timeout 180 "$PY" -c "import vllm; print(vllm.__version__)" 2>"$WORK/import_vllm.err"); then
  echo "vLLM IS MISSING: '$PY -c \"import vllm\"' failed; install the gpu extra (pip install -e '.[gpu,test]')." >&2
  tail -n 5 "$WORK/import_vllm.err" >&2 || true
  note vllm_version '"missing"'
  trainer_hook || true
  STEP="import_vllm"
  exit 3
fi
VLLM_VERSION=$(tail -n 1 <<<"$VLLM_VERSION")
note vllm_version "\"$VLLM_VERSION\""
log "vllm $VLLM_VERSION"

# --- 2. the tiny model -----------------------------------------------------------------------
STEP="build_tiny_model"
t0=$(now_ns)
timeout 300 "$PY" -c "from rollout.policy.tiny_vlm import ensure_tiny_vlm; print(ensure_tiny_vlm('/tmp/tiny'))"
note build_tiny_s "$(since "$t0")"

# --- 3. the server ---------------------------------------------------------------------------
STEP="start_server"
PORT=${PORT:-$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
URL=http://127.0.0.1:$PORT
VLLM_BIN=$(dirname "$PY")/vllm
[[ -x $VLLM_BIN ]] || VLLM_BIN=vllm
log "starting vLLM on $URL (log: $SERVER_LOG)"
t0=$(now_ns)
# setsid: the server leads a process group of its own (pgid = its pid), so stop_server reaches its
# engine-core and worker children too.
# shellcheck disable=SC2086  # VLLM_EXTRA_ARGS is a list of flags
VLLM_SERVER_DEV_MODE=1 setsid "$VLLM_BIN" serve /tmp/tiny --host 127.0.0.1 --port "$PORT" \
  --served-model-name policy --chat-template-content-format openai --logprobs-mode processed_logprobs \
  $VLLM_EXTRA_ARGS >"$SERVER_LOG" 2>&1 &
SERVER_PID=$!
note server_args "\"--served-model-name policy --chat-template-content-format openai --logprobs-mode processed_logprobs $VLLM_EXTRA_ARGS\""
deadline=$(($(date +%s) + HEALTH_TIMEOUT_S))
until healthy "$URL"; do
  if ! kill -0 "$SERVER_PID" 2>/dev/null; then
    echo "vLLM server exited before /health answered; last lines of its log:" >&2
    tail -n 60 "$SERVER_LOG" >&2
    exit 1
  fi
  if (($(date +%s) > deadline)); then
    echo "vLLM server not healthy after ${HEALTH_TIMEOUT_S}s; last lines of its log:" >&2
    tail -n 60 "$SERVER_LOG" >&2
    exit 1
  fi
  sleep 2
done
note server_start_s "$(since "$t0")"
log "server healthy"

# --- 4. the live test ------------------------------------------------------------------------
STEP="pytest_vllm_live"
t0=$(now_ns)
AWRL_VLLM_URL=$URL AWRL_VLLM_MODEL=policy timeout 300 "$PY" -m pytest -q -p no:cacheprovider \
  tests/test_local_policy.py -k vllm_live -rs 2>&1 | tee "$WORK/pytest.txt"
grep -q "1 passed" "$WORK/pytest.txt" || { echo "the live test did not run and pass" >&2; exit 1; }
note pytest_vllm_live '"passed"'
note pytest_vllm_live_s "$(since "$t0")"

# --- 5. refresh --------------------------------------------------------------------------------
STEP="refresh"
log "refresh to perturbed weights"
AWRL_VLLM_URL=$URL timeout 300 "$PY" - "$WORK/part_refresh.json" <<'EOF'
"""Time VLLMPolicy.refresh against the live server and check what it changes."""
import asyncio
import importlib.util
import json
import os
import sys
import time

import torch

from rollout.policy.tiny_vlm import load_tiny_vlm, save_tiny_vlm
from rollout.policy.vllm_client import CACHE_RESET_PATHS, VLLMPolicy

spec = importlib.util.spec_from_file_location("test_local_policy", "tests/test_local_policy.py")
tests = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tests)  # for its `_obs()`: a page screenshot with marks and history

url, out_path = os.environ["AWRL_VLLM_URL"], sys.argv[1]
fig = {}


def save():
    with open(out_path, "w") as f:
        json.dump(fig, f)


t0 = time.perf_counter()
model, tokenizer, _ = load_tiny_vlm("/tmp/tiny")
torch.manual_seed(1)
with torch.no_grad():
    for p in model.parameters():
        p.add_(torch.randn_like(p) * (0.5 * p.std() if p.numel() > 1 else 0.05))
save_tiny_vlm(model, tokenizer, "/tmp/tiny_v1")
fig["save_perturbed_s"] = time.perf_counter() - t0

obs = tests._obs()


def sample() -> list[float]:
    """Same prompt, same seed: the sampled tokens' log-probs change only if the weights did."""
    pol = VLLMPolicy(url, "policy", max_tokens=16, seed=1234)
    t = time.perf_counter()
    out = asyncio.run(pol.act(obs))
    assert out.response_token_ids and len(out.logprobs) == len(out.response_token_ids), out
    fig.setdefault("act_s", []).append(round(time.perf_counter() - t, 4))
    return out.logprobs


def max_diff(a, b):
    n = min(len(a), len(b))
    return max(abs(x - y) for x, y in zip(a[:n], b[:n])) if n else None


before = sample()
sample()  # the same prompt again: now prefix- and encoder-cached
pol = VLLMPolicy(url, "policy")
asyncio.run(pol.refresh(1, "/tmp/tiny_v1"))
fig["refresh_s"] = pol.last_refresh_s
fig["refresh_timings"] = pol.last_refresh_timings
after = sample()  # generation works after the refresh...
fig["v1_vs_v0_first_logprob_diff"] = abs(after[0] - before[0])
assert after[0] != before[0], "refresh did not change the served weights"  # ...and the weights changed
save()

# Back to the original weights, first without the cache resets: does vLLM serve stale caches?
plain = VLLMPolicy(url, "policy", cache_reset_paths=())
asyncio.run(plain.refresh(2, "file:///tmp/tiny"))
fig["reload_only_s"] = plain.last_refresh_s
no_reset = sample()
t = time.perf_counter()
for route in CACHE_RESET_PATHS:
    plain._post(route, {})
fig["cache_resets_s"] = time.perf_counter() - t
with_reset = sample()
fig["stale_cache_max_logprob_diff"] = max_diff(no_reset, with_reset)
fig["stale_cache_visible"] = no_reset != with_reset
fig["revert_vs_original_max_logprob_diff"] = max_diff(with_reset, before)
fig["revert_exact_within_1e-2"] = fig["revert_vs_original_max_logprob_diff"] is not None and \
    fig["revert_vs_original_max_logprob_diff"] < 1e-2
# Timing over a few more refreshes (alternating checkpoints), the figure the pool pays per version.
times = []
for i, path in enumerate(["/tmp/tiny_v1", "/tmp/tiny"] * 2):
    asyncio.run(pol.refresh(10 + i, path))
    times.append(round(pol.last_refresh_s, 4))
fig["refresh_s_repeats"] = times
sample()
save()
print(json.dumps(fig, indent=2))
EOF
note refresh '"ok"'

STEP="after_refresh"
stop_server
trainer_hook
STEP=""
