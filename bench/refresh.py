"""Weight refresh benchmark: how long a new policy version takes from the trainer to a live LocalPolicy.

    .venv/bin/python bench/refresh.py [--reps 10]

For the tiny VLM, side by side in one run against one freshly started stack, each repetition a new
version (weights perturbed, so every upload and download moves real bytes):
  save        save_policy: save_pretrained + tokenizer + image processor into a local directory
  upload      CheckpointStore.upload: every file, then MANIFEST.json (publish)
  download    CheckpointStore.download into an empty cache: GETs + sha256 verify + atomic rename
  cache hit   CheckpointStore.download again: only the manifest GET
  load path   LocalPolicy.load_weights from the local directory (from_pretrained + load_state_dict)
  load s3     LocalPolicy.load_weights from the s3:// URI, cold cache (download + load)
  end to end  save + upload + load s3, timed as one block (publish + fetch + load)
  to action, store  end to end, then the first action sampled with the new version
  push        `model.push.WeightSender.push`: the weights straight to the policy's receiver (gloo, 127.0.0.1)
  load push   LocalPolicy.load_weights of that version and digest: from memory
  to action, push   push + load push + the first action, timed as one block
The two "to action" rows are the publish-to-first-action latency of the two paths (the trainer
pushes beside the upload, so with a push the upload is off the sampler's path).
One untimed warm-up version goes first: on a fresh radosgw the first object write creates the data
pool and the first multipart upload the non-EC pool (~2 s each), which says nothing about steady state.
Prints a table and a markdown copy; writes bench/out/refresh.json.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import socket
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import torch
import typer
from PIL import Image
from rich.console import Console
from rich.table import Table
from transformers.utils import logging as hf_logging

from model.hf_io import ensure_policy, load_policy, save_policy, stored_weights
from model.push import WeightSender
from pipeline.checkpoints import CheckpointStore
from pipeline.hashing import weights_sha256
from pipeline.markdown import markdown_table
from pipeline.stack.local import LocalStack
from rollout.policy.local import LocalPolicy
from schemas.observation import Observation

console = Console()
STAGES = [
    "save",
    "upload",
    "download",
    "cache hit",
    "load path",
    "load s3",
    "end to end",
    "to action, store",
    "push",
    "load push",
    "to action, push",
]


def _timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def _observation() -> Observation:
    buf = io.BytesIO()
    Image.new("RGB", (1280, 720), "white").save(buf, format="PNG")
    return Observation(
        instruction="Click the red box.",
        screenshots=[buf.getvalue()],
        screenshot_sha256=["0" * 64],
        url="http://127.0.0.1/",
        feedback="",
        history=[],
        memory={},
        marks=[],
        som=False,
        step=0,
        horizon=5,
    )


def run(settings, work: Path, reps: int) -> dict:
    base = ensure_policy()
    model, tokenizer, _ = load_policy(base)
    run_id = f"bench-{uuid.uuid4().hex[:6]}"
    publisher = CheckpointStore.from_settings(settings, cache_dir=work / "unused")
    fetcher = CheckpointStore.from_settings(settings, cache_dir=work / "fetcher")
    policy_store = CheckpointStore.from_settings(settings, cache_dir=work / "policy")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
    sender = WeightSender(address)
    policy = LocalPolicy(base, max_new_tokens=4, checkpoints=policy_store, push_address=address)

    def act(version: int) -> None:
        out = asyncio.run(policy.act(_observation()))
        assert set(out.token_policy_versions) == {version}

    times: dict[str, list[float]] = {s: [] for s in STAGES}
    cold: dict[str, float] = {}
    for version in range(reps + 1):
        with torch.no_grad():
            model.lm_head.weight.add_(0.001)
        t0 = time.perf_counter()
        local, t_save = _timed(save_policy, model, tokenizer, work / "out" / f"v{version}")
        uri, t_upload = _timed(publisher.upload, local, run_id, version)
        _, t_load_s3 = _timed(policy.load_weights, version, uri)
        t_e2e = time.perf_counter() - t0
        act(version)
        t_action_store = time.perf_counter() - t0
        pushed = 1000 + version  # its own version number: not loaded yet
        with torch.no_grad():
            model.lm_head.weight.add_(0.001)
        weights = stored_weights(model, model.state_dict())
        sha = weights_sha256(weights)  # the trainer has it already (it names the version); not timed
        t1 = time.perf_counter()
        _, t_push = _timed(sender.push, pushed, sha, weights)
        while policy._push.received < version + 1:  # the receive ends with the broadcast; its bookkeeping just after
            time.sleep(0.0005)
        _, t_load_push = _timed(policy.load_weights, pushed, "s3://not-used/v", sha)
        assert policy.delivered[pushed] == "push"
        act(pushed)
        t_action_push = time.perf_counter() - t1
        _, t_download = _timed(fetcher.download, uri)
        _, t_hit = _timed(fetcher.download, uri)
        _, t_load_path = _timed(policy.load_weights, version, str(local))
        row = dict(
            zip(
                STAGES,
                [
                    t_save,
                    t_upload,
                    t_download,
                    t_hit,
                    t_load_path,
                    t_load_s3,
                    t_e2e,
                    t_action_store,
                    t_push,
                    t_load_push,
                    t_action_push,
                ],
            )
        )
        if version == 0:
            cold = row  # warm-up: pool creation on a fresh radosgw
            continue
        for k, v in row.items():
            times[k].append(v)
    policy.close()
    size = sum(p.stat().st_size for p in (work / "out" / "v0").iterdir())
    return {"reps": reps, "checkpoint_bytes": size, "cold": cold, "times": times}


def main(reps: int = 10) -> None:
    with tempfile.TemporaryDirectory() as d:
        stack = LocalStack.up(Path(d) / "stack", durable=False)
        try:
            with console.status(f"refresh x{reps + 1} ..."):
                results = run(stack.settings(), Path(d) / "work", reps)
        finally:
            stack.down()
    mb = results["checkpoint_bytes"] / 1e6
    title = f"tiny VLM weight refresh ({mb:.1f} MB directory), {reps} versions after 1 warm-up"
    table = Table(title=title)
    for col in ("stage", "median s", "min s", "max s", "MB/s (median)", "warm-up s"):
        table.add_column(col, justify="right" if col != "stage" else "left")
    rows = []
    for stage in STAGES:
        ts = results["times"][stage]
        med = statistics.median(ts)
        rate = f"{mb / med:,.0f}" if stage in ("upload", "download") else ""
        row = [stage, f"{med:.3f}", f"{min(ts):.3f}", f"{max(ts):.3f}", rate, f"{results['cold'][stage]:.3f}"]
        rows.append(row)
        table.add_row(*row)
    console.print(table)
    header = ["stage", "median s", "min s", "max s", "MB/s (median)", "warm-up s"]
    console.print(f"\n{title}\n\n" + "\n".join(markdown_table(header, rows)), markup=False, highlight=False)
    out = Path(__file__).parent / "out"
    out.mkdir(exist_ok=True)
    (out / "refresh.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    hf_logging.disable_progress_bar()
    typer.run(main)
