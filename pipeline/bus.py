"""The event bus over kafka-python: topic and group names, the topics themselves, and an idempotent
producer that never reports a send the broker did not acknowledge.

Exactly-once does not come from Kafka transactions here (the local broker does not isolate aborted
ones); it comes from at-least-once delivery (acks=all, commit after processing) plus consumers that are
idempotent by `event_id`. The consuming side (the group member, the dead-letter topic, the readers of a
whole topic) is `pipeline.consumer`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from contextlib import suppress
from pathlib import Path

from kafka import KafkaProducer
from kafka.admin import KafkaAdminClient, NewTopic
from kafka.errors import KafkaError, TopicAlreadyExistsError

from pipeline import kafka_groups, kafka_waits
from pipeline.outbox import Outbox, Pending, Reconciler
from pipeline.receipts import ReceiptReader
from pipeline.s3 import ledger_filesystem
from pipeline.settings import StackSettings
from pipeline.topics import ALL_TOPICS, Topic, partition_key, topic_of
from schemas import Event, encode_event

Headers = list[tuple[str, bytes]]

kafka_waits.install()
kafka_groups.install()


def topic_name(settings: StackSettings, topic: Topic) -> str:
    return f"{settings.topic_prefix}.{topic.name}"


def group_name(settings: StackSettings, group: str) -> str:
    """A consumer group is the prefix's, as its topics are: members of one group that read different
    prefixes still rebalance together, and one that stops polling (its client keeps heartbeating)
    held every other prefix's ledger writer out of the group for good (measured against the local
    broker: a writer waited > 10 min to join)."""
    return f"{settings.topic_prefix}.{group}"


def create_topics(settings: StackSettings, topics: Iterable[Topic] = ALL_TOPICS) -> None:
    """Create the topics with their partition counts; existing ones are left alone."""
    admin = KafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap, client_id="awrl-admin")
    try:
        existing = set(admin.list_topics())
        new = [
            NewTopic(topic_name(settings, t), num_partitions=t.partitions, replication_factor=1)
            for t in topics
            if topic_name(settings, t) not in existing
        ]
        if new:
            try:
                admin.create_topics(new)
            except TopicAlreadyExistsError:  # another process won the race
                pass
    finally:
        admin.close()


class EventProducer:
    """Publishes events to their topic, keyed for per-group order, acknowledged by all replicas.

    A send the broker did not acknowledge fails its future; nothing reports it as sent. After any
    failure the next send starts a fresh Kafka producer: a restarted broker that lost its state
    (Tansu in memory) refuses the old producer id for good, which kafka-python treats as fatal.
    """

    def __init__(self, settings: StackSettings, client_id: str = "awrl", linger_ms: int = 5):
        self.settings = settings
        self._config = dict(
            bootstrap_servers=settings.kafka_bootstrap,
            client_id=client_id,
            acks="all",
            enable_idempotence=True,
            linger_ms=linger_ms,
            batch_size=256 * 1024,
            max_request_size=16 * 1024 * 1024,
            compression_type=settings.kafka_compression,
            # A broker that came back empty would create a topic on our first metadata request, with
            # its default partition count (Tansu: 4), not the topic's own: topics are the stack's to make.
            allow_auto_create_topics=False,
        )
        self._kafka = KafkaProducer(**self._config)
        self._lock = threading.Lock()
        self._failed = False
        self.failures = 0
        """Sends the broker never acknowledged."""
        self.restarts = 0
        """Fresh Kafka producers started after failures."""
        self.outbox: Outbox | None = None
        self._reconciler: Reconciler | None = None
        if settings.outbox_dir is not None:  # `pipeline.outbox`: kept on disk until the ledger has it
            self.outbox = Outbox(outbox_path(settings, client_id))
            receipts = ReceiptReader(*ledger_filesystem(settings, create=False))
            self._reconciler = Reconciler(self.outbox, receipts, self._live_cluster, self._send)

    def publish(self, event: Event):
        """Send asynchronously; the returned future raises if the broker never acknowledged it."""
        headers: Headers = [
            ("event_type", type(event).__name__.encode()),
            ("schema_version", str(event.schema_version).encode()),
        ]
        return self.send_raw(topic_of(event), encode_event(event), partition_key(event), headers, event.event_id)

    def publish_all(self, events: Iterable[Event], timeout: float = 60.0) -> int:
        """Send and wait for every acknowledgement; raises on the first failure, returns the count."""
        futures = [self.publish(e) for e in events]
        self._kafka.flush(timeout=timeout)
        for f in futures:
            f.get(timeout=timeout)
        return len(futures)

    def send_raw(
        self,
        topic: Topic,
        value: bytes,
        key: bytes | None = None,
        headers: Headers | None = None,
        event_id: str | None = None,
    ):
        """Send one record; with an outbox and an `event_id`, it is on disk first (`pipeline.outbox`)."""
        name = topic_name(self.settings, topic)
        if self.outbox is not None and event_id is not None:
            self.outbox.add(event_id, name, key, value, headers or [])
            return self._send(Pending(event_id, name, key, value, headers or []))
        with self._lock:
            if self._failed:
                self._restart()
            future = self._kafka.send(name, value=value, key=key, headers=headers or [])
        return future.add_errback(self._on_failure)

    def _send(self, p: Pending):
        """Send an event the outbox holds; its acknowledgement, and by which broker, is noted there."""
        inflight = self._reconciler.inflight
        inflight.add(p.event_id)
        with self._lock:
            if self._failed:
                self._restart()
            cluster = self.cluster_id() or ""  # before the send: see `pipeline.outbox`
            try:
                future = self._kafka.send(p.topic, value=p.value, key=p.key, headers=p.headers)
            except Exception:
                # Raised before any future exists (no metadata within `max_block_ms` while the broker is
                # down): an id left in `inflight` would never be sent again, so the outbox would keep it.
                inflight.discard(p.event_id)
                self._on_failure(None)
                raise

        def acked(_meta) -> None:
            self.outbox.sent(p.event_id, cluster)
            inflight.discard(p.event_id)

        return (
            future.add_callback(acked).add_errback(self._on_failure).add_errback(lambda _: inflight.discard(p.event_id))
        )

    def cluster_id(self) -> str | None:
        """The broker's cluster id as this producer last saw it (a memory broker gets a new one at restart)."""
        return getattr(self._kafka._metadata, "cluster_id", None)  # no public accessor

    def _live_cluster(self) -> str | None:
        """The cluster id of the broker answering now: a new connection, not the producer's metadata."""
        admin = KafkaAdminClient(
            bootstrap_servers=self.settings.kafka_bootstrap, client_id="awrl-outbox", request_timeout_ms=10_000
        )
        try:
            return admin.describe_cluster().get("cluster_id")
        finally:
            admin.close()

    def _on_failure(self, _exc: BaseException) -> None:
        self.failures += 1
        self._failed = True

    def _restart(self) -> None:
        old, self._kafka = self._kafka, KafkaProducer(**self._config)
        self._failed = False
        self.restarts += 1
        # Its unsent batches fail (their futures say so); closing must not block the sender.
        threading.Thread(target=_close_quietly, args=(old,), daemon=True).start()

    def flush(self, timeout: float | None = None) -> None:
        self._kafka.flush(timeout=timeout)

    def close(self, timeout: float | None = None) -> None:
        if self._reconciler is not None:  # first: no resend may start while the producer closes
            self._reconciler.close()
        self._kafka.close(timeout=timeout)
        if self.outbox is not None:
            self.outbox.close()


def _close_quietly(producer: KafkaProducer) -> None:
    """Close a failed producer at once: what it still held is failed (and in the outbox, if any), so
    the library's `KafkaTimeoutError` from its flush says nothing new (it printed a traceback)."""
    with suppress(KafkaError):
        producer.close(timeout=0)


def outbox_path(settings: StackSettings, client_id: str) -> Path | None:
    """The outbox of the producer `client_id` (one per producer and topic prefix); None without outboxes."""
    return settings.outbox_dir / f"{settings.topic_prefix}.{client_id}.sqlite" if settings.outbox_dir else None
