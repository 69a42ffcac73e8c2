"""FSDP2's sharded update emulated in one process, for replay (`analysis.replay`).

A run's recorded loss, gradient norm and weights' digest come from N trainer ranks (`trainer.sharding`);
replay has one process and no collectives, yet must reproduce them bit for bit. `EmulatedFSDP` runs the
same arithmetic on a plain, unsharded model: R_k (the sum over ranks of their k-th micro-batch's
gradient) summed in rank order (for 2 ranks a single addition per element, which is what the
reduce-scatter computes; for more ranks the collective's order is not known and the last bits may
differ), the norm from the same per-rank slices (`trainer.sharding.chunks`), and one AdamW per rank over
views of the same slices.
"""

from __future__ import annotations

import torch

from pipeline.hashing import combined_sha256, weights_sha256
from trainer.sharding import chunks, clip_, global_norm, shard_norm


class EmulatedFSDP:
    """`world` FSDP2 ranks' gradient reduction, clip and AdamW on one plain model in one process."""

    def __init__(self, model: torch.nn.Module, world: int, lr: float, weight_decay: float, eps: float = 1e-8):
        self.model, self.world = model, world
        self.params = dict(model.named_parameters())
        # views into the model's own storage: each rank's AdamW updates its slice of the weights in place
        self.slices = {
            name: [torch.nn.Parameter(c) for c in chunks(p.detach(), world)] for name, p in self.params.items()
        }
        self.optimizers = [
            torch.optim.AdamW([s[r] for s in self.slices.values()], lr=lr, weight_decay=weight_decay, eps=eps)
            for r in range(world)
        ]
        self.param_groups = [g for o in self.optimizers for g in o.param_groups]
        self._rank, self._micro, self._grad = 0, None, None

    def load_state(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        """AdamW's state by parameter name (full tensors, as `load_full_state` gives): sliced per rank."""
        for name, entry in state.items():
            for r, opt in enumerate(self.optimizers):
                opt.state[self.slices[name][r]] = {
                    k: chunks(v, self.world)[r].clone() if v.dim() else v.clone() for k, v in entry.items()
                }

    def zero_grad(self) -> None:
        self._rank, self._micro, self._grad = 0, None, None
        for p in [*self.params.values(), *(s for slices in self.slices.values() for s in slices)]:
            p.grad = None

    def after_backward(self) -> None:
        """Take this rank's micro-batch gradient; after the last rank, add their sum to the total."""
        grads = {n: p.grad for n, p in self.params.items()}
        for p in self.params.values():
            p.grad = None
        self._micro = grads if self._micro is None else {n: _add(self._micro[n], g) for n, g in grads.items()}
        self._rank += 1
        if self._rank == self.world:
            if self._grad is None:
                self._grad = self._micro
            else:
                for n, g in self._micro.items():
                    if self._grad[n] is not None and g is not None:
                        self._grad[n] += g  # in place, as FSDP2 adds to the sharded gradient
                    else:
                        self._grad[n] = _add(self._grad[n], g)
            self._rank, self._micro = 0, None

    def sha256(self) -> str:
        """The digest `world` ranks would record for these weights: each rank's slices hashed, combined."""
        return combined_sha256(
            [
                weights_sha256({n: chunks(p.detach(), self.world)[r] for n, p in self.params.items()})
                for r in range(self.world)
            ]
        )

    def clip_and_step(self, max_norm: float) -> float:
        """Unused parameters (no gradient on any rank) are left alone, as AdamW leaves them under FSDP2."""
        if self._grad is None:
            return 0.0
        names = [n for n in self.params if self._grad[n] is not None]
        per_rank = [[chunks(self._grad[n], self.world)[r] for n in names] for r in range(self.world)]
        norm = global_norm([shard_norm(g) for g in per_rank])
        for r, grads in enumerate(per_rank):
            clip_(grads, norm, max_norm)
            for n, g in zip(names, grads):
                self.slices[n][r].grad = g
            self.optimizers[r].step()
        for n in names:
            self.params[n].grad = self._grad[n]  # the full, clipped gradient, for inspection
        return norm


def _add(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    return b if a is None else a if b is None else a + b
