"""An SFT anchor: cross-entropy on the warm start's own demonstrations, added to the RL loss (PPO-ptx).

InstructGPT (Ouyang et al. 2022, "Training language models to follow instructions with human feedback",
arXiv 2203.02155, eq. 2) adds gamma * E_{x ~ D_pretrain}[log pi(x)] to the PPO objective so that RL does
not wear away what pretraining gave. Here D is the SFT warm start's demonstrations (read from the
ledger) and what RL wears away is the output format: REINFORCE on the action's mark raised the NLL of
the rest of the response (thought, memory, JSON: the scaffold) 7x in `bench/decision_only.py`, which
broke the format in full runs; the same gradient plus this term on the scaffold kept its NLL where it
started while the decision learned at about the same rate (bench/RESULTS.md, "Where the `colour`
bound is").

Tokens (`tokens`):
- `scaffold`: every response token except the action's values (`model.response`, the tokens
  `tokens.pg="action"` trains; with `tokens.pg="arguments"` the kind is scaffold too): the
  demonstration's decision is the oracle's, which RL is there to change, so cloning it would pull
  against the reward;
- `all`: every response token (plain SFT on the demonstrations).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

AnchorTokens = Literal["scaffold", "all"]


def anchor_mask(
    tokens: AnchorTokens,
    n: int,  # response tokens of the demonstration step
    decision_mask: Callable[[], list[bool]],  # the action's value tokens (`model.response`), computed on demand
    device: torch.device | None = None,
) -> torch.Tensor:
    """[n] bool: the demonstration's tokens the anchor clones."""
    if tokens == "all":
        return torch.ones(n, dtype=torch.bool, device=device)
    if tokens == "scaffold":
        return ~torch.tensor(decision_mask(), dtype=torch.bool, device=device)  # [n]
    raise ValueError(f"unknown anchor tokens {tokens!r}")


def anchor_loss(
    logprobs: torch.Tensor,  # [n] log pi_theta of one demonstration step's response tokens, differentiable
    mask: torch.Tensor,  # [n] bool: the tokens cloned (`anchor_mask`)
) -> torch.Tensor:
    """Mean NLL over the selected tokens (0-d); 0 where none is selected. A step's mean, not its sum, so
    a long demonstration weighs what a short one does (as `bench/decision_only.py`'s anchored arm had it)."""
    return -torch.where(mask, logprobs, 0.0).sum() / mask.sum().clamp(min=1)
