"""On a GPU: a new version into a running vLLM server, through the object store (save the HF
directory, `reload_weights` from it: the CPU path's refresh) vs pushed over NCCL with vLLM's own
weight-transfer API (`/init_weight_transfer_engine`, `/update_weights`; the trainer side is vLLM's
`NCCLTrainerWeightTransferEngine` over the live module), and the first action after each.

    python bench/vllm_push.py --model-dir DIR [--reps 3]      # bench/gpu_check.sh runs it

DIR: an HF Qwen3-VL directory (gpu_check.sh builds Qwen3-VL-2B's architecture at full width). The
server runs on the same GPU with a third of its memory; the "trainer" is this process's copy of the
model in bf16 on that GPU, perturbed before each version so every transfer moves new weights.
Prepared, not run: no GPU was lent while it was written. Writes $OUT/vllm_push.json when OUT is set.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests
import torch
import typer


def _serve(model_dir: Path, port: int, log: Path) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        "policy",
        "--port",
        str(port),
        "--enforce-eager",
        "--gpu-memory-utilization",
        "0.3",
        "--weight-transfer-config",
        json.dumps({"backend": "nccl"}),
    ]
    proc = subprocess.Popen(
        cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    )
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).ok:
                return proc
        except requests.RequestException:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"the vLLM server exited; see {log}")
        time.sleep(2)
    proc.kill()
    raise RuntimeError(f"the vLLM server did not start in 600 s; see {log}")


def _first_action(url: str) -> float:
    t0 = time.perf_counter()
    r = requests.post(
        f"{url}/v1/completions",
        json={"model": "policy", "prompt": "click", "max_tokens": 8, "temperature": 0},
        timeout=120,
    )
    r.raise_for_status()
    return time.perf_counter() - t0


def main(model_dir: Path = typer.Option(...), reps: int = 3, port: int = 8011, nccl_port: int = 29611) -> None:
    from transformers import Qwen3VLForConditionalGeneration
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine

    from model.hf_io import load_policy, save_policy
    from rollout.policy.vllm_client import reload_weights_body

    url = f"http://127.0.0.1:{port}"
    work = Path(tempfile.mkdtemp(prefix="vllm-push-"))
    server = _serve(model_dir, port, work / "vllm.log")
    try:
        model = Qwen3VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
        _, tokenizer, image_processor = load_policy(model_dir)
        engine = NCCLTrainerWeightTransferEngine.trainer_init(
            NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=nccl_port, world_size=2, rank=0),
            client=HTTPVLLMWeightSyncClient(url),
            source=ModuleSource(model),
        )
        rows = {"store": [], "push": []}
        for rep in range(reps + 1):  # the first of each path is a warm-up
            for path in ("store", "push"):
                with torch.no_grad():
                    next(model.parameters()).add_(1e-3)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                if path == "store":
                    directory = save_policy(model, tokenizer, work / f"v{rep}", image_processor=image_processor)
                    requests.post(
                        f"{url}/collective_rpc", json=reload_weights_body(str(directory)), timeout=600
                    ).raise_for_status()
                else:
                    engine.send_weights()
                loaded = time.perf_counter() - t0
                action = _first_action(url)
                if rep:
                    rows[path].append({"loaded_s": loaded, "to_action_s": loaded + action})
        params = sum(p.numel() for p in model.parameters())
        result = {"params": params, "gpu": torch.cuda.get_device_name(), "rows": rows}
        for path, rs in rows.items():
            print(
                f"{path}: loaded {statistics.median(r['loaded_s'] for r in rs):.3f} s, first action "
                f"{statistics.median(r['to_action_s'] for r in rs):.3f} s "
                f"(median of {reps}, {params / 1e9:.2f}B bf16)"
            )
        push, store = (statistics.median(r["to_action_s"] for r in rows[p]) for p in ("push", "store"))
        print(f"publish to first action, push / store: {push / store:.2f}x")
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], "vllm_push.json").write_text(json.dumps(result))
    finally:
        server.terminate()
        server.wait(timeout=60)


if __name__ == "__main__":
    typer.run(main)
