#!/usr/bin/env bash
# What needs a GPU, on one GPU node (run from the repository root; about 10 minutes on a warm machine):
# the vLLM backend's live tests against the official `vllm` package, and the FSDP2 trainer over NCCL
# with bf16 parameters and fp32 reduction, one rank per GPU (tests/test_fsdp_gpu.py: its update
# against the fp32 CPU update of the same batch, and each rank's shard and peak allocator bytes).
#
#   bash bench/gpu_check.sh          # results to $OUT (pytest log, JUnit XML, server log) when set
#
# The same code path as `make test` on a CPU machine: tests/test_vllm_live.py starts the local stack
# with `awrl stack up --vllm`'s server (pipeline/stack/vllm.py), here from the project's own venv
# with the gpu extra (vllm==0.33.0), and runs every live test against it: an action with token ids
# and log-probs, log-prob parity with the trainer's scoring, refreshes with repeated images, the
# mid-episode refresh from an S3 checkpoint, a failed refresh, `awrl run --policy vllm`, and `down`.
# The server runs float32 there too, so the parity bound of the CPU build applies as it is; a
# bf16 server's gap is another measurement (bench/vllm_backend.py with AWRL_VLLM_EXTRA_ARGS).
#
# tests/test_fsdp_gpu.py also runs `awrl train` for one bf16 update of Qwen3-VL-2B's architecture at full
# width on every GPU, printing each rank's memory. Then bench/vllm_push.py: a new version into the
# running vLLM server through the store (`reload_weights`) vs pushed over NCCL with vLLM's
# weight-transfer API, and the first action after each (prepared, not yet run on a GPU).
#
# Then, with AWRL_JUDGE_MODEL_DIR, a real VLM judge against the rule judge (see below); and where a
# Docker engine runs, the image and the compose file for real (see the end).
#
# Environment: PY (default .venv/bin/python), AWRL_VLLM_EXTRA_ARGS (default below: no CUDA graphs,
# a third of the GPU, which a 5M-parameter model does not need more of), DOCKER_CHECK=0 to skip the
# Docker check.
set -euo pipefail

PY=${PY:-.venv/bin/python}
OUT=${OUT:-$(mktemp -d /tmp/gpu_check.XXXXXX)}
mkdir -p "$OUT"
export AWRL_VLLM_PYTHON=$PY
export AWRL_VLLM_EXTRA_ARGS=${AWRL_VLLM_EXTRA_ARGS:---enforce-eager --gpu-memory-utilization 0.3}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
if ! "$PY" -c "import vllm; print('vllm', vllm.__version__)" | tee "$OUT/vllm_version.txt"; then
  echo "vLLM is missing from $PY: install the gpu extra first (pip install -e '.[gpu,test]')" >&2
  exit 3
fi
make system  # Chromium and Ceph for the stack the tests start
set +e
timeout 1500 "$PY" -m pytest -q -s -p no:cacheprovider --junitxml="$OUT/junit.xml" tests/test_fsdp_gpu.py \
  tests/test_vllm_live.py \
  2>&1 | tee "$OUT/pytest.txt"
rc=${PIPESTATUS[0]}
work=$(mktemp -d /tmp/gpu_check_model.XXXXXX)  # a 2B directory is too big to return in $OUT
"$PY" -c "import sys; from model.architectures import make_policy; from model.hf_io import save_policy; \
save_policy(*make_policy('qwen3-vl-2b', seed=3), sys.argv[1])" "$work/qwen3-vl-2b" &&
  OUT=$OUT timeout 900 "$PY" bench/vllm_push.py --model-dir "$work/qwen3-vl-2b" 2>&1 | tail -n 40 | tee "$OUT/vllm_push.txt"
push_rc=${PIPESTATUS[0]}
rm -rf "$work"
[ "$rc" -ne 0 ] || rc=$push_rc
set -e
# the server's log, from the stack directory the test used
find /tmp/pytest-of-"$(id -un)" -path '*vllm-stack*/log/vllm.log' -newer "$OUT/gpu.txt" -exec tail -n 300 {} \; \
  >"$OUT/vllm_server.log" 2>/dev/null || true

