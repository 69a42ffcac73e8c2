"""Sampler-vs-trainer mismatch: how far the log-probs the sampler recorded are from the trainer's own.

A fresh token (lag 0) was sampled by the same version the trainer scores it with, so its two log-probs
differ only by the sampler's numerics (kernels, batching, dtype, a bug in weight loading): a sampler
change that breaks parity shows here before it shows in success. AReaL (PR #1736), verl's rollout
correction metrics and slime report the same. Stale tokens (lag > 0) also carry the policy's drift since
they were sampled, so they are kept apart.

Per token the sampler drew, log r = log pi_trainer - log pi_sampler (`proximal` minus `behave`). Over
the fresh tokens whose two log-probs are finite, Schulman's estimators of KL(sampler || trainer)
("Approximating KL divergence", 2020), unbiased or low-variance on samples from the sampler:

    k1 = -log r,    k2 = (log r)^2 / 2,    k3 = (r - 1) - log r

Every token counts, also those the loss masks out (RAFT's failures): parity is the sampler's property.

The statistics, the keys of `UpdateApplied.stats` (one place; the `updates` view, the viewer and
TensorBoard's `mismatch/*` read them):
- `mismatch_tokens`: fresh tokens (lag 0), finite or not;
- `mismatch_nonfinite`: share of them whose behave or proximal log-prob is NaN or infinite; those are
  left out of every other statistic;
- `mismatch_k1`, `mismatch_k2`, `mismatch_k3`: the estimators' means;
- `mismatch_ratio_min`, `mismatch_ratio_max`: the smallest and largest r = pi_trainer / pi_sampler;
- `mismatch_ratio_tail`: share with r outside [1/2, 2] (|log r| > log 2);
- `mismatch_stale_tokens`, `mismatch_stale_k3`: the stale tokens (lag > 0) and their finite ones' mean k3.
With no fresh (finite) token the means and shares are 0 and both ratios 1 (finite: a NaN would not
survive the event's JSON); the `updates` view shows those columns as NULL then, and TensorBoard skips them.
"""

from __future__ import annotations

import math

import torch

TAIL_LOG_RATIO = math.log(2.0)
"""|log r| beyond which a token counts in `mismatch_ratio_tail`."""


def mismatch_stats(
    proximal_logprobs: torch.Tensor,  # [T] log pi_trainer(token) at the version the trainer holds
    behave_logprobs: torch.Tensor,  # [T] log pi_sampler(token), recorded by the sampler
    lag: torch.Tensor,  # [T] trainer version - the token's sampling version
) -> dict[str, torch.Tensor]:
    """The module's statistics as 0-d float64 tensors (no host sync here); T > 0."""
    finite = torch.isfinite(proximal_logprobs) & torch.isfinite(behave_logprobs)  # [T]
    fresh, stale = lag == 0, lag > 0  # [T], [T]
    ok, stale_ok = fresh & finite, stale & finite  # [T], [T]
    log_r = torch.where(finite, proximal_logprobs.double() - behave_logprobs.double(), 0.0)  # [T]
    k3 = torch.expm1(log_r) - log_r  # [T]
    n = ok.sum().clamp(min=1)  # []

    def mean(values: torch.Tensor) -> torch.Tensor:  # [T] -> [], over the finite fresh tokens
        return torch.where(ok, values, 0.0).sum() / n

    return {
        "mismatch_tokens": fresh.sum().double(),
        "mismatch_nonfinite": (fresh & ~finite).sum() / fresh.sum().clamp(min=1).double(),
        "mismatch_k1": mean(-log_r),
        "mismatch_k2": mean(0.5 * log_r.square()),
        "mismatch_k3": mean(k3),
        "mismatch_ratio_min": torch.where(ok.any(), torch.where(ok, log_r, math.inf).min().exp(), 1.0),
        "mismatch_ratio_max": torch.where(ok.any(), torch.where(ok, log_r, -math.inf).max().exp(), 1.0),
        "mismatch_ratio_tail": mean((log_r.abs() > TAIL_LOG_RATIO).double()),
        "mismatch_stale_tokens": stale.sum().double(),
        "mismatch_stale_k3": torch.where(stale_ok, k3, 0.0).sum() / stale_ok.sum().clamp(min=1),
    }
