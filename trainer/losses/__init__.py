"""Losses, one short module each: the decoupled PPO token objective, multi-step GRPO normalisers, RAFT++,
a KL penalty to the reference policy, an SFT anchor on demonstrations (PPO-ptx), and which tokens carry
the gradient and the penalty; `objective` joins them into the one policy loss and its statistics."""

from trainer.losses.anchor import AnchorTokens, anchor_loss, anchor_mask
from trainer.losses.decoupled_ppo import PPOConfig, decoupled_ppo_objective
from trainer.losses.grpo import GRPOConfig, grpo_loss, token_weights, weighted_loss
from trainer.losses.kl import kl_to_reference
from trainer.losses.objective import PolicyBatch, policy_loss, step_batch
from trainer.losses.raft import raft_advantages
from trainer.losses.tokens import TokenSelection, select_tokens

__all__ = [
    "AnchorTokens",
    "GRPOConfig",
    "PPOConfig",
    "PolicyBatch",
    "TokenSelection",
    "anchor_loss",
    "anchor_mask",
    "decoupled_ppo_objective",
    "grpo_loss",
    "kl_to_reference",
    "policy_loss",
    "raft_advantages",
    "select_tokens",
    "step_batch",
    "token_weights",
    "weighted_loss",
]
