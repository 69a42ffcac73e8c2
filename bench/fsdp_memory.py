"""Per-rank training state of a published Qwen3-VL architecture under FSDP2, measured, not modelled.

    .venv/bin/python bench/fsdp_memory.py [--arch qwen3-vl-8b] [--worlds 8,16,64]

For each world size, in this one process: torch's fake process group stands in for the other ranks
(collectives return at once, nothing is sent); the model is built from the architecture with the
published vocabulary (151,936) on the meta device, so it costs no memory; the trainer's own
`shard_model` shards it as rank 0 sees it; zero gradients and one AdamW step of the trainer's
optimizer (`FSDPOptimizer`) create the moments, still on the meta device. The bytes are then read
from rank 0's local shards (`trainer.sharding.state_bytes`); rank 0 holds the largest slices, since
FSDP2 lays a weight out as `torch.chunk` on dim 0. Also reported: the largest FSDP unit, whose
gathered copy is the transient every forward adds. Writes bench/out/fsdp_memory.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/tables.py

import typer

from tables import console, show, write_json

VOCAB = 151_936


def measure(arch: str, world: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import Qwen3VLForConditionalGeneration

    from model.architectures import ARCHITECTURES, build_config
    from model.tokenizer import train_tokenizer
    from trainer.sharding import FSDPOptimizer, shard_model, state_bytes

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        config = build_config(train_tokenizer(), ARCHITECTURES[arch], vocab_size=VOCAB)
        with torch.device("meta"):
            model = Qwen3VLForConditionalGeneration._from_config(config, dtype=torch.float32).train()
        total = sum(p.numel() for p in model.parameters())
        model = shard_model(model, init_device_mesh("cpu", (world,)))
        optimizer = FSDPOptimizer(model, lr=1e-6, weight_decay=0.0)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        optimizer.optimizer.step()  # AdamW creates exp_avg and exp_avg_sq for every shard
        # every unit below the root is a leaf block (vision, decoder, embedding, head)
        largest = max(
            sum(p.numel() for p in m.parameters())
            for m in model.modules()
            if isinstance(m, FSDPModule) and m is not model
        )
        return {
            "world": world,
            "params": total,
            **vars(state_bytes(model, optimizer.optimizer)),
            "largest_unit_params": largest,
        }
    finally:
        dist.destroy_process_group()


def main(arch: str = "qwen3-vl-8b", worlds: str = "8,16,64") -> None:
    rows = []
    for world in (int(w) for w in worlds.split(",")):
        with console.status(f"{arch} sharded over {world} ranks (meta device, fake process group) ..."):
            rows.append(measure(arch, world))
    gb = 1e9
    head = [
        "ranks",
        "params / rank GB",
        "grads / rank GB",
        "AdamW / rank GB",
        "state / rank GB",
        "largest unit, bf16 gathered GB",
    ]
    table = []
    for r in rows:
        state = r["params_bytes"] + r["grads_bytes"] + r["optimizer_bytes"]
        table.append(
            [
                str(r["world"]),
                f"{r['params_bytes'] / gb:.3f}",
                f"{r['grads_bytes'] / gb:.3f}",
                f"{r['optimizer_bytes'] / gb:.3f}",
                f"{state / gb:.3f}",
                f"{r['largest_unit_params'] * 2 / gb:.3f}",
            ]
        )
    show(f"{arch}: {rows[0]['params']:,} parameters, fp32 master weights, rank 0 (the largest slices)", head, table)
    write_json("fsdp_memory", {"arch": arch, "rows": rows})


if __name__ == "__main__":
    typer.run(main)
