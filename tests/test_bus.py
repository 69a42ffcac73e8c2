"""The event bus against the real local broker: order, no loss, no duplicates, dead letters."""

from __future__ import annotations

import time
from collections import defaultdict

from kafka import KafkaConsumer

from pipeline.bus import EventProducer, topic_name
from pipeline.consumer import EventConsumer, dead_letters, read_log
from pipeline.topics import DEAD_LETTER, ROLLOUT, TRAINER
from schemas import EpisodeFinished

from samples import sample_step

SHA = "cd" * 32


def drain(consumer: EventConsumer, want: int, timeout: float = 60.0, stop_after: int | None = None):
    """Poll until `want` events arrived (or `stop_after`, committing at the end)."""
    got = []
    deadline = time.monotonic() + timeout
    limit = stop_after or want
    while len(got) < limit and time.monotonic() < deadline:
        got += consumer.poll(timeout_ms=500, max_records=min(500, limit - len(got)))
    consumer.commit()
    return got


def test_10k_events_ordered_per_key_none_lost_none_duplicated_and_resume(settings):
    producer = EventProducer(settings)
    events = [
        sample_step(
            "run", f"g{i % 50}", f"g{i % 50}-t{i % 7}", i // 50, SHA, response_tokens=8, prompt_tokens=16, seed=i
        )
        for i in range(10_000)
    ]
    assert producer.publish_all(events) == 10_000

    first = EventConsumer(settings, "readers", [ROLLOUT], producer)
    part1 = drain(first, 10_000, stop_after=4_000)
    first.close()
    second = EventConsumer(settings, "readers", [ROLLOUT], producer)  # restart: resumes at the commit
    part2 = drain(second, 10_000 - len(part1))
    second.close()
    producer.close()

    ids = [d.event.event_id for d in part1 + part2]
    assert len(part1) == 4_000
    assert len(ids) == 10_000 and len(set(ids)) == 10_000
    assert set(ids) == {e.event_id for e in events}
    per_key = defaultdict(list)
    for d in sorted(part1 + part2, key=lambda d: (d.partition, d.offset)):
        per_key[d.event.group_id].append(d.event.event_id)
    sent = defaultdict(list)
    for e in events:
        sent[e.group_id].append(e.event_id)
    assert per_key == sent


def test_bad_messages_go_to_dead_letter_with_reason_and_consumer_goes_on(settings):
    producer = EventProducer(settings)
    good = EpisodeFinished(
        run_id="r",
        trajectory_id="t",
        group_id="g",
        task_id="x",
        outcome="success",
        reward=1.0,
        num_steps=1,
        reason="ok",
    )
    bad = [
        b"\x00\xff garbage",
        b'{"event_type": "StepRecorded", "run_id": "r"}',
        b'{"event_type": "NoSuchEvent"}',
        b'{"trunc',
        good.model_dump_json().replace('"reward":1.0', '"reward":"lots"').encode(),
    ]
    for value in bad:
        producer.send_raw(ROLLOUT, value, b"k").get(timeout=10)
    producer.send_raw(TRAINER, good.model_dump_json().encode(), b"k").get(timeout=10)  # wrong topic
    producer.publish(good).get(timeout=10)

    consumer = EventConsumer(settings, "dlq-test", [ROLLOUT, TRAINER], producer)
    got = drain(consumer, 1, timeout=30)
    deadline = time.monotonic() + 10
    while consumer.dead_lettered < len(bad) + 1 and time.monotonic() < deadline:
        consumer.poll(timeout_ms=300)
    consumer.close()
    assert [d.event for d in got] == [good]
    assert consumer.dead_lettered == len(bad) + 1

    dlq = KafkaConsumer(
        topic_name(settings, DEAD_LETTER),
        bootstrap_servers=settings.kafka_bootstrap,
        auto_offset_reset="earliest",
        consumer_timeout_ms=5000,
    )
    records = list(dlq)
    dlq.close()
    assert sorted(r.value for r in records) == sorted(bad + [good.model_dump_json().encode()])
    reasons = {r.value: dict(r.headers)["reason"].decode() for r in records}
    assert "undecodable" in reasons[b'{"trunc'] or "invalid event" in reasons[b'{"trunc']
    assert "does not belong on topic 'trainer'" in reasons[good.model_dump_json().encode()]
    assert "reward" in reasons[bad[4]]
    assert all(dict(r.headers)["source_offset"] for r in records)
    # what the Dagster check reads: each letter's reason, source topic and the run it names, if any
    letters = dead_letters(settings)
    assert len(letters) == len(bad) + 1 and sum(d.run_id == "r" for d in letters) == 3  # bad[1], bad[4], good
    assert {d.source_topic for d in letters} == {topic_name(settings, ROLLOUT), topic_name(settings, TRAINER)}
    assert sum("does not belong on topic" in d.reason for d in letters) == 1


def test_read_log_reaches_the_end_of_a_final_multi_record_batch(settings):
    """The local broker's ListOffsets says a partition ends at its last batch's base offset + 1; a
    reader that stopped there lost the trainer's last published versions on resume (and the fuzz
    test's last dead letters). Two batches of 600, read 500 records per poll: it must return all 1200."""
    producer = EventProducer(settings, linger_ms=50)
    events = [
        EpisodeFinished(
            run_id="r-end",
            trajectory_id=f"t{i}",
            group_id="g",
            task_id="x",
            outcome="success",
            reward=1.0,
            num_steps=1,
            reason="ok",
        )
        for i in range(1200)
    ]
    for chunk in (events[:600], events[600:]):
        producer.publish_all(chunk)  # one acknowledged batch each (same key, same partition)
    producer.close()

    mine = [e for e in read_log(settings, ROLLOUT) if e.run_id == "r-end"]
    assert [e.trajectory_id for e in mine] == [e.trajectory_id for e in events]
