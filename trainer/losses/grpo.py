"""Multi-step GRPO: how per-token objectives of a batch of trajectory groups become one loss.

AsyncWebRL, arXiv 2606.05597, "Algorithm side": for a group of G trajectories,

    L = -(1/G) * sum_i  N_i * sum_t  (1/|o_{i,t}|) * sum_j  objective_{i,t,j}

where o_{i,t} is the response of step t of trajectory tau_i. With B trajectories in groups of equal size
the batch loss is the mean over groups, i.e. the 1/G becomes 1/B. The normaliser N_i is the choice the
papers argue about:

- `per_trajectory`: N_i = 1/|tau_i| (WebGym). A long failure weighs 1 in total, like a short success,
  so each of its tokens is down-weighted by |tau_fail| / |tau_success| (~2.4x in the papers).
- `constant`: N_i = 1/k (AsyncWebRL, k = 10, the Easy horizon). A trajectory weighs |tau_i| / k.
- `token`: every token weighs 1/token_norm (Dr. GRPO style): no per-step or per-trajectory averaging.

Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv 2503.20783) is `token` with
`scale_by_std=False`: the group's advantages are R_i - mean(R), not divided by its std, which up-weights
groups whose rewards barely differ (a difficulty bias), and no length normaliser.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Normalizer = Literal["per_trajectory", "constant", "token"]


@dataclass(frozen=True)
class GRPOConfig:
    normalizer: Normalizer = "constant"
    k: float = 10.0
    """The constant of the `constant` normaliser (AsyncWebRL: the Easy horizon)."""
    token_norm: float = 1280.0
    """The constant of the `token` normaliser: k steps of up to 128 response tokens."""
    scale_by_std: bool = True
    """Divide each group's advantages by its rewards' std (GRPO); False: R_i - mean(R) (Dr. GRPO)."""


def token_weights(
    step_tokens: torch.Tensor,  # [T] |o_{i,t}|: response length of the token's step
    trajectory_steps: torch.Tensor,  # [T] |tau_i|: steps of the token's trajectory
    num_trajectories: int,  # B
    config: GRPOConfig = GRPOConfig(),
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """w [T] such that loss = -sum(w * objective)."""
    if config.normalizer == "token":
        return torch.full(
            step_tokens.shape, 1.0 / (num_trajectories * config.token_norm), dtype=dtype, device=step_tokens.device
        )
    if config.normalizer == "per_trajectory":
        n_i = 1.0 / trajectory_steps.to(dtype)  # [T]
    elif config.normalizer == "constant":
        n_i = torch.full(step_tokens.shape, 1.0 / config.k, dtype=dtype, device=step_tokens.device)  # [T]
    else:
        raise ValueError(f"unknown normalizer {config.normalizer!r}")
    return n_i / (step_tokens.to(dtype) * num_trajectories)  # [T]


def grpo_loss(
    objective: torch.Tensor,  # [T] per-token objective (e.g. decoupled_ppo_objective), 0 on dropped tokens
    step_tokens: torch.Tensor,  # [T]
    trajectory_steps: torch.Tensor,  # [T]
    success: torch.Tensor,  # [T] bool: the token's trajectory succeeded
    num_trajectories: int,
    config: GRPOConfig = GRPOConfig(),
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Scalar loss and the gradient-weight mass on failure vs success tokens (detached)."""
    w = token_weights(step_tokens, trajectory_steps, num_trajectories, config, objective.dtype)  # [T]
    return weighted_loss(objective, w, success)


def weighted_loss(
    objective: torch.Tensor,  # [T] per-token objective, 0 on dropped tokens
    w: torch.Tensor,  # [T] `token_weights`
    success: torch.Tensor,  # [T] bool: the token's trajectory succeeded
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """-sum(w * objective) and the gradient-weight mass on failure vs success tokens (detached)."""
    loss = -(w * objective).sum()
    with torch.no_grad():  # 0-d tensors: no host sync
        stats = {
            "weight_mass_failure": torch.where(success, 0.0, w).sum(),
            "weight_mass_success": torch.where(success, w, 0.0).sum(),
        }
    return loss, stats
