"""Trainer start-up per rank: the whole model loaded on every rank then sharded (before) vs built on
the meta device, sharded, and only the rank's rows read (the trainer's, `trainer.sharding.sharded_policy`).

    .venv/bin/python bench/trainer_startup.py [--narrow 4] [--ranks 1,2] [--stored bf16|fp32]

The model is Qwen3-VL-2B's architecture with every width divided by `narrow` (4: ~110M parameters,
every depth kept), randomly initialised and saved as an HF directory once, in bf16 as the published
Qwen3-VL checkpoints are (the trainer trains in fp32, so each rank converts what it reads; `--stored
fp32` saves fp32, which a plain load can leave memory-mapped). Each path runs under
`torchrun --nproc_per_node N` (gloo, 1 thread a rank) and reports, per rank: the peak resident
memory of the start-up over the process's memory just before it (the Linux high-water mark, reset
there; allocations above 64 KiB are mmap'd so that freed tensors leave the resident set), the memory
still held after it, its wall time, and the combined digest of the shards, which must be the same for
both paths. Writes bench/out/trainer_startup.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/tables.py

import typer

from tables import console, show, write_json

MODES = ("whole-then-shard", "meta-then-rows")


def _status(*keys: str) -> list[int]:
    """Fields of /proc/self/status, in bytes."""
    with open("/proc/self/status") as f:
        found = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.endswith(" kB\n")}
    return [found[k] for k in keys]


def _rss() -> int:
    return _status("VmRSS")[0]


class PeakSampler:
    """The peak of the process's private (anonymous) memory and of its mapped file pages, sampled every
    millisecond: the kernel keeps a high-water mark of their sum only, and file pages (the memory-mapped
    safetensors) are the page cache, one copy a node however many ranks map them."""

    def __init__(self):
        import threading

        self.anon = self.file = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            anon, file = _status("RssAnon", "RssFile")
            self.anon, self.file = max(self.anon, anon), max(self.file, file)

    def stop(self) -> tuple[int, int]:
        self._stop.set()
        self._thread.join()
        return self.anon, self.file


def worker(model_dir: str, mode: str, out_path: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from model.hf_io import load_policy
    from pipeline.hashing import combined_sha256
    from trainer.sharding import peak_memory, reset_peak_memory, shard_model, shard_sha256, sharded_policy

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh, cpu = init_device_mesh("cpu", (world,)), torch.device("cpu")
    dist.barrier()
    reset_peak_memory(cpu)
    (anon0, file0), sampler = _status("RssAnon", "RssFile"), PeakSampler()
    before, t0 = _rss(), time.perf_counter()
    if mode == "whole-then-shard":  # the former start-up: every rank holds the whole model first
        model = shard_model(load_policy(model_dir)[0].train(), mesh)
    else:
        model = sharded_policy(model_dir, mesh, cpu)
    took = time.perf_counter() - t0
    anon, file = sampler.stop()
    mine = {
        "peak_over_start": peak_memory(cpu) - before,
        "anon_peak": anon - anon0,
        "file_peak": file - file0,
        "held_after": _rss() - before,
        "seconds": took,
        "params": sum(p.numel() for p in model.parameters()),
        "digest": shard_sha256(model),
    }
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if rank == 0:
        Path(out_path).write_text(
            json.dumps({"ranks": gathered, "digest": combined_sha256([g["digest"] for g in gathered])})
        )
    dist.destroy_process_group()


def main(narrow: int = 4, ranks: str = "1,2", stored: str = "bf16") -> None:
    import torch

    from model.architectures import make_policy
    from model.hf_io import save_policy

    results = {}
    with tempfile.TemporaryDirectory() as d:
        with console.status(f"building Qwen3-VL-2B's architecture, {narrow}x narrower ..."):
            model, tokenizer = make_policy("qwen3-vl-2b", narrow=narrow, seed=0)
            params = sum(p.numel() for p in model.parameters())
            model_dir = save_policy(
                model.to({"bf16": torch.bfloat16, "fp32": torch.float32}[stored]), tokenizer, Path(d) / "model"
            )
            del model
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
        for n in (int(r) for r in ranks.split(",")):
            for mode in MODES:  # side by side, in turn
                with console.status(f"{mode} x {n} rank(s) ..."):
                    out = Path(d) / f"{mode}-{n}.json"
                    cmd = [
                        sys.executable,
                        "-m",
                        "torch.distributed.run",
                        "--standalone",
                        f"--nproc_per_node={n}",
                        __file__,
                        "--worker",
                        str(model_dir),
                        mode,
                        str(out),
                    ]
                    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
                    if proc.returncode:
                        raise RuntimeError(proc.stderr[-3000:])
                    results[f"{mode} x{n}"] = json.loads(out.read_text())
    report(results, params, narrow, stored)


def report(results: dict, params: int, narrow: int, stored: str) -> None:
    mib = 2**20
    head = [
        "path",
        "ranks",
        "peak RSS over start / rank MiB",
        "of it private (anon) MiB",
        "file pages MiB",
        "held after / rank MiB",
        "seconds",
        "private vs before",
        "weights digest",
    ]

    def worst(key: str, name: str) -> int:
        return max(r[key] for r in results[name]["ranks"])

    table = []
    for name, result in results.items():
        mode, n = name.split(" x")
        table.append(
            [
                mode,
                n,
                *(f"{worst(k, name) / mib:.0f}" for k in ("peak_over_start", "anon_peak", "file_peak", "held_after")),
                f"{worst('seconds', name):.1f}",
                f"{worst('anon_peak', name) / worst('anon_peak', f'{MODES[0]} x{n}'):.2f}x",
                result["digest"][:12],
            ]
        )
    show(
        f"Qwen3-VL-2B architecture / {narrow} ({params / 1e6:.1f}M parameters, {params * 4 / mib:.0f} MiB in fp32), "
        f"stored in {stored}",
        head,
        table,
    )
    write_json("trainer_startup", {"params": params, "narrow": narrow, "stored": stored, **results})


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(*sys.argv[2:5])
    else:
        typer.run(main)
