"""Consumer-group members leave by session expiry, never by LeaveGroup.

Tansu 0.6.0 (the local broker) keeps a leader that sends LeaveGroup between its JoinGroup and its
SyncGroup as the group's leader: every member's SyncGroup then fails with REBALANCE_IN_PROGRESS, every
JoinGroup names the departed leader again, and the group never completes another rebalance, even once
empty (until the broker restarts). A member that just stops is expired after its session (6 s here,
`pipeline.consumer`) and the next JoinGroup elects a live leader. Measured under load: 3 of 8 graceful
leaves during a rebalance wedged the group, 0 of 15 kills; made deterministic with raw requests in
`tests/test_kafka_groups.py`. A CI chaos soak lost its ledger writers this way (a guest writer that left
during a rebalance): every writer waited to join for the rest of the run.

The cost: a member that stops hands its partitions on after its session timeout instead of at once.
Apache Kafka (the compose stack) is not affected, and pays the same few seconds.

Remove it once the broker is fixed (`tests/test_kafka_groups.py`'s control then fails).

A second fix, of kafka-python 3.0.12 itself: a rejoin pending counts as a rejoin needed, as in the Java
client (`rejoinNeededOrPending`). A rejoin that metadata or the subscription asked for stops being
"needed" as soon as its JoinGroup is sent (the leader's assignment snapshot and the joined
subscription are updated then), and a `poll()` whose time ran out before the join finished leaves it
in flight; the next `poll()` then found nothing needed and never finished it: the member stayed
mid-rebalance, every partition pending revocation, fetching nothing, for good. A CI run lost a
consumer this way after a broker restart (the topic came back with other partitions); made
deterministic in `tests/test_kafka_groups.py` with polls shorter than a join.
"""

from __future__ import annotations

from kafka.coordinator.base import BaseCoordinator
from kafka.coordinator.consumer import ConsumerCoordinator

_library_leave = BaseCoordinator.maybe_leave_group_async
_library_need_rejoin = ConsumerCoordinator.need_rejoin


def _needed_or_pending(self: ConsumerCoordinator) -> bool:
    # `rejoining`: set once the partitions were revoked for a join, cleared when its assignment is applied
    return bool(self.rejoining) or _library_need_rejoin(self)


async def _expire_instead(self: BaseCoordinator, reason=None, timeout_ms=None) -> None:
    # What the library does after its LeaveGroup request, without the request: forget the membership
    # locally, so a consumer that goes on polling joins again as a new member.
    self.reset_generation()


def install() -> None:
    """Every consumer group member of this process leaves by expiry and finishes every join it
    started (idempotent)."""
    BaseCoordinator.maybe_leave_group_async = _expire_instead
    ConsumerCoordinator.need_rejoin = _needed_or_pending
