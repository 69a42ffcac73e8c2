"""GRPO group advantages, in one place: the trainer's batch builder, the Dagster `groups` asset and
replay all call these functions, so the numbers can never disagree.

    A_i = (R_i - mean(R)) / (std(R) + eps)          (AsyncWebRL, arXiv 2606.05597, "Algorithm side")
    A_i = R_i - mean(R)                              (Dr. GRPO, arXiv 2503.20783: `scale_by_std=False`)

`std` is the population standard deviation (ddof=0) of the group's rewards. A group whose rewards are
all equal has zero advantage for every trajectory and teaches nothing: OpenWebRL's trajectory-level
dynamic sampling drops it (`informative` is False).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

EPS = 1e-6


def group_advantages(rewards: Sequence[float], eps: float = EPS, scale_by_std: bool = True) -> list[float]:
    if not rewards:
        raise ValueError("a group has at least one trajectory")
    n = len(rewards)
    mean = sum(rewards) / n
    if not scale_by_std:
        return [r - mean for r in rewards]
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / n)
    return [(r - mean) / (std + eps) for r in rewards]


def informative(rewards: Sequence[float]) -> bool:
    """False when every reward is equal (dynamic sampling drops such groups)."""
    return len(set(rewards)) > 1
