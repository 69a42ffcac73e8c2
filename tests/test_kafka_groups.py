"""`pipeline.kafka_groups` against the real local broker: a group leader's LeaveGroup between its
JoinGroup and its SyncGroup wedges the group for good (the control, with raw requests), a leader that
goes silent instead is expired and the group recovers, and this project's consumers leave silently;
a join that outlives the `poll()` that started it is finished by the next one.

Budgeted in rounds (JoinGroup/SyncGroup exchanges), not seconds."""

from __future__ import annotations

import re
import time
import uuid

import pytest
from kafka import KafkaAdminClient, KafkaConsumer
from kafka.admin import NewTopic
from kafka.coordinator.base import BaseCoordinator
from kafka.coordinator.consumer import ConsumerCoordinator
from kafka.protocol.consumer.group import JoinGroupRequest, LeaveGroupRequest, SyncGroupRequest

from pipeline import kafka_groups
from pipeline.bus import EventProducer, create_topics, group_name, topic_name
from pipeline.consumer import EventConsumer
from pipeline.topics import ROLLOUT

REBALANCE_IN_PROGRESS, MEMBER_ID_REQUIRED = 27, 79
ROUNDS = 4
"""A rebalance round waits up to its members' session (6 s); the silent leader is gone after one."""


class RawGroup:
    """Members of one consumer group as raw protocol requests, so the test decides each step's order."""

    def __init__(self, bootstrap: str):
        self.group = f"raw-{uuid.uuid4().hex[:8]}"
        self.admin = KafkaAdminClient(bootstrap_servers=bootstrap)
        self.manager = self.admin._manager
        self.coordinator = self.manager.run(self.admin._find_coordinator_ids, [self.group])[self.group]

    def send(self, request):
        return self.manager.run(lambda: self.manager.send(request, node_id=self.coordinator))

    def join_all(self, *member_ids: str) -> list:
        """Every member's JoinGroup at once: the broker answers when all have joined."""

        async def together():
            futures = [self.manager.send(self._join(m), node_id=self.coordinator) for m in member_ids]
            return [await f for f in futures]

        return self.manager.run(together)

    def member(self) -> str:
        response = self.send(self._join(""))
        assert response.error_code == MEMBER_ID_REQUIRED
        return response.member_id

    def sync(self, generation: int, member_id: str, leader: bool):
        assignments = (
            [SyncGroupRequest.SyncGroupRequestAssignment(member_id=member_id, assignment=b"a")] if leader else []
        )
        return self.send(
            SyncGroupRequest(
                group_id=self.group,
                generation_id=generation,
                member_id=member_id,
                group_instance_id=None,
                protocol_type="consumer",
                protocol_name="range",
                assignments=assignments,
                max_version=5,
            )
        )

    def leave(self, member_id: str):
        return self.send(
            LeaveGroupRequest(
                group_id=self.group,
                member_id=member_id,
                max_version=5,
                members=[LeaveGroupRequest.MemberIdentity(member_id=member_id, group_instance_id=None, reason=None)],
            )
        )

    def _join(self, member_id: str):
        return JoinGroupRequest(
            group_id=self.group,
            session_timeout_ms=6000,
            rebalance_timeout_ms=20000,
            member_id=member_id,
            group_instance_id=None,
            protocol_type="consumer",
            protocols=[JoinGroupRequest.JoinGroupRequestProtocol(name="range", metadata=b"m")],
            max_version=7,
        )

    def leader_departs_mid_rebalance(self, depart) -> list[tuple[int, str]]:
        """A leads a stable group; B joins; A departs (`depart(a)`) before its SyncGroup. Then B syncs and
        rejoins for up to `ROUNDS` rounds: each round's (SyncGroup error, leader it was told: A/B)."""
        a = self.member()
        (first,) = self.join_all(a)
        assert first.leader == a and self.sync(first.generation_id, a, leader=True).error_code == 0
        b = self.member()
        _, joined = self.join_all(a, b)
        assert joined.leader == a  # the rebalance's leader, which now departs before its SyncGroup
        depart(a)
        rounds = []
        for _ in range(ROUNDS):
            error = self.sync(joined.generation_id, b, leader=joined.leader == b).error_code
            rounds.append((error, "B" if joined.leader == b else "A"))
            if error == 0:
                break
            (joined,) = self.join_all(b)
        return rounds


@pytest.fixture
def raw(stack):
    group = RawGroup(stack.settings().kafka_bootstrap)
    yield group
    group.admin.close()


