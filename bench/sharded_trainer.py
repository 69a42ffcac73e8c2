"""Trainer memory and time per rank: replicated data parallel vs FSDP2, on one recorded batch.

    .venv/bin/python bench/sharded_trainer.py [--groups 2] [--reps 2] [--size bench] [--no-mmap-threshold]
        [--modes replicated,fsdp2 | fsdp2-gather,fsdp2]

`replicated` is the trainer's former path, kept here as the baseline only: every rank holds the whole
model, gradient and AdamW state, and gradients are summed by one all-reduce of a flat buffer.
`fsdp2` is the trainer's path (`trainer.sharding`, `trainer.update.optimizer_step`), with the weights'
digest each rank computes over its own shards; `fsdp2-gather` is the trainer before it, which gathered
the full weights to rank 0 after every optimizer step to hash them. All run under
`torchrun --nproc_per_node N` (gloo, 1 thread per rank) at 1 and 2 ranks, in one run, on the same
batch (recorded once by the tiny VLM, screenshots in a freshly started local S3) and the same initial
weights. `--size bench` widens the tiny VLM's text model (hidden 512, 8 layers) so that the state
(16 bytes a parameter) stands out of the process's baseline memory; `--size tiny` is the CI model.

Per rank and update: wall time (median of `reps`, after a warm-up), peak resident memory (the Linux
high-water mark, reset before each update; allocations above 64 KiB are mmap'd so that freed tensors
leave the resident set), and the exact bytes of parameters, gradients and optimizer state the rank holds.
Writes bench/out/sharded_trainer.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/update.py's recorder

import json
import os
import pickle
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict

import typer

from tables import console, show, write_json

SIZES = {
    "tiny": {},
    "bench": dict(
        hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2
    ),
}


def build_model(size: str, out: Path) -> Path:
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    from model.architectures import build_config, make_image_processor
    from model.hf_io import save_policy
    from model.tokenizer import train_tokenizer

    tokenizer = train_tokenizer()
    config = build_config(tokenizer)
    for key, value in SIZES[size].items():
        setattr(config.text_config, key, value)
    config.vision_config.out_hidden_size = config.text_config.hidden_size
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(config).float()
    return save_policy(model, tokenizer, out, image_processor=make_image_processor())


def _replicated_step(scorer, optimizer, config, samples, trajectories, rank, world) -> None:
    """The former trainer: the whole model on every rank, one flat all-reduce of the gradients."""
    import torch
    import torch.distributed as dist

    from trainer.update import accumulate_gradients

    model = scorer.model
    optimizer.zero_grad(set_to_none=False)
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i].prompt_token_ids + samples[i].response_token_ids))
    accumulate_gradients(scorer, [samples[i] for i in order[rank::world]], trajectories, 0, config)
    if world > 1:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        offset = 0
        for p, g in zip(model.parameters(), grads):
            p.grad = flat[offset : offset + g.numel()].view_as(g).clone()
            offset += g.numel()
    torch.nn.utils.clip_grad_norm_(list(model.parameters()), config.max_grad_norm)
    optimizer.step()


def worker(batch_path: str, model_dir: str, mode: str, reps: int, out_path: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from model.hf_io import load_policy
    from model.inputs import suppressed_token_ids
    from pipeline.settings import StackSettings
    from pipeline.store import ScreenshotStore
    from trainer.config import TrainConfig
    from trainer.sharding import FSDPOptimizer, peak_memory, reset_peak_memory, shard_model, state_bytes
    from trainer.update import Scorer, flatten, optimizer_step, shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    samples, trajectories = flatten(pickle.loads(Path(batch_path).read_bytes()))
    model, tokenizer, processor = load_policy(Path(model_dir))
    model.train()
    config = TrainConfig(run_id="bench", lr=1e-5)
    cpu = torch.device("cpu")
    if mode.startswith("fsdp2"):
        model = shard_model(model, init_device_mesh("cpu", (world,)))
        optimizer = FSDPOptimizer(model, config.lr, config.weight_decay)
        inner = optimizer.optimizer
    else:
        optimizer = inner = torch.optim.AdamW(model.parameters(), lr=config.lr)
    scorer = Scorer(
        model, tokenizer, processor, suppressed_token_ids(tokenizer), ScreenshotStore.from_settings(StackSettings()).get
    )
    times, peaks = [], []
    for _ in range(reps + 1):
        dist.barrier()
        reset_peak_memory(cpu)
        t0 = time.perf_counter()
        if mode.startswith("fsdp2"):
            optimizer_step(scorer, optimizer, config, 0, [shard(samples, rank, world)], trajectories, 0, None)
            _hash_weights(model, mode, rank, world)
        else:
            _replicated_step(scorer, optimizer, config, samples, trajectories, rank, world)
        dist.barrier()
        times.append(time.perf_counter() - t0)
        peaks.append(peak_memory(cpu))
    mine = {"time_s": times[1:], "peak_bytes": max(peaks[1:]), **asdict(state_bytes(model, inner))}
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if rank == 0:
        Path(out_path).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def _hash_weights(model, mode: str, rank: int, world: int) -> None:
    """The weights' hash an `UpdateApplied` records, as the trainer computes it in `mode`."""
    import torch.distributed as dist

    from pipeline.hashing import combined_sha256, weights_sha256
    from trainer.sharding import shard_sha256
    from trainer.state import full_state_dict

    if mode == "fsdp2-gather":  # before: the whole model gathered to rank 0, then hashed there
        full = full_state_dict(model)
        if rank == 0:
            weights_sha256(full)
    else:  # now: every rank hashes its own shards; rank 0 joins the digests
        digests = [None] * world if rank == 0 else None
        dist.gather_object(shard_sha256(model), digests, dst=0)
        if rank == 0:
            combined_sha256(digests)


