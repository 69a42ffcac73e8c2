"""Trainer benchmark: where an update's time goes, side by side on one recorded batch.

    .venv/bin/python bench/update.py [--groups 4] [--reps 3]

A batch of `groups` groups (2 trajectories x 2 steps, 1280x720 page screenshots, responses sampled
from the tiny VLM) is recorded once, its screenshots put in a freshly started local S3. Then, in one
run, each figure the median of `reps`:
  1 process            forward + backward + optimizer step, screenshots prefetched from S3
  2 processes (gloo)   the same batch over `torchrun --nproc_per_node 2`, FSDP2-sharded as the trainer is
  no prefetch          1 process, each sample's screenshots fetched just before its forward
  2 minibatches        1 process, pi_prox scored in a separate no-grad pass, then 2 optimizer steps
  fetched each time    1 process, every read of a screenshot a GET to S3 (the trainer reads each
                       screenshot once per epoch; before `ScreenshotStore.cached_get` it fetched it
                       each time; the timed reps read the batch again, as epochs 2+ do)
Ratios are against "1 process". Writes bench/out/trainer.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/samples.py

import json
import os
import pickle
import statistics
import subprocess
import tempfile
import time

import typer
from rich.console import Console
from rich.table import Table

from pipeline.markdown import markdown_table

console = Console()


def record_batch(groups: int, store):
    from model.prompt import render_prompt
    from pipeline.hashing import sha256_hex
    from rollout.policy.local import LocalPolicy
    from schemas import GroupCompleted
    from schemas.observation import Mark, Observation
    from trainer.batch import TrainGroup

    from samples import render_page, sample_step

    policy, batch = LocalPolicy(max_new_tokens=32, seed=0), []
    for g in range(groups):
        trajectories = []
        for t in range(2):
            steps = []
            for s in range(2):
                png = render_page(f"group {g} trajectory {t} step {s}", seed=100 * g + 10 * t + s)
                store.put(png)
                obs = Observation(
                    instruction="find the cheapest item",
                    screenshots=[png],
                    screenshot_sha256=[sha256_hex(png)],
                    url="http://127.0.0.1/",
                    feedback="",
                    history=[],
                    memory={},
                    marks=[Mark(1, "button", "Add to cart", 1000, 640, 200, 50)],
                    som=True,
                    step=s,
                    horizon=10,
                )
                out = policy.generate(*render_prompt(obs))
                steps.append(
                    sample_step("bench", f"g{g}", f"g{g}t{t}", s, sha256_hex(png)).model_copy(
                        update={
                            "prompt_token_ids": out.prompt_token_ids,
                            "response_token_ids": out.response_token_ids,
                            "behave_logprobs": out.logprobs,
                            "token_policy_versions": out.token_policy_versions,
                        }
                    )
                )
            trajectories.append(steps)
        done = GroupCompleted(
            run_id="bench",
            group_id=f"g{g}",
            task_id="t",
            trajectory_ids=[f"g{g}t0", f"g{g}t1"],
            rewards=[1.0, 0.0],
            num_steps=[2, 2],
            outcomes=["success", "failure"],
            min_policy_version=0,
            max_policy_version=0,
        )
        batch.append(TrainGroup(done, trajectories, [1.0, -1.0], {}))
    return batch


def worker(batch_path: str, mode: str, reps: int, out_path: str) -> None:
    """One timed update per rep, under torchrun (any number of processes)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from model.hf_io import ensure_policy, load_policy
    from model.inputs import suppressed_token_ids
    from pipeline.settings import StackSettings
    from pipeline.store import ScreenshotStore
    from trainer.config import TrainConfig
    from trainer.sharding import FSDPOptimizer, shard_model
    from trainer.update import Scorer, flatten, optimizer_step, response_logprobs, shard

    torch.set_num_threads(1)  # two ranks share two cores
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = pickle.loads(Path(batch_path).read_bytes())
    model, tokenizer, processor = load_policy(ensure_policy())
    model = shard_model(model.train(), init_device_mesh("cpu", (world,)))  # the trainer's FSDP2 path
    optimizer = FSDPOptimizer(model, lr=1e-5, weight_decay=0.0)
    store = ScreenshotStore.from_settings(StackSettings())
    fetch = store.get if mode == "uncached" else store.cached_get()  # the trainer's, `trainer.train`
    scorer = Scorer(model, tokenizer, processor, suppressed_token_ids(tokenizer), fetch)
    config = TrainConfig(run_id="bench", lr=1e-5, minibatches=2 if mode == "minibatches" else 1)
    if mode == "no_prefetch":
        import trainer.update as update

        update.prefetch = lambda samples, fetch, ahead=4: (  # fetch inline, one sample at a time
            (s, [fetch(h) for h in s.screenshot_sha256]) for s in samples
        )
    times = []
    for _ in range(reps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        minibatches = [batch[m :: config.minibatches] for m in range(config.minibatches)]
        flat = [flatten(mb) for mb in minibatches]
        mine = [shard(samples, rank, world) for samples, _ in flat]
        proximal = [response_logprobs(scorer, s, 1.0) for s in mine] if config.minibatches > 1 else None
        for m, (_, n) in enumerate(flat):
            optimizer_step(scorer, optimizer, config, 0, [mine[m]], n, 0, [proximal[m]] if proximal else None)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        Path(out_path).write_text(json.dumps(times[1:]))  # the first rep warms caches up
    dist.destroy_process_group()


def main(groups: int = 4, reps: int = 3) -> None:
    from pipeline.stack.local import LocalStack
    from pipeline.store import ScreenshotStore

    runs = [
        ("1 process", 1, "plain"),
        ("2 processes (gloo)", 2, "plain"),
        ("no prefetch", 1, "no_prefetch"),
        ("2 minibatches", 1, "minibatches"),
        ("fetched each time", 1, "uncached"),
    ]
    results = {}
    with tempfile.TemporaryDirectory() as d:
        stack = LocalStack.up(Path(d) / "stack", durable=False)
        try:
            settings = stack.settings()
            store = ScreenshotStore.from_settings(settings)
            store.ensure_bucket()
            with console.status(f"recording a batch of {groups} groups ..."):
                batch = record_batch(groups, store)
            (Path(d) / "batch.pkl").write_bytes(pickle.dumps(batch))
            env = {**os.environ, **settings.environ(), "PYTHONWARNINGS": "ignore"}
            for name, nproc, mode in runs:
                with console.status(f"{name} x{reps + 1} ..."):
                    out = Path(d) / f"{mode}-{nproc}.json"
                    cmd = [
                        sys.executable,
                        "-m",
                        "torch.distributed.run",
                        "--standalone",
                        f"--nproc_per_node={nproc}",
                        __file__,
                        "--worker",
                        str(Path(d) / "batch.pkl"),
                        mode,
                        str(reps),
                        str(out),
                    ]
                    subprocess.run(cmd, env=env, check=True, capture_output=True)
                    results[name] = json.loads(out.read_text())
        finally:
            stack.down()
    steps = sum(len(t) for g in batch for t in g.trajectories)
    tokens = sum(len(s.response_token_ids) for g in batch for t in g.trajectories for s in t)
    base = statistics.median(results["1 process"])
    table = Table(title=f"one update: {groups} groups, {steps} steps, {tokens} response tokens (median of {reps})")
    for col in ("variant", "median s", "min s", "max s", "vs 1 process"):
        table.add_column(col)
    rows = []
    for name, ts in results.items():
        row = [
            name,
            f"{statistics.median(ts):.2f}",
            f"{min(ts):.2f}",
            f"{max(ts):.2f}",
            f"{statistics.median(ts) / base:.2f}x",
        ]
        table.add_row(*row)
        rows.append(row)
    console.print(table)
    md = markdown_table(["variant", "median s", "min s", "max s", "vs 1 process"], rows)
    console.print("\n".join(md), markup=False, highlight=False)
    out = Path(__file__).parent / "out"
    out.mkdir(exist_ok=True)
    (out / "trainer.json").write_text(json.dumps({"groups": groups, "steps": steps, "tokens": tokens, **results}))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
    else:
        typer.run(main)
