"""Which response tokens carry the policy gradient, and which the KL penalty to the reference.

In `{"thought": ..., "memory": {...}, "action": {"kind": "click", "mark": D}}` only the action's values
decide the reward (in the boxes task, the one digit D of about 37 tokens). Spread over every token, the
advantage adds zero-mean noise on the other 36 that Adam turns into lr-sized steps: the format wear
that a larger budget made into collapse (bench/RESULTS.md). The options:

- `pg="action"`: the policy gradient on the action's value tokens only (`model.response`); in a
  response that does not parse, on the token where it broke. Pushing down every token of a broken
  response instead would push down the well-formed prefix it shares with every good response, which
  no positive advantage pushes back up once good responses carry the gradient on their action alone:
  measured, that wore the format down to 53-65% invalid actions within 7 versions (bench/RESULTS.md).
- `pg="arguments"`: the same without the action's `kind`, where a task's kind never changes (every
  boxes action is a click): the kind is then scaffold, which the SFT anchor holds. With the kind in
  the gradient, `colour` runs at lr 1e-3 wrote the colour word into it (`"kind": blue box"`) and lost
  their format. Measured, it moves that failure and does not cure it: with the kind held, the mark's
  digits lost their mass instead (bench/RESULTS.md); lr 3e-4 is what has held.
- `pg="entropy"`: on the `entropy_share` of each step's tokens where the policy is least certain (Wang
  et al. 2025, "Beyond the 80/20 Rule", arXiv 2506.01939: RLVR's gains come from the high-entropy
  forking tokens; training on the top 20% alone matched or beat all tokens).
- `kl="scaffold"`: the KL penalty only on the tokens that carry no policy gradient, so the reference
  anchors the format while the decision is free to move.
- `kl="action"`: the KL penalty only on the policy-gradient tokens, the complement, for use with the SFT
  anchor (`trainer.losses.anchor`), which holds every other token but leaves the decision's
  distribution free to sharpen from noise alone (measured: a `colour` run whose groups turned
  all-equal without following the colour word, bench/RESULTS.md).

With `pg` other than `all`, a step's objective is normalised by its selected tokens (|o| in
`trainer.losses.grpo` becomes their count), so each step keeps its whole weight in the batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch


@dataclass(frozen=True)
class TokenSelection:
    pg: Literal["all", "action", "arguments", "entropy"] = "all"
    """Tokens of the policy-gradient objective: every response token, the action's values, its values
    but the kind, or the highest-entropy `entropy_share` of each step's."""
    entropy_share: float = 0.2
    """With `pg="entropy"`: the share of each step's tokens kept (at least one)."""
    kl: Literal["all", "scaffold", "action"] = "all"
    """Tokens of the KL penalty (`kl_coef`): every token, those outside the policy gradient, or those of
    the policy gradient only."""

    @property
    def kind_decides(self) -> bool:
        """Whether the action's kind is part of the decision (`model.response.decision_token_mask`'s `kind`)."""
        return self.pg != "arguments"

    def __post_init__(self) -> None:
        if not 0 < self.entropy_share <= 1:
            raise ValueError(f"tokens.entropy_share must be in (0, 1], not {self.entropy_share}")
        if self.kl == "scaffold" and self.pg == "all":
            raise ValueError(
                'tokens.kl="scaffold" keeps the KL off the policy-gradient tokens: with tokens.pg="all" '
                "that is every token; choose tokens.pg action or entropy"
            )


def select_tokens(
    config: TokenSelection,
    entropy: torch.Tensor,  # [n] the policy's entropy at each response token (detached)
    decision_mask: Callable[[], list[bool]],  # the decision's tokens (`model.response`, `kind_decides`), on demand
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pg_mask [n], kl_mask [n]) of one step's response tokens."""
    n = entropy.shape[0]
    every = torch.ones(n, dtype=torch.bool, device=entropy.device)  # [n]
    if config.pg == "all":
        return every, every
    if config.pg in ("action", "arguments"):
        pg = torch.tensor(decision_mask(), dtype=torch.bool, device=entropy.device)  # [n]
    else:
        k = max(1, math.ceil(config.entropy_share * n))
        pg = torch.zeros(n, dtype=torch.bool, device=entropy.device)
        pg[torch.topk(entropy, k).indices] = True  # [n]
    return pg, {"all": every, "scaffold": ~pg, "action": pg}[config.kl]
