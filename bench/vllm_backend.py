"""The vLLM backend next to the local one, side by side in one run (issue: a real vLLM engine).

    .venv/bin/python bench/vllm_backend.py [--episodes 16] [--workers 4] [--rounds 2] [--refreshes 4]

One fresh ephemeral stack with the policy server (`LocalStack.up(vllm=...)`, the tiny VLM), then:
1. server startup: seconds until `/health` answers, and the resident memory of its process group
   (API server + engine core);
2. rollout steps/s: our sites' Easy train tasks, the same workers and episodes, the local backend
   (the tiny VLM in this process) and the vLLM backend (all workers share the server), alternated
   `rounds` times;
3. refresh latency, publish -> first response of the new version: a pool runs, a version (a new S3
   checkpoint each time) is published, and the time to the first action sampled under it is taken,
   `refreshes` times per backend;
4. the sampler-vs-trainer log-prob gap per token, over every step the vLLM rollouts recorded
   (their screenshots from S3, the trainer's scoring of the same tokens).
Prints a table and writes bench/out/vllm_backend.json.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import psutil
import torch
import typer
from rich.console import Console

console = Console()
OUT = Path(__file__).parent / "out"


def main(episodes: int = 16, workers: int = 4, rounds: int = 2, refreshes: int = 4) -> None:
    from model.hf_io import ensure_policy
    from pipeline.stack.local import LocalStack
    from pipeline.stack.vllm import VLLMServerConfig

    results: dict = {}
    with tempfile.TemporaryDirectory() as d:
        v0 = ensure_policy(Path(d) / "v0")
        t0 = time.monotonic()
        with console.status("starting the stack and vLLM ..."):
            stack = LocalStack.up(Path(d) / "stack", durable=False, vllm=VLLMServerConfig(model_dir=v0))
        try:
            results["startup"] = {"stack_with_vllm_s": time.monotonic() - t0, **_server_memory(stack)}
            console.print(f"startup: {results['startup']}")
            settings = stack.settings()
            results["rollout"], vllm_runs = _rollouts(settings, v0, episodes, workers, rounds)
            results["refresh"] = {b: _refresh_latency(settings, b, v0, Path(d), refreshes) for b in ("local", "vllm")}
            results["logprob_gap"] = _logprob_gap(settings, vllm_runs)
        finally:
            stack.down()
    _report(results)


def _server_memory(stack) -> dict:
    (server,) = [s for s in stack.services if s.name == "vllm"]
    procs = [psutil.Process(server.pid), *psutil.Process(server.pid).children(recursive=True)]
    return {"server_processes": len(procs), "server_rss_gib": sum(p.memory_info().rss for p in procs) / 2**30}


def _rollouts(settings, model_dir: Path, episodes: int, workers: int, rounds: int):
    from rollout.episode import EpisodeConfig
    from rollout.run import RolloutRequest, run_rollout

    out: dict[str, list[dict]] = {"local": [], "vllm": []}
    vllm_runs = []
    for r in range(rounds):
        for backend in ("local", "vllm"):
            run_id = f"bench-{backend}-{uuid.uuid4().hex[:6]}"
            request = RolloutRequest(
                suite="sites",
                policy=backend,
                workers=workers,
                group_size=2,
                episodes=episodes,
                difficulty="easy",
                model_dir=model_dir,
                run_id=run_id,
                seed=r,
                episode=EpisodeConfig(som=True),
                journal_dir=None,
            )
            with console.status(f"round {r + 1}: {backend} backend, {episodes} episodes ..."):
                stats = run_rollout(settings, request, show_progress=False)
            out[backend].append({"steps": stats.steps, "episodes": stats.episodes, "steps_per_s": stats.steps_per_s})
            console.print(f"round {r + 1} {backend}: {stats.steps} steps, {stats.steps_per_s:.2f} steps/s")
            if backend == "vllm":
                vllm_runs.append(run_id)
    return out, vllm_runs


def _refresh_latency(settings, backend: str, v0: Path, work: Path, n: int) -> list[float]:
    """Seconds from each publish to the first action sampled under the new version."""
    from model.hf_io import load_policy, save_policy
    from pipeline.bus import EventProducer
    from pipeline.checkpoints import CheckpointStore
    from rollout.dispatcher import dispatch, task_stream
    from rollout.episode import EpisodeConfig
    from rollout.pool import PoolConfig, RolloutPool
    from rollout.run import make_policy, make_suite
    from schemas import PolicyVersionPublished

    model, tokenizer, processor = load_policy(v0)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.01)
    v1 = save_policy(model, tokenizer, work / "v1", image_processor=processor)
    run_id = f"refresh-{backend}-{uuid.uuid4().hex[:6]}"
    checkpoints = CheckpointStore.from_settings(settings, cache_dir=work / f"cache-{backend}")
    uris = [checkpoints.upload(v1 if k % 2 else v0, run_id, k) for k in range(1, n + 1)]
    suite = make_suite("sites")
    suite.start()
    policy = make_policy(backend, {"sites": suite}, v0, settings.vllm_url, settings.vllm_model, checkpoints=checkpoints)
    if backend == "vllm":
        asyncio.run(policy.refresh(0, str(v0)))
    producer = EventProducer(settings)
    tasks = [t for t in suite.tasks("train") if t.difficulty == "easy"]
    dispatch(producer, run_id, task_stream(tasks, seed=0), 10 * n, 2)
    pool = RolloutPool(
        settings,
        {"sites": suite},
        policy,
        PoolConfig(
            workers=2,
            run_id=run_id,
            journal_dir=None,
            consumer_group=f"rollout-{run_id}",
            episode=EpisodeConfig(som=True),
        ),
    )
    acted: list[tuple[float, int]] = []
    act = policy.act

    async def timed_act(obs):
        out = await act(obs)
        acted.append((time.monotonic(), out.token_policy_versions[0] if out.token_policy_versions else policy.version))
        return out

    policy.act = timed_act
    latencies: list[float] = []

    def publish_all() -> None:
        for k, uri in enumerate(uris, start=1):
            time.sleep(3.0)
            t_pub = time.monotonic()
            producer.publish_all(
                [PolicyVersionPublished(run_id=run_id, version=k, checkpoint_uri=uri, checkpoint_sha256="0" * 64)]
            )
            while not any(v >= k and t > t_pub for t, v in acted):
                time.sleep(0.01)
            latencies.append(min(t for t, v in acted if v >= k and t > t_pub) - t_pub)
        pool.request_stop()

    threading.Thread(target=publish_all, daemon=True).start()
    with console.status(f"refresh latency, {backend} backend ..."):
        asyncio.run(pool.run())
    suite.stop()
    producer.close()
    console.print(f"refresh {backend}: {[round(x, 2) for x in latencies]} s")
    return latencies


def _logprob_gap(settings, run_ids: list[str]) -> dict:
    from model.inputs import inputs_from_ids, suppressed_token_ids
    from pipeline.consumer import read_log
    from pipeline.store import ScreenshotStore
    from pipeline.topics import ROLLOUT
    from rollout.policy.local import LocalPolicy
    from schemas import StepRecorded
    from trainer.update import score

    scorer = LocalPolicy(None)
    suppress = suppressed_token_ids(scorer.tokenizer)
    store = ScreenshotStore.from_settings(settings)
    gaps = []
    for s in read_log(settings, ROLLOUT):
        if isinstance(s, StepRecorded) and s.run_id in run_ids and s.response_token_ids:
            inputs = inputs_from_ids(
                scorer.tokenizer,
                s.prompt_token_ids + s.response_token_ids,
                [store.get(h) for h in s.prompt_screenshot_sha256],
                scorer.image_processor,
            )
            with torch.no_grad():
                lp, _ = score(scorer.model, inputs, len(s.response_token_ids), suppress, 1.0)
            gaps.append((lp - torch.tensor(s.behave_logprobs)).abs())
    g = torch.cat(gaps)
    return {
        "steps": len(gaps),
        "tokens": g.numel(),
        "max": g.max().item(),
        "mean": g.mean().item(),
        "p99": g.quantile(0.99).item(),
    }


def _report(results: dict) -> None:
    roll = results["rollout"]
    local = [r["steps_per_s"] for r in roll["local"]]
    vllm = [r["steps_per_s"] for r in roll["vllm"]]
    ratios = [v / lo for v, lo in zip(vllm, local)]
    console.print(f"rollout steps/s  local {local}  vllm {vllm}  vllm/local per round {[f'{x:.2f}' for x in ratios]}")
    for backend, lat in results["refresh"].items():
        console.print(
            f"refresh {backend}: median {statistics.median(lat):.2f} s  min {min(lat):.2f}  max {max(lat):.2f}"
        )
    console.print(f"log-prob gap: {results['logprob_gap']}")
    console.print(f"startup: {results['startup']}")
    OUT.mkdir(exist_ok=True)
    (OUT / "vllm_backend.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    typer.run(main)