def test_control_a_leader_that_sends_leave_group_mid_rebalance_wedges_the_group(raw):
    """The broker's bug, which `pipeline.kafka_groups` works around: once this passes no more (the
    group recovers), the broker is fixed and the workaround can go."""
    rounds = raw.leader_departs_mid_rebalance(lambda a: raw.leave(a))
    assert rounds == [(REBALANCE_IN_PROGRESS, "A")] * ROUNDS  # the departed leader, named in every round


def test_a_leader_that_goes_silent_is_expired_and_the_group_recovers(raw):
    rounds = raw.leader_departs_mid_rebalance(lambda a: None)
    assert rounds[-1] == (0, "B") and len(rounds) <= 3


def _members(admin: KafkaAdminClient, group: str) -> list[str]:
    admin._process_acl_operations = lambda described: described  # kafka-python cannot parse Tansu's ACL bits
    return [m["member_id"] for m in admin.describe_groups([group])[group]["members"]]


@pytest.mark.parametrize("leaves", ["by expiry", "library's LeaveGroup"])
def test_this_projects_consumers_leave_by_expiry(settings, monkeypatch, leaves):
    """Closing an `EventConsumer` sends no LeaveGroup: the broker still lists it as a member right
    after, until its session expires. The control, the library's own close, is gone at once."""
    if leaves != "by expiry":
        monkeypatch.setattr(BaseCoordinator, "maybe_leave_group_async", kafka_groups._library_leave)
    create_topics(settings)
    group = f"leave-{uuid.uuid4().hex[:8]}"
    producer = EventProducer(settings, client_id="leave-test")
    consumer = EventConsumer(settings, group, [ROLLOUT], producer)
    for _ in range(60):
        consumer.poll(timeout_ms=500)
        if consumer._kafka.assignment():
            break
    assert consumer._kafka.assignment(), "the consumer joined its group"
    admin = KafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
    try:
        consumer.close()
        members = _members(admin, group_name(settings, group))
        assert len(members) == (1 if leaves == "by expiry" else 0)
    finally:
        admin.close()
        producer.close()


@pytest.mark.parametrize("pending", ["counts as needed", "library's"])
def test_a_join_that_outlives_its_poll_is_finished_by_the_next(settings, monkeypatch, pending):
    """A topic the member subscribes to appears, so the leader must rejoin to assign it; every `poll()`
    gives up before the join answers (timeout 0, as a loaded machine's short polls did after a broker
    restart that brought a topic back with other partitions). With a pending join counted as needed the
    next polls finish it and the member gets the new topic's partitions; the control, kafka-python's
    own `need_rejoin`, forgets the join once the leader's assignment snapshot catches up with the
    metadata, and the member stays mid-rebalance, fetching nothing, however long it polls."""
    create_topics(settings)
    rollout, late = topic_name(settings, ROLLOUT), f"{settings.topic_prefix}.late-{uuid.uuid4().hex[:8]}"
    consumer = KafkaConsumer(
        bootstrap_servers=settings.kafka_bootstrap,
        group_id=f"join-{uuid.uuid4().hex[:8]}",
        enable_auto_commit=False,
        allow_auto_create_topics=False,
        session_timeout_ms=6000,
        heartbeat_interval_ms=1000,
        metadata_max_age_ms=500,
    )
    admin = KafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
    try:
        consumer.subscribe(pattern=f"^({re.escape(rollout)}|{re.escape(late)})$")  # no client asks for `late`
        for _ in range(60):
            consumer.poll(timeout_ms=500)
            if consumer.assignment():
                break
        assert {tp.topic for tp in consumer.assignment()} == {rollout}, "the consumer joined its group"
        # Only now the control's rule: under load the library can forget the first join as well.
        if pending != "counts as needed":
            monkeypatch.setattr(ConsumerCoordinator, "need_rejoin", kafka_groups._library_need_rejoin)
        admin.create_topics([NewTopic(late, num_partitions=2, replication_factor=1)])
        for _ in range(200):  # the metadata names the new topic: a rejoin starts, and outlives each poll
            consumer.poll(timeout_ms=0)
            time.sleep(0.02)
        for _ in range(ROUNDS * 6):  # then polls as long as a few sessions, each of 1 s
            consumer.poll(timeout_ms=1000)
            if late in {tp.topic for tp in consumer.assignment()}:
                break
        topics, joining = {tp.topic for tp in consumer.assignment()}, consumer._coordinator.rejoining
    finally:
        consumer.close()
        admin.close()
    if pending == "counts as needed":
        assert topics == {rollout, late} and not joining
    elif topics == {rollout, late}:
        # The library's bug needs its join to outlive every one of the 200 polls; on a loaded machine
        # the join can also be answered within one, and then there is nothing for the control to show.
        pytest.skip("the library's join was answered within a poll this time: the control did not reproduce")
    else:
        assert topics == {rollout} and joining, "the control should have stayed mid-rebalance"
