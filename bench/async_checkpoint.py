"""Storing a version: the trainer's main thread blocked by a synchronous DCP save + upload (before)
vs `trainer.versions.VersionWriter` (now: DCP `async_save` stages a copy, a thread writes and uploads).

    .venv/bin/python bench/async_checkpoint.py [--size bench] [--reps 3] [--ranks 2]

Side by side in one run against one freshly started stack, on the bench model (the tiny VLM widened,
see bench/sharded_trainer.py), FSDP2-sharded over `--ranks` gloo processes with AdamW state. Each
repetition stores a new version, then runs "the next update" (a forward and backward of the same
model on a fixed input, with an optimizer step) and waits until the version is durable:
  blocked      main-thread time spent storing: the whole save + upload (before), or staging plus any
               wait left after the next update (now)
  durable      from the start of storing until every rank's shards are in the object store
  next update  the update that ran meanwhile (now) or after (before)
Writes bench/out/async_checkpoint.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/tables.py, bench/sharded_trainer.py

import typer

from tables import console, show, write_json

MODES = ("sync", "async")


def _worker(model_dir: str, reps: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from model.hf_io import load_policy
    from pipeline.checkpoints import CheckpointStore
    from pipeline.settings import StackSettings
    from trainer.sharding import FSDPOptimizer, shard_model
    from trainer.state import FOLDER
    from trainer.versions import VersionWriter

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, tokenizer, _ = load_policy(Path(model_dir))
    model = shard_model(model.train(), init_device_mesh("cpu", (world,)))
    optimizer = FSDPOptimizer(model, lr=1e-5, weight_decay=0.0)
    ids = torch.randint(0, len(tokenizer), (2, 256), generator=torch.Generator().manual_seed(0))

    def update() -> float:
        t0 = time.perf_counter()
        model(input_ids=ids).logits.float().square().mean().backward()
        optimizer.optimizer.step()
        optimizer.optimizer.zero_grad()
        dist.barrier()
        return time.perf_counter() - t0

    update()  # AdamW's moments exist from here on, as in a trainer past its first step
    store = CheckpointStore.from_settings(StackSettings())
    writer, rows = VersionWriter(store, f"bench-{os.getpid() if rank == 0 else 0}"), []
    run_id = [writer.run_id]
    dist.broadcast_object_list(run_id, src=0)
    writer.run_id = run_id[0]
    for version in range(1, 2 * reps + 3):  # alternating, after one untimed version of each
        mode = MODES[version % 2]
        t0 = time.perf_counter()
        if mode == "sync":
            model_state, optimizer_state = get_state_dict(model, optimizer.optimizer)
            with tempfile.TemporaryDirectory() as tmp:
                dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=tmp)
                for path in sorted(Path(tmp).iterdir()):
                    store.put_state(path, writer.run_id, version, f"{FOLDER}/{path.name}")
            dist.barrier()
            blocked = durable = time.perf_counter() - t0
            next_update = update()
        else:
            writer.store(version, model, optimizer.optimizer, None)
            staged = time.perf_counter() - t0
            next_update = update()
            t1 = time.perf_counter()
            writer.wait()
            dist.barrier()
            blocked, durable = staged + time.perf_counter() - t1, time.perf_counter() - t0
        if version > 2:
            rows.append({"mode": mode, "blocked_s": blocked, "durable_s": durable, "update_s": next_update})
    writer.close()
    if rank == 0:
        params = sum(p.numel() for p in model.parameters()) * world  # FSDP2 shards split every parameter
        Path(out).write_text(json.dumps({"rows": rows, "params": params, "world": world}))
    dist.destroy_process_group()


def main(
    size: str = "bench", reps: int = 3, ranks: int = 2, worker: list[str] = typer.Option(None, hidden=True)
) -> None:
    if worker:
        return _worker(worker[0], int(worker[1]), worker[2])
    from pipeline.stack.local import LocalStack

    from sharded_trainer import build_model

    with tempfile.TemporaryDirectory() as d:
        with console.status("building the model and starting the stack ..."):
            model_dir = build_model(size, Path(d) / "model")
            stack = LocalStack.up(Path(d) / "stack", durable=False)
        try:
            out = Path(d) / "out.json"
            env = {**os.environ, **stack.settings().environ(), "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={ranks}",
                __file__,
                "--worker",
                str(model_dir),
                "--worker",
                str(reps),
                "--worker",
                str(out),
            ]
            with console.status(f"{2 * reps + 2} versions on {ranks} rank(s) ..."):
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode:
                raise RuntimeError(proc.stderr[-3000:])
            result = json.loads(out.read_text())
        finally:
            stack.down()
    write_json("async_checkpoint", result)

    def mean(mode, key):
        return sum(r[key] for r in result["rows"] if r["mode"] == mode) / reps

    rows = [
        [mode, f"{mean(mode, 'blocked_s'):.2f}", f"{mean(mode, 'durable_s'):.2f}", f"{mean(mode, 'update_s'):.2f}"]
        for mode in MODES
    ]
    rows.append(["async / sync", f"{mean('async', 'blocked_s') / mean('sync', 'blocked_s'):.2f}x", "", ""])
    show(
        f"storing a version: {result['params'] / 1e6:.1f}M parameters + AdamW, {ranks} rank(s), mean of {reps}",
        ["path", "main thread blocked (s)", "until durable (s)", "next update (s)"],
        rows,
    )


if __name__ == "__main__":
    typer.run(main)