# A real VLM judge (issue: a model judge for open tasks), where the node holds a judge checkpoint
# (AWRL_JUDGE_MODEL_DIR: an HF vision-language directory vLLM serves): serve it beside the stack, record
# a boxes run that the rule judges (the demo policy: oracle clicks with half of them random), judge it
# again with the VLM (`awrl rejudge`: instruction, history, the last 3 screenshots) and write its
# agreement with the rule and its latency. Prepared, not run: no GPU was lent and no judge checkpoint
# can be had where this was written.
judge_rc=0
if [ -n "${AWRL_JUDGE_MODEL_DIR:-}" ]; then
  set +e
  "$PY" -m vllm.entrypoints.openai.api_server --model "$AWRL_JUDGE_MODEL_DIR" --served-model-name judge \
    --port 8011 --gpu-memory-utilization 0.5 >"$OUT/judge_server.log" 2>&1 &
  judge_pid=$!
  for _ in $(seq 900); do curl -sf http://127.0.0.1:8011/health >/dev/null && break; sleep 1; done
  run="judged-$(date +%s)"
  {
    "$PY" -m app.cli stack up &&
    "$PY" -m app.cli rollout --suite boxes --policy demo --noise 0.5 --episodes 64 --run-id "$run" \
      --templates red blue colour --episode.som &&
    "$PY" -m app.cli ledger sync &&
    "$PY" -m app.cli rejudge "$run" --url http://127.0.0.1:8011 --model judge --name vlm &&
    "$PY" -m app.cli agreement vlm rule --run "$run" &&
    "$PY" -m app.cli sql "SELECT avg(latency_s), quantile_cont(latency_s, 0.95) FROM verdicts WHERE judge = 'vlm'"
  } 2>&1 | tee "$OUT/judge.txt"
  judge_rc=${PIPESTATUS[0]}
  kill "$judge_pid"
  "$PY" -m app.cli stack down
  set -e
fi
[ "$rc" -ne 0 ] || rc=$judge_rc

# Docker: tests/test_compose.py checks the build context, its install and the compose model without
# an engine; where one runs (`docker info` succeeds), build the real images as compose names them
# (the app and dagster targets, CUDA torch unless the env file says AWRL_TORCH_BUILD=cpu; the build
# needs the network for the base image, apt and PyPI), validate the GPU profile, and import the CLI
# inside the image with the GPUs attached (which also proves the NVIDIA container toolkit works).
# The env file is .env where there is one, else .env.example (compose requires its variables).
# Log in $OUT/docker.txt; a failure there fails the check as pytest's does.
docker_rc=0
if [ "${DOCKER_CHECK:-1}" = 0 ]; then
  echo "docker: DOCKER_CHECK=0, compose checks skipped" | tee "$OUT/docker.txt"
elif command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
  envf=.env
  [ -f "$envf" ] || envf=.env.example
  tag=$(sed -n 's/^AWRL_IMAGE_TAG=//p' "$envf" | tail -n 1)
  probe='import app.cli, model, torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())'
  set +e
  {
    echo "env file: $envf" &&
    timeout 2400 docker compose --env-file "$envf" --profile app --profile dagster build &&
    docker compose --env-file "$envf" --profile app config --quiet &&
    echo "compose --profile app config: ok" &&
    docker run --rm --gpus all "asyncwebrl:${tag:-dev}" python -c "$probe"
  } 2>&1 | tee "$OUT/docker.txt"
  docker_rc=${PIPESTATUS[0]}
  set -e
  echo "docker: exit $docker_rc" | tee -a "$OUT/docker.txt"
else
  echo "docker: no engine here, compose checks skipped" | tee "$OUT/docker.txt"
fi

echo "gpu_check: pytest exit $rc, docker exit $docker_rc; results in $OUT"
if [ "$rc" -eq 0 ]; then
  rc=$docker_rc
fi
exit "$rc"
