"""The trainer's state in the object store, in two forms.

- Sharded, for resuming: parameters and AdamW moments as `torch.distributed.checkpoint` (DCP) files
  under the version's `.trainer/dcp/` prefix. Each rank writes and uploads its own shards
  (`trainer.versions`, in the background) and reads them back on resume; nothing is gathered on one
  rank, and DCP reshards if the world size changed.
- Consolidated, for serving: the full weights gathered to rank 0 (`full_state_dict`), which writes
  the standard HF directory that the pool and vLLM load (`pipeline.checkpoints`).

The initial version has no sharded state: a trainer resuming there starts a fresh optimizer (DCP's
state-dict helpers would otherwise take a zero-gradient step to materialise AdamW's moments, which
counts as Adam's first step and changes its bias correction).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from pipeline.checkpoints import CheckpointStore

FOLDER = "dcp"


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights on rank 0's CPU ({} on the other ranks). Every rank must call it.
    With one CPU process the tensors are the live parameters, not copies: use them before the next step."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_sharded(
    store: CheckpointStore, run_id: str, version: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> bool:
    """Restore parameters and optimizer state of `version` into the sharded model; False if it has none."""
    with tempfile.TemporaryDirectory(prefix="awrl-dcp-") as tmp:
        if store.get_state_dir(run_id, version, FOLDER, Path(tmp)) is None:
            return False
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=tmp)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return True


def load_full_state(store: CheckpointStore, run_id: str, version: int) -> dict | None:
    """The sharded state of `version` as full tensors in one process, no process group needed (replay):
    {"model": {name: tensor}, "optimizer": {"state": {name: {...}}, "param_groups": [...]}}."""
    with tempfile.TemporaryDirectory(prefix="awrl-dcp-") as tmp:
        if store.get_state_dir(run_id, version, FOLDER, Path(tmp) / FOLDER) is None:
            return None
        dcp_to_torch_save(Path(tmp) / FOLDER, Path(tmp) / "state.pt")
        return torch.load(Path(tmp) / "state.pt", weights_only=False)
