"""Decoupled PPO token objective (AsyncWebRL, arXiv 2606.05597, "Decoupled PPO"; AReaL's behave/proximal split).

Three policies: pi_behave sampled the token (possibly stale), pi_prox is the policy at the start of
the current update, pi_theta is being optimised. Per token:

    objective = (pi_prox / pi_behave) * min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A),
    r = pi_theta / pi_prox

The staleness weight pi_prox/pi_behave carries no gradient; the clip is centred on pi_prox. Tokens whose
staleness weight exceeds `behave_cap` are dropped (not clipped), and for A < 0 the dual clip bounds the
objective below by c * A, as in AsyncWebRL's reference code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PPOConfig:
    eps_low: float = 0.2
    """Lower clip range (OpenWebRL's asymmetric clip)."""
    eps_high: float = 0.28
    """Upper clip range; larger than eps_low so unlikely good tokens can grow."""
    dual_clip: float = 3.0
    """c: for negative advantages the objective is at least c * A."""
    behave_cap: float = 5.0
    """Tokens with pi_prox / pi_behave above this are dropped from the update."""


def decoupled_ppo_objective(
    logprobs: torch.Tensor,  # [T] log pi_theta(token), differentiable
    proximal_logprobs: torch.Tensor,  # [T] log pi_prox(token), recomputed at the update's start
    behave_logprobs: torch.Tensor,  # [T] log pi_behave(token), recorded by the sampler
    advantages: torch.Tensor,  # [T] the trajectory's advantage A_i on each of its tokens
    mask: torch.Tensor,  # [T] bool, True for real response tokens
    config: PPOConfig = PPOConfig(),
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token objective to maximise ([T], zero on dropped tokens) and detached statistics (0-d tensors)."""
    ratio = torch.exp(logprobs - proximal_logprobs.detach())  # [T]
    behave_weight = torch.exp(proximal_logprobs - behave_logprobs).detach()  # [T]
    keep = mask & (behave_weight <= config.behave_cap)  # [T]
    unclipped = ratio * advantages  # [T]
    clipped = torch.clamp(ratio, 1 - config.eps_low, 1 + config.eps_high) * advantages  # [T]
    surrogate = torch.minimum(unclipped, clipped)  # [T]
    surrogate = torch.where(advantages < 0, torch.maximum(surrogate, config.dual_clip * advantages), surrogate)
    # the weight is zeroed before the product: an inf weight (a -inf recorded log-prob) times the
    # unselected branch would make a NaN gradient through `where`
    objective = torch.where(keep, torch.where(keep, behave_weight, 0.0) * surrogate, 0.0)  # [T]

    with torch.no_grad():  # 0-d tensors, read once per optimizer step (no host sync here)
        n = keep.sum().clamp(min=1)  # []
        # a sampler that recorded -inf makes its token's weight inf (dropped above): the statistics
        # leave it out, which `mismatch_nonfinite` counts, so that an event holds finite numbers only
        finite = mask & torch.isfinite(behave_weight)  # [T]
        seen = finite.sum()  # []
        log_ratio = torch.where(keep, logprobs - proximal_logprobs, torch.zeros_like(logprobs))  # [T]
        stats = {
            "clip_frac": ((clipped < unclipped) & keep).sum() / n,
            "behave_weight_mean": torch.where(finite, behave_weight, 0.0).sum() / seen.clamp(min=1),
            "behave_weight_max": torch.where(finite, behave_weight, 0.0).max() if mask.numel() else seen * 0.0,
            "dropped_tokens": (mask & ~keep).sum().to(logprobs.dtype),
            "approx_kl": ((log_ratio.exp() - 1) - log_ratio).sum() / n,  # 0 where no token is kept
        }
    return objective, stats
