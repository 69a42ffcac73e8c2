"""KL penalty to a frozen reference policy (the run's version 0: the SFT model).

DeepSeekMath's GRPO (arXiv 2402.03300, eq. 4) adds beta * D_KL(pi_theta || pi_ref) per token with
Schulman's unbiased, always non-negative "k3" estimator, on tokens sampled from the policy:

    k3 = pi_ref / pi_theta - log(pi_ref / pi_theta) - 1 = exp(d) - d - 1,   d = log pi_ref - log pi_theta

Its gradient with respect to log pi_theta is 1 - exp(d): it pushes a token's log-prob back toward the
reference from either side, and is zero where they agree. AsyncWebRL trains without it; here it guards a
small model's output format, which the push-down on failed trajectories can wear away (bench/RESULTS.md).
"""

from __future__ import annotations

import torch


def kl_to_reference(
    logprobs: torch.Tensor,  # [T] log pi_theta(token), differentiable
    reference_logprobs: torch.Tensor,  # [T] log pi_ref(token), no gradient
) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi_theta || pi_ref) ([T], >= 0) to add, times beta, to the loss."""
    d = reference_logprobs.detach() - logprobs  # [T]
    return torch.exp(d) - d - 1