def main(
    groups: int = 2,
    reps: int = 2,
    size: str = "bench",
    modes: str = typer.Option("replicated,fsdp2", help="paths to compare: replicated, fsdp2, fsdp2-gather"),
    mmap_threshold: bool = typer.Option(
        True,
        help="mmap every allocation above 64 KiB (glibc), so the peak "
        "RSS follows live tensors; off: glibc's default heap, "
        "for timing",
    ),
) -> None:
    from pipeline.stack.local import LocalStack
    from pipeline.store import ScreenshotStore

    from update import record_batch

    runs = [(mode, n) for n in (1, 2) for mode in modes.split(",")]
    results = {}
    with tempfile.TemporaryDirectory() as d:
        model_dir = build_model(size, Path(d) / "model")
        stack = LocalStack.up(Path(d) / "stack", durable=False)
        try:
            settings = stack.settings()
            store = ScreenshotStore.from_settings(settings)
            store.ensure_bucket()
            with console.status(f"recording a batch of {groups} groups ..."):
                batch = record_batch(groups, store)
            (Path(d) / "batch.pkl").write_bytes(pickle.dumps(batch))
            # glibc keeps freed heap pages resident: with every allocation above 64 KiB mmap'd, a freed
            # tensor leaves the resident set, and the peak RSS follows live memory (both paths alike)
            env = {
                **os.environ,
                **settings.environ(),
                "PYTHONWARNINGS": "ignore",
                "OMP_NUM_THREADS": "1",
                **({"MALLOC_MMAP_THRESHOLD_": "65536"} if mmap_threshold else {}),
            }
            for mode, nproc in runs:
                with console.status(f"{mode} x {nproc} rank(s), {reps + 1} updates ..."):
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
                        str(model_dir),
                        mode,
                        str(reps),
                        str(out),
                    ]
                    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
                    if proc.returncode:
                        raise RuntimeError(proc.stderr[-3000:])
                    results[f"{mode}-{nproc}"] = json.loads(out.read_text())
        finally:
            stack.down()
    report(results, groups, size, sum(len(t) for g in batch for t in g.trajectories))


def report(results: dict, groups: int, size: str, steps: int) -> None:
    mib = 2**20
    first = next(iter(results))
    params = results[first][0]["params_bytes"] // 4
    base = results[first][0]
    head = [
        "path",
        "ranks",
        "update s (median)",
        f"vs {first} x1",
        "peak RSS / rank MiB",
        "params+grads+Adam / rank MiB",
        f"state vs {first} x1",
    ]
    base_time = statistics.median(base["time_s"])
    base_state = base["params_bytes"] + base["grads_bytes"] + base["optimizer_bytes"]
    rows = []
    for name, ranks in results.items():
        mode, n = name.rsplit("-", 1)
        t = statistics.median(ranks[0]["time_s"])
        state = max(r["params_bytes"] + r["grads_bytes"] + r["optimizer_bytes"] for r in ranks)
        rows.append(
            [
                mode,
                n,
                f"{t:.2f}",
                f"{t / base_time:.2f}x",
                f"{max(r['peak_bytes'] for r in ranks) / mib:.0f}",
                f"{state / mib:.1f}",
                f"{state / base_state:.2f}x",
            ]
        )
    show(f"{size} model ({params / 1e6:.1f}M parameters): {groups} groups, {steps} steps", head, rows)
    write_json("sharded_trainer", {"groups": groups, "size": size, "params": params, **results})


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(*sys.argv[2:4], sys.argv[4], int(sys.argv[5]), sys.argv[6])
    else:
        typer.run(main)
