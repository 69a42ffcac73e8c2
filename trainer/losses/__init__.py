"""Losses, one short module each: the decoupled PPO token objective, multi-step GRPO normalisers, RAFT++,
a KL penalty to the reference policy, an SFT anchor on demonstrations (PPO-ptx), and which tokens carry
the gradient and the penalty."""

from trainer.losses.anchor import AnchorTokens, anchor_loss, anchor_mask
from trainer.losses.decoupled_ppo import PPOConfig, decoupled_ppo_objective
from trainer.losses.grpo import GRPOConfig, grpo_loss, token_weights
from trainer.losses.kl import kl_to_reference
from trainer.losses.raft import raft_advantages
from trainer.losses.tokens import TokenSelection, select_tokens

__all__ = ["AnchorTokens", "GRPOConfig", "PPOConfig", "TokenSelection", "anchor_loss", "anchor_mask",
           "decoupled_ppo_objective", "grpo_loss", "kl_to_reference", "raft_advantages", "select_tokens",
           "token_weights"]
