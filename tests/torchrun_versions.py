"""Worker for test_versions: `trainer.versions.VersionWriter` on an FSDP2-sharded model, in however
many gloo processes torchrun starts (the stack's settings come from the environment).

    python -m torch.distributed.run --nproc_per_node N tests/torchrun_versions.py RUN_ID OUT.pt

OUT.pt (rank 0): the full weights at each snapshot, after the next step, and as stored; what the
store held when each version was announced.
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from pipeline.checkpoints import CheckpointStore
from pipeline.settings import StackSettings
from trainer.state import FOLDER, full_state_dict, load_sharded
from trainer.versions import VersionWriter

dist.init_process_group("gloo")
rank, run_id = dist.get_rank(), sys.argv[1]
store = CheckpointStore.from_settings(StackSettings())


def build(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 8))
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def step(model, optimizer):
    model(torch.randn(16, 64)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def stored_files(version: int) -> list[str]:
    with __import__("tempfile").TemporaryDirectory() as tmp:
        found = store.get_state_dir(run_id, version, FOLDER, __import__("pathlib").Path(tmp) / "s")
        return sorted(p.name for p in found.iterdir()) if found else []


model, optimizer = build(0)
writer, announced, snapshots = VersionWriter(store, run_id), {}, {}
for version in (1, 2):
    step(model, optimizer)
    snapshots[version] = {k: v.clone() for k, v in full_state_dict(model).items()}
    writer.store(
        version, model, optimizer, (lambda v=version: announced.__setitem__(v, stored_files(v))) if rank == 0 else None
    )
    with torch.no_grad():  # the next update changes the live weights while the version uploads
        for p in model.parameters():
            p.add_(1.0)
writer.close()
after = full_state_dict(model)
restored = {}
for version in (1, 2):
    fresh, fresh_optimizer = build(1)
    step(fresh, fresh_optimizer)  # AdamW's state must exist to be loaded into
    assert load_sharded(store, run_id, version, fresh, fresh_optimizer)
    restored[version] = full_state_dict(fresh)
if rank == 0:
    torch.save(
        {
            "snapshots": snapshots,
            "restored": restored,
            "after": after,
            "announced": announced,
            "durable": writer.durable,
        },
        sys.argv[2],
    )
dist.destroy_process_group()
