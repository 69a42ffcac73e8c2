"""Worker for test_trainer: the batch gradient computed by however many processes torchrun starts.

    python -m torch.distributed.run --nproc_per_node N tests/torchrun_gradient.py BATCH.pkl OUT.pt
"""

import pickle
import sys

import torch
import torch.distributed as dist

from model.inputs import suppressed_token_ids
from model.tiny_vlm import ensure_tiny_vlm, load_tiny_vlm
from trainer.config import TrainConfig
from trainer.update import Scorer, accumulate_gradients, all_reduce_gradients, flatten, shard

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
with open(sys.argv[1], "rb") as f:
    batch, images, state = pickle.load(f)
model, tokenizer, image_processor = load_tiny_vlm(ensure_tiny_vlm())
model.load_state_dict(state)
model.train()
samples, trajectories = flatten(batch)
scorer = Scorer(model, tokenizer, image_processor, suppressed_token_ids(tokenizer), images.__getitem__)
accumulate_gradients(scorer, shard(samples, rank, world), trajectories, 0, TrainConfig(run_id="run"))
all_reduce_gradients(model, world)
if rank == 0:
    torch.save(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in model.parameters()]), sys.argv[2])
dist.destroy_process_group()
