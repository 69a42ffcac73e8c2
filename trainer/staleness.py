"""Bounded staleness: which groups may be trained, and how many may be dispatched (AReaL's rule).

Version filter (the online batch builder and replay's re-batching use this one function): a group is
admissible at trainer version v iff every token's behaviour version is >= v - eta. AsyncWebRL: eta = 2;
measured off-policy gap mean ~1.5, max ~2.0.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable


def admissible(behaviour_versions: Iterable[int], current_version: int, eta: int) -> bool:
    """True iff no token of the group was sampled more than `eta` versions ago."""
    return min(behaviour_versions, default=current_version) >= current_version - eta


class StalenessBudget:
    """How many more task groups the dispatcher may send without exceeding the staleness bound.

        capacity = (eta + current_version + 1) * groups_per_update - groups_dispatched

    Every group dispatched now will be trained at version >= current_version, so once
    (eta + v + 1) * groups_per_update groups exist, any further group could only be consumed after the
    trainer has moved more than eta versions past the version it would be sampled with. Fed by the
    dispatcher (`try_dispatch`) and by the trainer's events: `PolicyVersionPublished` (`version`) and
    `GroupDropped` (`rejected`). As in AReaL, groups the trainer rejects do not count as dispatched:
    otherwise a run of all-equal-reward groups would exhaust the budget before the trainer could
    fill a batch, and the run would stall forever.
    Thread-safe: the dispatcher loop and the event consumer run on different threads.
    """

    def __init__(self, eta: int, groups_per_update: int, current_version: int = 0, groups_dispatched: int = 0):
        if eta < 0 or groups_per_update < 1:
            raise ValueError("eta >= 0 and groups_per_update >= 1 are required")
        self.eta, self.groups_per_update = eta, groups_per_update
        self._version, self._dispatched = current_version, groups_dispatched
        self._lock = threading.Lock()

    def capacity(self) -> int:
        with self._lock:
            return (self.eta + self._version + 1) * self.groups_per_update - self._dispatched

    def try_dispatch(self, n: int = 1) -> bool:
        """Reserve `n` groups if the budget allows; the caller dispatches only on True."""
        with self._lock:
            if (self.eta + self._version + 1) * self.groups_per_update - self._dispatched < n:
                return False
            self._dispatched += n
            return True

    def version(self, v: int) -> None:
        """A new policy version was published (versions only move forward)."""
        with self._lock:
            self._version = max(self._version, v)

    def rejected(self, n: int = 1) -> None:
        """The trainer dropped `n` dispatched groups: they no longer hold budget."""
        with self._lock:
            self._dispatched -= n

    @property
    def current_version(self) -> int:
        with self._lock:
            return self._version
