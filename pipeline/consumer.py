"""The consuming side of the event bus: a consumer-group member that never loses a message, and readers
that take a topic from its start to its end without joining a group.

Offsets are committed after processing, and every consumer is idempotent by `event_id` (see
`pipeline.bus` for the producer's half). Messages that do not decode into a valid event for their topic
go to the dead-letter topic with the reason in headers, and the consumer moves on.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kafka import ConsumerRebalanceListener, KafkaConsumer
from kafka.errors import (
    CommitFailedError,
    IllegalGenerationError,
    KafkaConnectionError,
    KafkaError,
    KafkaTimeoutError,
    RebalanceInProgressError,
    UnknownMemberIdError,
)
from kafka.structs import OffsetAndMetadata, TopicPartition
from pydantic import ValidationError

from pipeline import health
from pipeline.bus import EventProducer, Headers, group_name, topic_name
from pipeline.hashing import sha256_hex
from pipeline.settings import StackSettings
from pipeline.topics import DEAD_LETTER, Topic, accepts
from schemas import Event, decode_event

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Delivered:
    """A decoded event and where it came from."""

    event: Event
    topic: str
    partition: int
    offset: int


OnAssigned = Callable[[set[tuple[str, int]], str | None], dict[tuple[str, int], int]]
"""Given newly assigned (topic, partition)s and the broker's cluster id: per partition, the offset below
which records are already processed (skipped if delivered)."""


class _Assigned(ConsumerRebalanceListener):
    def __init__(
        self,
        consumer: EventConsumer,
        callback: OnAssigned | None,
        on_revoked: Callable[[set[tuple[str, int]]], None] | None,
    ):
        self.consumer, self.callback, self.revoked = consumer, callback, on_revoked

    def on_partitions_revoked(self, revoked) -> None:
        for tp in revoked:  # what we polled there is no longer ours to commit
            self.consumer._polled.pop((tp.topic, tp.partition), None)
        # Before this member rejoins, so the group hands the partitions to no one until it returns.
        # Which ones: a member drops what it holds of them (the ledger writer's batch being collected).
        if self.revoked is not None and revoked:
            self.revoked({(tp.topic, tp.partition) for tp in revoked})

    def on_partitions_assigned(self, assigned) -> None:
        if self.callback is not None and assigned:
            # runs on the client's IO thread: no blocking consumer call here (a seek would need the
            # committed offset), so records below the floor are dropped in `poll()` instead
            self.consumer._floors.update(
                self.callback({(tp.topic, tp.partition) for tp in assigned}, self.consumer.cluster_id)
            )


class EventConsumer:
    """A consumer-group member: `poll()` returns valid events, `commit()` after processing them.

    Offsets cover everything `poll()` returned, including dead-lettered messages; those are
    acknowledged by the dead-letter topic before `poll()` returns, so a commit can never lose one.
    """

    def __init__(
        self,
        settings: StackSettings,
        group_id: str,
        topics: Iterable[Topic],
        producer: EventProducer,
        client_id: str = "awrl",
        on_assigned: OnAssigned | None = None,
        decode: Callable[[bytes], Event] = decode_event,
        on_revoked: Callable[[], None] | None = None,
    ):
        """`on_assigned`: called inside `poll()` with the (topic, partition)s the group has just given
        this member, before any of their records are returned; records below the offsets it returns
        are dropped (counted in `skipped`). `decode`: `decode_event`, or a decoder that accepts and
        rejects exactly the same messages (the ledger's `schemas.columnar.decode_columnar`).
        `on_revoked`: called when the group takes partitions away, before this member rejoins (on the
        client's IO thread: it may wait for this process's own work, not call the consumer)."""
        self.settings = settings
        self._decode = decode
        self._topics = {topic_name(settings, t): t for t in topics}
        self._dead_letters = producer
        self.dead_lettered = 0
        self._rejected: list[Rejected] = []
        self._cluster_id: str | None = None
        self.broker_replacements = 0
        """Times the broker came back with a new cluster id (its log lost) and we re-read from the start."""
        self.failed_commits = 0
        self._confirmed: dict[int, object] = {}
        """The connections the cluster id was last read over, by id (held, so that no id is reused)."""
        self.unconfirmed = 0
        """Records fetched over a new connection whose broker could not be identified yet: fetched again."""
        # Short session timeout: the group forms in ~3 s instead of ~23 s (measured against the
        # local broker); heartbeats keep a slow handler's member alive.
        self._kafka = KafkaConsumer(
            bootstrap_servers=settings.kafka_bootstrap,
            group_id=group_name(settings, group_id),
            client_id=client_id,
            enable_auto_commit=False,
            allow_auto_create_topics=False,  # as the producer's
            auto_offset_reset="earliest",
            session_timeout_ms=6000,
            heartbeat_interval_ms=1000,
            max_poll_records=1000,
            max_partition_fetch_bytes=16 * 1024 * 1024,
        )
        self._floors: dict[tuple[str, int], int] = {}
        self._polled: dict[tuple[str, int], int] = {}
        """Per partition, the offset after the last record `poll()` has returned or dropped."""
        self.skipped = 0
        """Records dropped below an `on_assigned` floor."""
        self._kafka.subscribe(list(self._topics), listener=_Assigned(self, on_assigned, on_revoked))

    @property
    def cluster_id(self) -> str | None:
        return getattr(self._kafka._client.cluster, "cluster_id", None)  # no public accessor

    @property
    def polled_cluster(self) -> str | None:
        """The cluster id the records `poll()` returned count in: the one seen at each poll, which
        drops its records when it finds the broker replaced. (`cluster_id`, the client's metadata
        now, can already name a new broker while records of the old one are being handled.)"""
        return self._cluster_id

    def poll(self, timeout_ms: int = 1000, max_records: int | None = None) -> list[Delivered]:
        health.beat()
        try:
            batches = self._kafka.poll(timeout_ms=timeout_ms, max_records=max_records)
        except (KafkaTimeoutError, KafkaConnectionError) as exc:
            # the client's IO loop wedged (kafka_waits), or the broker is down mid-restart: poll again
            # (uncaught, the connection error killed a ledger writer's thread: seen in the broker-kills test)
            log.warning("poll: %s", exc)
            return []
        if self._broker_replaced():
            return []
        if any(batches.values()) and not self._same_broker(batches):
            return []
        out: list[Delivered] = []
        rejected = []
        for tp, records in batches.items():
            topic = self._topics[tp.topic]
            floor = self._floors.get((tp.topic, tp.partition), 0)
            if records:
                self._polled[(tp.topic, tp.partition)] = records[-1].offset + 1
            for r in records:
                if r.offset < floor:
                    self.skipped += 1
                    continue
                reason = _rejection(topic, r.value, self._decode)
                if isinstance(reason, Event):
                    out.append(Delivered(reason, tp.topic, tp.partition, r.offset))
                else:
                    rejected.append(self._dead_letter(r, reason))
        for f in rejected:
            f.get(timeout=60)
        self.dead_lettered += len(rejected)
        return out

    def _broker_replaced(self) -> bool:
        """Whether the cluster id changed: a broker that lost its log (Tansu in memory, restarted with a
        new id) numbers offsets from 0 again, and a position from before could skip new events. Read
        every partition again from the start instead (consumers are idempotent by event id)."""
        cluster_id = self.cluster_id
        if cluster_id is None or cluster_id == self._cluster_id:
            return False
        replaced, self._cluster_id = self._cluster_id is not None, cluster_id
        if replaced:
            self._floors.clear()  # offsets of the lost log: the new one numbers from 0 again
            self._polled.clear()
        if replaced and self._kafka.assignment():
            self._kafka.seek_to_beginning(*self._kafka.assignment())
        self.broker_replacements += replaced
        return replaced

    def _same_broker(self, batches) -> bool:
        """Whether records fetched over a connection opened since the cluster id was last read come from
        the broker that id names. The fetcher reconnects on its own and can fetch from a replaced broker
        at the old log's position before the client's metadata names the new broker (seen under load):
        such records would skip the new log's first ones. The cluster id is read again first; records
        that cannot be placed are fetched again."""
        # no public accessor; copied at once (the IO thread changes it)
        connections = {id(c): c for c in self._kafka._manager._conns.copy().values()}
        if connections.keys() <= self._confirmed.keys():
            return True
        try:
            for _ in range(2):  # one already under way may have been asked of the broker before
                update = self._kafka._cluster.request_update()
                self._kafka._net.run(self._kafka._manager.wait_for, update, 10_000)
        except KafkaError as exc:
            log.warning("could not read the cluster id to place fetched records (fetching them again): %s", exc)
            self.unconfirmed += sum(map(len, batches.values()))
            for tp, records in batches.items():
                if records:
                    self._kafka.seek(tp, records[0].offset)
            return False
        self._confirmed = connections
        return not self._broker_replaced()

    def take_rejected(self) -> list[Rejected]:
        """The messages dead-lettered since the last call (the ledger keeps them durably)."""
        out, self._rejected = self._rejected, []
        return out

    def _dead_letter(self, record, reason: str):
        # One id per message of one log: sent again after a crash, it is the same dead letter.
        dlq_id = sha256_hex(f"{self._cluster_id}/{record.topic}/{record.partition}/{record.offset}".encode())[:32]
        self._rejected.append(
            Rejected(dlq_id, reason, record.topic, record.partition, record.offset, record.key, record.value or b"")
        )
        headers: Headers = [
            ("reason", reason[:2000].encode()),
            ("source_topic", record.topic.encode()),
            ("source_partition", str(record.partition).encode()),
            ("source_offset", str(record.offset).encode()),
            *[(f"source_{k}", v) for k, v in (record.headers or [])],
        ]
        return self._dead_letters.send_raw(DEAD_LETTER, record.value or b"", record.key, headers, dlq_id)

    def polled(self) -> dict[tuple[str, int], int]:
        """What `commit()` would commit now: per partition, the offset after the last record `poll()`
        returned (valid or dead-lettered) or dropped. Commit it later with `commit(offsets)` to
        acknowledge exactly what was polled so far."""
        return dict(self._polled)

    def commit(self, offsets: dict[tuple[str, int], int] | None = None) -> bool:
        """Commit every position `poll()` reached, or exactly `{(topic, partition): next_offset}`.

        False when the group no longer knows this member (a rebalance, a restarted broker): the
        messages will be delivered again, which every consumer here absorbs by event id."""
        if offsets is not None:
            # Never past what `poll()` handed out in this log: offsets computed before the broker was
            # replaced count in the lost log, and the group's next reader would skip that many records.
            offsets = {tp: min(o, self._polled[tp]) for tp, o in offsets.items() if tp in self._polled}
            if not offsets:
                return False
        try:
            if offsets is None:
                self._kafka.commit()
            else:
                self._kafka.commit(
                    {TopicPartition(t, p): OffsetAndMetadata(o, "", -1) for (t, p), o in offsets.items()}
                )
        except (
            CommitFailedError,
            RebalanceInProgressError,
            IllegalGenerationError,
            UnknownMemberIdError,
            KafkaConnectionError,
            KafkaTimeoutError,
        ):
            # kafka-python 3 raises the broker's own error when a rebalance starts mid-commit (a second
            # ledger writer joining), and a connection error when the broker is down mid-commit (its
            # restart): uncaught, either killed the running writer (seen in full test runs)
            self.failed_commits += 1
            return False
        return True

    @property
    def assigned(self) -> bool:
        """Whether the group has given this member partitions yet (joining takes a few seconds)."""
        return bool(self._kafka.assignment())

    def assignment(self) -> set[tuple[str, int]]:
        """The (topic, partition)s this member holds now."""
        return {(tp.topic, tp.partition) for tp in self._kafka.assignment()}

    @property
    def owns_all_partitions(self) -> bool:
        """Whether this member holds every partition of its topics. After a member crashes, the group
        may first hand out partitions to the survivor and the dead member alike, and only rebalance
        again once the dead member's session expires; "caught up" means nothing until then."""
        total = sum(len(self._kafka.partitions_for_topic(t) or ()) for t in self._topics)
        return total > 0 and len(self._kafka.assignment()) == total

    def pause(self) -> None:
        """Stop fetching (the member stays in the group while `poll()` keeps being called)."""
        self._kafka.pause(*self._kafka.assignment())

    def resume(self) -> None:
        self._kafka.resume(*self._kafka.paused())

    def close(self) -> None:
        self._kafka.close(autocommit=False)


def _rejection(topic: Topic, value: bytes | None, decode: Callable[[bytes], Event] = decode_event) -> Event | str:
    """The decoded event, or the reason it cannot be accepted on `topic`."""
    if value is None:
        return "empty message (null value)"
    try:
        event = decode(value)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "<root>"
        return f"invalid event: {first['type']} at {where}: {first['msg']} ({exc.error_count()} errors)"
    except (UnicodeDecodeError, ValueError) as exc:
        return f"undecodable: {exc}"
    if not accepts(topic, event):
        return f"{event.event_type} does not belong on topic '{topic.name}'"
    return event


def read_records(settings: StackSettings, topic: Topic, timeout_s: float = 30.0) -> list:
    """Every record of `topic` (raw `ConsumerRecord`s) from the start up to its current end, without
    joining a group.

    "The end" is the high watermark that fetch responses carry, not `end_offsets()`: the local broker
    answers ListOffsets with the last batch's base offset + 1, so a reader that trusted it would stop
    short of every record but the first of a final multi-record batch."""
    kafka = KafkaConsumer(
        bootstrap_servers=settings.kafka_bootstrap,
        client_id="awrl-reader",
        enable_auto_commit=False,
        max_partition_fetch_bytes=16 * 1024 * 1024,
    )
    try:
        name = topic_name(settings, topic)
        partitions = [TopicPartition(name, p) for p in sorted(kafka.partitions_for_topic(name) or ())]
        kafka.assign(partitions)
        kafka.seek_to_beginning(*partitions)
        records: list = []
        deadline = time.monotonic() + timeout_s
        while not all(_at_end(kafka, tp) for tp in partitions):
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading {name} did not reach its end in {timeout_s} s")
            for batch in kafka.poll(timeout_ms=500).values():
                records += batch
        return records
    finally:
        kafka.close()


@dataclass(frozen=True)
class Rejected:
    """A message dead-lettered by a consumer, as the ledger keeps it (`_dead_letters/`)."""

    dead_letter_id: str
    reason: str
    source_topic: str
    source_partition: int
    source_offset: int
    key: bytes | None
    value: bytes


@dataclass(frozen=True)
class DeadLetter:
    """One message the consumers refused, as the dead-letter topic keeps it."""

    reason: str
    source_topic: str
    run_id: str | None
    """The run the message names, where its JSON has a `run_id`; None when it cannot be read."""


def dead_letters(settings: StackSettings, timeout_s: float = 10.0) -> list[DeadLetter]:
    """Every message on the dead-letter topic, with the reason the consumer gave. A ConnectionError at
    once when no broker listens (the client would retry for half a minute)."""
    import socket

    host, _, port = settings.kafka_bootstrap.split(",")[0].rpartition(":")
    socket.create_connection((host, int(port)), timeout=2).close()
    out = []
    for r in read_records(settings, DEAD_LETTER, timeout_s):
        headers = {k: v.decode(errors="replace") for k, v in r.headers or []}
        out.append(DeadLetter(headers.get("reason", "?"), headers.get("source_topic", "?"), message_run_id(r.value)))
    return out


def message_run_id(value: bytes | None) -> str | None:
    """The run a refused message names, where its JSON has a string `run_id`; None when it cannot be read."""
    try:
        run_id = json.loads(value or b"").get("run_id")
    except (ValueError, AttributeError):
        return None
    return run_id if isinstance(run_id, str) else None


def _at_end(kafka: KafkaConsumer, tp: TopicPartition) -> bool:
    highwater = kafka.highwater(tp)  # None until a fetch for `tp` has come back
    return highwater is not None and kafka.position(tp) >= highwater


def read_log(settings: StackSettings, topic: Topic, timeout_s: float = 30.0) -> list[Event]:
    """Every valid event on `topic` from the start up to its current end (used to fold state on
    start-up, e.g. the trainer's last published version)."""
    return [e for r in read_records(settings, topic, timeout_s) if isinstance(e := _rejection(topic, r.value), Event)]
