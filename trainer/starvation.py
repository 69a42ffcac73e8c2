"""A starving run: every group since the last update dropped as uninformative, and why.

Dynamic sampling drops a group whose rewards are all equal. When every group is dropped the trainer
makes no version and the run idles to its budget; this names the cause from the dropped groups'
own rewards and steps, so the trainer's log and the run's live status can say it, and a run can stop
after `patience` such groups instead of idling. The trainer and the run both fold `GroupDropped`
events through it, so they say the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas import GroupDropped

INVALID_OUTPUT = 0.5
"""A run starves on invalid output when at least this share of the dropped groups' actions could not
be parsed (the format is lost: no reward can reach the policy however the task is drawn)."""


@dataclass
class Starvation:
    """Uninformative groups dropped since the trainer last trained (`reset` on each new version)."""

    groups: int = 0
    failed: int = 0
    """Of `groups`, those where every trajectory failed."""
    succeeded: int = 0
    """Of `groups`, those where every trajectory succeeded."""
    invalid_share_sum: float = 0.0

    def add(self, event: GroupDropped) -> None:
        if event.reason != "uninformative":
            return
        self.groups += 1
        if event.mean_reward is not None:
            self.failed += event.mean_reward <= 0
            self.succeeded += event.mean_reward > 0
        self.invalid_share_sum += event.invalid_share or 0.0

    def reset(self) -> None:
        self.groups = self.failed = self.succeeded = 0
        self.invalid_share_sum = 0.0

    @property
    def invalid_share(self) -> float:
        return self.invalid_share_sum / max(self.groups, 1)

    @property
    def cause(self) -> str:
        """`invalid output`, `all failed`, `all succeeded` (or `mixed` when neither dominates)."""
        if self.groups and self.invalid_share >= INVALID_OUTPUT:
            return "invalid output"
        if self.failed and not self.succeeded:
            return "all failed"
        if self.succeeded and not self.failed:
            return "all succeeded"
        return "mixed"

    def message(self) -> str:
        return (
            f"starving: the last {self.groups} groups were all dropped as uninformative ({self.cause}: "
            f"{self.failed} all failed, {self.succeeded} all succeeded, "
            f"{self.invalid_share:.0%} of their actions invalid)"
        )
