"""The policy loss, one entry point: the loss and its statistics together, as a torchtune recipe calls
one loss object.

    loss = -sum_j w_j * objective_j                        (`decoupled_ppo`, weighted by `grpo`)
           - entropy_coef * sum_j w_j * H_j * [j in pg]    (entropy bonus)
           + kl_coef * sum_j w^kl_j * k3_j * [j in kl]     (`kl`, DeepSeekMath's beta)

`step_batch` builds one step's inputs: which tokens carry the gradient and the penalty (`tokens`),
RAFT++'s advantages and mask (`raft`) and the GRPO weights w (`grpo.token_weights`), computed here
only. `policy_loss` takes a step's (the trainer's backward, one step at a time) or a whole batch's
tokens concatenated (`trainer.update.update_stats`: ratios such as clip_frac are over every rank's
tokens, which per-step values would not sum to).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from trainer.losses.decoupled_ppo import decoupled_ppo_objective
from trainer.losses.grpo import token_weights, weighted_loss
from trainer.losses.kl import kl_to_reference
from trainer.losses.raft import raft_advantages
from trainer.losses.tokens import select_tokens

if TYPE_CHECKING:
    from trainer.config import TrainConfig


RECORDED = ("logprobs", "proximal", "behave", "advantages", "mask", "weights", "success", "entropy", "reference")
"""The `PolicyBatch` fields a step records for its batch's statistics (the KL inputs are not needed there)."""


@dataclass(frozen=True)
class PolicyBatch:
    """The loss's per-token inputs: one step's response tokens, or a batch's steps concatenated."""

    logprobs: torch.Tensor  # [T] log pi_theta, differentiable
    proximal: torch.Tensor  # [T] log pi_prox
    behave: torch.Tensor  # [T] log pi_behave, recorded by the sampler
    advantages: torch.Tensor  # [T] A_i (RAFT++: 1 on successes)
    mask: torch.Tensor  # [T] bool: the policy-gradient tokens (RAFT++: of successes only)
    weights: torch.Tensor  # [T] w: loss = -sum(w * objective)
    success: torch.Tensor  # [T] bool: the token's trajectory succeeded
    entropy: torch.Tensor  # [T] the policy's entropy at the token
    reference: torch.Tensor  # [T] log pi_ref, or [0] without a reference
    kl_mask: torch.Tensor | None = None  # [T] bool: the KL penalty's tokens
    kl_weights: torch.Tensor | None = None
    """[T] w^kl; None leaves the KL penalty out of the loss (kl_coef 0, or a batch's statistics)."""

    def recorded(self) -> dict[str, torch.Tensor]:
        """The per-token values a batch's statistics are computed from, detached (`concatenated` reads
        them back once every step's are joined)."""
        return {k: getattr(self, k).detach() for k in RECORDED}

    @classmethod
    def concatenated(cls, tokens: dict[str, torch.Tensor]) -> PolicyBatch:
        """A batch's recorded per-token values (`trainer.update.combine`), for its statistics."""
        return cls(**{k: tokens[k] for k in RECORDED})


def step_batch(
    config: TrainConfig,
    logprobs: torch.Tensor,  # [n] log pi_theta of one step's response tokens, differentiable
    entropy: torch.Tensor,  # [n] the policy's entropy at each, differentiable
    proximal: torch.Tensor,  # [n] log pi_prox
    behave_logprobs: list[float],  # n values: log pi_behave, recorded by the sampler
    reference: torch.Tensor,  # [n] log pi_ref, or [0] without a reference
    advantage: float,  # A_i of the step's trajectory
    success: bool,  # the step's trajectory succeeded
    trajectory_steps: int,  # |tau_i|
    num_trajectories: int,  # B
    decision_mask: Callable[[], list[bool]],  # the action's value tokens (`model.response`), computed on demand
) -> PolicyBatch:
    """One step's `PolicyBatch`: its selected tokens, advantages and weights."""
    n, dtype, dev = logprobs.shape[0], logprobs.dtype, logprobs.device
    behave = torch.tensor(behave_logprobs, dtype=dtype, device=dev)  # [n]
    succeeded = torch.full((n,), success, device=dev)  # [n]
    mask, kl_mask = select_tokens(config.tokens, entropy.detach(), decision_mask)  # [n], [n]
    advantages = torch.full((n,), advantage, dtype=dtype, device=dev)  # [n]
    # |o_{i,t}|: the step's response tokens, or its selected ones (a step keeps its whole weight)
    step_tokens = torch.full((n,), n if config.tokens.pg == "all" else int(mask.sum()), device=dev)  # [n]
    steps = torch.full((n,), trajectory_steps, device=dev)  # [n] |tau_i|
    if config.loss == "raft":
        advantages, mask = raft_advantages(succeeded, mask)
        kl_mask = kl_mask & succeeded if config.tokens.kl == "all" else kl_mask
    w = token_weights(step_tokens, steps, num_trajectories, config.grpo, dtype)  # [n]
    w_kl = None
    if config.kl_coef:  # per token like the objective over the whole response: 1/|o| each
        w_kl = (
            w
            if config.tokens.pg == "all"
            else token_weights(torch.full((n,), n, device=dev), steps, num_trajectories, config.grpo, dtype)
        )  # [n]
    return PolicyBatch(logprobs, proximal, behave, advantages, mask, w, succeeded, entropy, reference, kl_mask, w_kl)


def policy_loss(config: TrainConfig, batch: PolicyBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss (0-d) and its detached statistics (0-d tensors, no host sync)."""
    objective, stats = decoupled_ppo_objective(
        batch.logprobs, batch.proximal, batch.behave, batch.advantages, batch.mask, config.ppo
    )  # [T]
    loss, weight_mass = weighted_loss(objective, batch.weights, batch.success)
    if config.entropy_coef:
        loss = loss - config.entropy_coef * (batch.weights * batch.entropy * batch.mask).sum()
    kl = kl_to_reference(batch.logprobs, batch.reference) if batch.reference.numel() else None  # [T]
    if config.kl_coef and batch.kl_weights is not None:
        loss = loss + config.kl_coef * (batch.kl_weights * kl * batch.kl_mask).sum()
    with torch.no_grad():
        if kl is not None:  # on the policy-gradient tokens, unweighted
            stats["kl_ref"] = torch.where(batch.mask, kl, 0.0).sum() / batch.mask.sum().clamp(min=1)
        stats["tokens"] = torch.tensor(float(batch.logprobs.numel()))
        stats["entropy"] = batch.entropy.mean()
        stats |= weight_mass
    return loss, stats
