"""RAFT++ baseline: learn only from successful trajectories (REINFORCE / behaviour cloning style).

AsyncWebRL, arXiv 2606.05597: it shows the same length-coupled drift as GRPO with 1/|tau|, milder; async RAFT++ scored
39.3% vs synchronous WebGym 42.9%. It reuses the decoupled PPO objective with A = 1 on the tokens of
successful trajectories and drops every failed trajectory's tokens.
"""

from __future__ import annotations

import torch


def raft_advantages(
    success: torch.Tensor,  # [T] bool: the token's trajectory succeeded
    mask: torch.Tensor,  # [T] bool: real response tokens
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages [T], mask [T]) to feed `decoupled_ppo_objective`: 1 on successes, failures masked."""
    return success.float(), mask & success
