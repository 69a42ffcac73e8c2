"""Worker for test_trainer: optimizer steps of the FSDP2 trainer on recorded samples, in however many
processes torchrun starts: gloo on CPU, or NCCL with bf16 mixed precision, one GPU per rank, with
AWRL_TEST_DEVICE=cuda (test_fsdp_gpu.py).

    python -m torch.distributed.run --nproc_per_node N tests/torchrun_step.py IN.pkl OUT.pt

IN.pkl: (samples, trajectories, screenshots by hash, initial weights, TrainConfig, steps, demonstrations
for `TrainConfig.anchor`).
OUT.pt (rank 0): per step the loss, gradient norm, full weights and the ranks' combined digest of their
shards, each rank's state bytes, and the anchor's NLLs.
"""

import os
import pickle
import sys
from dataclasses import asdict

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from model.hf_io import ensure_policy, load_policy
from model.inputs import suppressed_token_ids
from pipeline.hashing import combined_sha256
from trainer.sharding import FSDPOptimizer, peak_memory, reset_peak_memory, shard_model, shard_sha256, state_bytes
from trainer.state import full_state_dict
from trainer.update import Scorer, combine, draw_anchor, interleave, optimizer_step, shard

cuda = os.environ.get("AWRL_TEST_DEVICE") == "cuda"
device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
if cuda:
    torch.cuda.set_device(device)
dist.init_process_group("nccl" if cuda else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
with open(sys.argv[1], "rb") as f:
    samples, trajectories, images, state, config, steps, demonstrations = pickle.load(f)
model, tokenizer, image_processor = load_policy(ensure_policy())
model.load_state_dict(state)
model = shard_model(
    model.to(device).train(),
    init_device_mesh(device.type, (world,)),
    bf16=cuda and config.bf16,
    activation_checkpointing=config.activation_checkpointing,
)
optimizer = FSDPOptimizer(model, config.lr, config.weight_decay)
scorer = Scorer(model, tokenizer, image_processor, suppressed_token_ids(tokenizer), images.__getitem__)
out = []
for update_step in range(steps):
    reset_peak_memory(device)
    anchor = draw_anchor(demonstrations, config, update_step, [rank], world)
    step = optimizer_step(
        scorer, optimizer, config, update_step, [shard(samples, rank, world)], trajectories, 0, None, anchor=anchor
    )
    gathered = [None] * world if rank == 0 else None
    memory = {**asdict(state_bytes(model, optimizer.optimizer)), "peak_bytes": peak_memory(device)}
    dist.gather_object((step.scored, memory, shard_sha256(model), step.anchor_nll), gathered, dst=0)
    weights = {k: v.clone() for k, v in full_state_dict(model).items()}  # one CPU process: live tensors
    if rank == 0:
        loss, _ = combine(interleave([s for s, _, _, _ in gathered]))
        out.append(
            {
                "loss": loss,
                "grad_norm": step.grad_norm,
                "weights": weights,
                "digest": combined_sha256([d for _, _, d, _ in gathered]),
                "memory": [m for _, m, _, _ in gathered],
                "scored": len(interleave([s for s, _, _, _ in gathered])),
                "anchor_nll": interleave([a for _, _, _, a in gathered]),
            }
        )
if rank == 0:
    torch.save(out, sys.argv[2])
dist.destroy_process_group()
