"""FSDP2 sharding of the policy, its sharded optimizer and memory measurements.

Each rank holds a dim-0 slice (`chunks`) of every parameter, of its gradient and of AdamW's two
moments: ~1/world_size of the 16 bytes a parameter costs in fp32 training. `fully_shard` is applied
per vision block, per decoder block, to the token embedding and the LM head, and at the root, so a
forward gathers one block's weights at a time.

The gradient arithmetic, which replay must reproduce bit for bit:
- every backward is one micro-batch (one sample per rank); FSDP2 reduce-scatters its gradient with a
  plain SUM (no averaging: the loss is already a batch sum), and adds it to the rank's sharded
  gradient: G = R_0 + R_1 + ..., R_k = sum over ranks of their k-th sample's gradient;
- the global gradient norm is each rank's float64 norm of its shards, all-gathered and combined in
  rank order (the same on every rank, whatever the collective's own summation order);
- AdamW runs on each rank's shards (elementwise: a slice's result does not depend on the others).

`The weights' digest after a step is each rank's sha256 of its own slices, combined in rank order
(`pipeline.hashing.combined_sha256`): no rank gathers the model to hash it.

Replay does the same on one plain model in one process (`trainer.emulated_fsdp.EmulatedFSDP`), with
this module's `chunks`, `shard_norm`, `global_norm` and `clip_`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from model.hf_io import load_shards, materialize, policy_on_meta
from pipeline.hashing import weights_sha256


def shard_model(
    model: torch.nn.Module, mesh: DeviceMesh, bf16: bool = False, activation_checkpointing: bool = False
) -> torch.nn.Module:
    """`fully_shard` a Qwen-VL policy in place: each vision block, each decoder block, the token
    embedding and the LM head (at 8B each is 3x a decoder block: kept whole in the root they would stay
    gathered through the whole forward), then the root (patch embedding, mergers, norms).
    `bf16`: bf16 parameters in forward and backward, fp32 gradient reduction and master weights."""
    if activation_checkpointing:  # HF's own hook: no wrapper module, so parameter names stay the HF ones
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    )
    text = model.model.language_model
    # A tied LM head (2B, 4B) is the embedding's own weight: both modules in one group, so it is one
    # sharded parameter, gathered once for the forward
    heads = (
        [[text.embed_tokens, model.lm_head]]
        if model.lm_head.weight is text.embed_tokens.weight
        else [text.embed_tokens, model.lm_head]
    )
    for block in [*model.model.visual.blocks, *text.layers, *heads]:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # the loss is a sum over the batch: sum the gradients
            module.set_force_sum_reduction_for_comms(True)  # SUM, never AVG/PREMUL_SUM (gloo has neither)
    return model


def sharded_policy(
    model_dir,
    mesh: DeviceMesh,
    device: torch.device,
    bf16: bool = False,
    activation_checkpointing: bool = False,
    weights: bool = True,
    frozen: bool = False,
) -> torch.nn.Module:
    """The directory's policy, sharded, without any rank holding it whole: built on the meta device,
    sharded, allocated (only this rank's slices) and, with `weights`, filled with this rank's rows of
    the directory's safetensors. `weights=False` leaves the slices for a DCP load to fill (resume).
    `frozen`: no gradients, in eval mode (a reference model), set before sharding as FSDP2 records it."""
    model = policy_on_meta(model_dir)
    if frozen:
        model.eval().requires_grad_(False)
    model = shard_model(model, mesh, bf16=bf16, activation_checkpointing=activation_checkpointing and not frozen)
    materialize(model, device)
    if weights:
        load_shards(model, model_dir)
    return model


def chunks(t: torch.Tensor, world: int) -> list[torch.Tensor]:
    """Each rank's slice of `t` as FSDP2 lays it out: `torch.chunk` on dim 0, empty past the last chunk."""
    parts = list(torch.chunk(t, world, dim=0))
    return parts + [t.new_empty((0, *t.shape[1:]))] * (world - len(parts))


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's slice of a (possibly) sharded tensor."""
    return t.to_local() if isinstance(t, DTensor) else t


def shard_sha256(model: torch.nn.Module) -> str:
    """This rank's digest of its own parameter slices (`combined_sha256` joins the ranks')."""
    return weights_sha256({name: local(p) for name, p in model.named_parameters()})


def shard_norm(grads: list[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """The float64 2-norm of one rank's gradient slices, in parameter order."""
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads]))


def global_norm(shard_norms: list[torch.Tensor]) -> float:
    """The gradient's norm from every rank's `shard_norm`, combined in rank order."""
    total = torch.zeros((), dtype=torch.float64)
    for n in shard_norms:
        total = total + n.cpu() ** 2
    return total.sqrt().item()


def clip_(grads: list[torch.Tensor], norm: float, max_norm: float) -> None:
    """Scale gradient slices so the global norm is at most `max_norm` (torch's clip_grad_norm_ rule)."""
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)


class FSDPOptimizer:
    """AdamW over this rank's FSDP2 shards, with the clip computed as replay emulates it
    (`trainer.emulated_fsdp.EmulatedFSDP`)."""

    def __init__(self, model: torch.nn.Module, lr: float, weight_decay: float, eps: float = 1e-8):
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, eps=eps)
        self.param_groups = self.optimizer.param_groups

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def after_backward(self) -> None:
        """FSDP2 has already reduce-scattered this backward's gradient into the shards."""

    def clip_and_step(self, max_norm: float) -> float:
        grads = [local(p.grad) for p in self.model.parameters() if p.grad is not None]
        mine = shard_norm(grads, next(self.model.parameters()).device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, mine)
        else:
            gathered = [mine]
        norm = global_norm(gathered)
        clip_(grads, norm, max_norm)
        self.optimizer.step()
        return norm


@dataclass(frozen=True)
class StateBytes:
    """One rank's bytes of parameters, gradients and optimizer state (its shards only)."""

    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> StateBytes:
    params = list(model.parameters())
    moments = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return StateBytes(
        sum(local(p).nbytes for p in params),
        sum(local(p.grad).nbytes for p in params if p.grad is not None),
        sum(local(m).nbytes for m in moments),
    )


def reset_peak_memory(device: torch.device) -> None:
    """Start a new high-water mark: the allocator's on GPU, the process's resident set on CPU (Linux)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")


def peak_memory(device: torch.device) -> int:
    """Bytes at the high-water mark since `reset_peak_memory`."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1)) * 1024
