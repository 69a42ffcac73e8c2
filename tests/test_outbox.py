"""The producers' outbox (`pipeline.outbox`): an event acknowledged by the in-memory broker survives
the broker's death, and an event written to the outbox survives its producer's death.

Against a real Tansu broker of the test's own, SIGKILLed and restarted, and the real ledger writer.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pyarrow.fs as pafs
import pytest
from kafka.errors import KafkaError

from pipeline.bus import EventProducer, create_topics
from pipeline.ledger import LedgerWriter
from pipeline.outbox import Outbox
from pipeline.receipts import RECEIPTS, ReceiptReader, ReceiptWriter
from pipeline.stack.local import LocalStack
from pipeline.stack.tansu import start_tansu

from faults import Publisher, account, ledger_ids


def test_the_outbox_keeps_what_the_ledger_has_not_confirmed(tmp_path):
    box = Outbox(tmp_path / "o.sqlite")
    for i in range(4):
        box.add(f"e{i}", "t", b"k", b"v%d" % i, [("h", b"\x00\x01")])
    box.add("e0", "t", b"k", b"v0", [])  # the same event twice is one row
    assert len(box) == 4
    for i in range(3):
        box.sent(f"e{i}", "c1")
    assert box.confirm(["e0", "e1", "elsewhere"]) == 2  # a receipt names them: in Parquet
    again = box.to_resend("c2", unacked_after_s=0, unconfirmed_after_s=3600)  # c1 lost its log
    assert [p.event_id for p in again] == ["e2", "e3"] and again[0].headers == [("h", b"\x00\x01")]
    assert box.to_resend("c1", unacked_after_s=3600, unconfirmed_after_s=3600) == []  # c1 has e2; e3 in flight
    assert [p.event_id for p in box.to_resend("c1", 3600, unconfirmed_after_s=0)] == ["e2"]  # the last resort
    assert len(Outbox(tmp_path / "o.sqlite")) == 2  # on disk: another process finds them


def test_receipts_name_each_durable_event_once_and_old_ones_are_swept(tmp_path):
    fs, root = pafs.LocalFileSystem(), str(tmp_path)
    old = tmp_path / RECEIPTS / "20000101T0000"
    old.mkdir(parents=True)
    (old / "x.json").write_text(json.dumps(["ancient"]))
    writer, reader = ReceiptWriter(fs, root, every_s=3600), ReceiptReader(fs, root)
    assert reader.new_ids() == ["ancient"]  # the first read takes every kept receipt
    writer.add(["a", "b"])
    writer.maybe_write()  # not yet: one receipt per `every_s`
    assert reader.new_ids() == []
    writer.add(["c"])
    writer.maybe_write(force=True)
    assert sorted(reader.new_ids()) == ["a", "b", "c"] and reader.new_ids() == []
    assert not old.exists() and writer.written == 1  # older than `keep_s`: swept by the writer


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_three_broker_kills_lose_nothing_with_the_outbox(stack, settings, tmp_path):
    """Two producers side by side through the same 3 SIGKILLs of the broker: with an outbox, 0 lost;
    without (the negative control), what the writer had not written when the broker died is gone."""
    kafka = start_tansu(tmp_path, port=None)
    own = LocalStack(data_dir=tmp_path, services=[kafka], kafka_bootstrap=f"127.0.0.1:{kafka.port}", s3=stack.s3)
    settings = settings.model_copy(
        update={"kafka_bootstrap": own.kafka_bootstrap, "outbox_dir": None, "ledger_uri": str(tmp_path / "ledger")}
    )
    create_topics(settings)
    with_box = settings.model_copy(update={"outbox_dir": tmp_path / "outbox"})
    run_box, run_bare = f"box-{uuid.uuid4().hex[:6]}", f"bare-{uuid.uuid4().hex[:6]}"
    writer_stop = threading.Event()
    writer = threading.Thread(target=LedgerWriter(settings).sync, kwargs={"follow": True, "stop": writer_stop})
    writer.start()
    boxed, bare = Publisher(with_box, run_box, "boxed"), Publisher(settings, run_bare, "bare")
    boxed.thread.start(), bare.thread.start()
    try:
        for _ in range(3):
            time.sleep(4)
            own.restart("kafka", crash=True)
            create_topics(settings)  # a memory broker comes back empty; the app's topics are recreated
        time.sleep(4)
        boxed.finish(close=False), bare.finish(close=False)  # the outbox goes on sending again
        # Until the outbox is empty and the ledger has every acknowledged event; budgeted in progress, not
        # a clock (a loaded CI machine took over 120 s): only 5 minutes without either moving end the wait.
        seen, since = None, time.monotonic()
        while not boxed.acked.keys() <= set(ledger_ids(settings, run_box)) or len(boxed.producer.outbox) > 0:
            now = (len(boxed.producer.outbox), len(ledger_ids(settings, run_box)))
            if now != seen:
                seen, since = now, time.monotonic()
            elif time.monotonic() - since > 300:
                break
            time.sleep(1)
        left = len(boxed.producer.outbox)
    finally:
        writer_stop.set()
        writer.join(timeout=60)
        boxed.producer.close(timeout=10), bare.producer.close(timeout=10)
        own.down()
    resent = boxed.producer._reconciler.resent
    row = account(
        "broker (Tansu, in memory) SIGKILLed 3 times, producers with the outbox",
        boxed.acked,
        settings,
        run_box,
        note=f"{resent} events sent again from the outbox; the ledger kept each once",
    )
    control = account(
        "  the same 3 kills, producer without the outbox (negative control)",
        bare.acked,
        settings,
        run_bare,
        note="acknowledged, then lost with the broker's memory",
    )
    assert row.lost == 0 and row.duplicated == 0 and resent > 0, (
        f"{row}; still in the outbox when the wait ended: {left}; waited without progress "
        f"{time.monotonic() - since:.0f} s (outbox, ledger rows) {seen}"
    )
    assert left == 0  # the ledger's receipts confirmed every event: the outbox does not grow
    assert control.lost > 0 and control.duplicated == 0  # the fault was real, and the test can see a loss


PRODUCER = textwrap.dedent("""
    import os, sys
    from pipeline.bus import EventProducer
    from pipeline.settings import StackSettings
    from samples import sample_group
    settings = StackSettings.model_validate_json(sys.argv[1])
    producer = EventProducer(settings, client_id="killed")
    event = next(sample_group(sys.argv[2], "g0", ["ab" * 32]))
    print(event.event_id, flush=True)
    producer._kafka.send = lambda *a, **k: os._exit(9)  # dies right after the outbox write, before the send
    producer.publish(event)
""")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_producer_killed_between_its_outbox_and_its_send_sends_once_after_restart(settings, tmp_path):
    settings = settings.model_copy(
        update={
            "ledger_uri": str(tmp_path / "ledger"),
            "outbox_dir": tmp_path / "outbox",
            "topic_prefix": f"t{uuid.uuid4().hex[:8]}",
        }
    )
    create_topics(settings)
    run_id = f"kill-{uuid.uuid4().hex[:6]}"
    died = subprocess.run(
        [sys.executable, "-c", PRODUCER, settings.model_dump_json(), run_id],
        capture_output=True,
        text=True,
        cwd=str(__import__("pathlib").Path(__file__).parent),
        timeout=120,
    )
    assert died.returncode == 9, died.stderr
    event_id = died.stdout.split()[0]
    assert len(Outbox(tmp_path / "outbox" / f"{settings.topic_prefix}.killed.sqlite")) == 1  # on disk, never sent
    restarted = EventProducer(settings, client_id="killed")  # the same producer, started again
    restarted._reconciler.unacked_after_s = 0.0
    writer_stop = threading.Event()
    writer = threading.Thread(target=LedgerWriter(settings).sync, kwargs={"follow": True, "stop": writer_stop})
    writer.start()
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and (
            event_id not in ledger_ids(settings, run_id) or len(restarted.outbox) > 0
        ):
            time.sleep(1)
    finally:
        writer_stop.set()
        writer.join(timeout=60)
        restarted.close()
    row = account(
        "producer killed between its outbox write and its send",
        [event_id],
        settings,
        run_id,
        note="sent by the restarted producer from its outbox, confirmed, then removed from it",
    )
    assert row.lost == 0 and row.duplicated == 0
    # confirmed by the ledger, so forgotten
    assert len(Outbox(tmp_path / "outbox" / f"{settings.topic_prefix}.killed.sqlite")) == 0


def test_a_send_that_raises_before_its_future_leaves_the_event_to_be_sent_again(settings, tmp_path):
    """`KafkaProducer.send` can raise before any future exists (no metadata within `max_block_ms` while
    the broker is down). The event is in the outbox; it must not stay marked in flight, or the outbox
    would never send it again. The raise is injected once; the broker and the ledger are real."""
    from kafka.errors import KafkaTimeoutError

    from samples import sample_step

    settings = settings.model_copy(update={"ledger_uri": str(tmp_path / "ledger"), "outbox_dir": tmp_path / "outbox"})
    create_topics(settings)
    producer = EventProducer(settings, client_id="raising")
    library_send = producer._kafka.send
    calls = []

    def send_once_raising(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise KafkaTimeoutError("Failed to update metadata after 60.0 secs.")
        return library_send(*args, **kwargs)

    producer._kafka.send = send_once_raising
    step = sample_step("raise-run", "g", "g-t0", 0, "ab" * 32)
    with pytest.raises(KafkaTimeoutError):
        producer.publish(step)
    assert step.event_id not in producer._reconciler.inflight and len(producer.outbox) == 1
    producer._reconciler.unacked_after_s = 0.0  # never acknowledged: the next round sends it again
    writer_stop = threading.Event()
    writer = threading.Thread(target=LedgerWriter(settings).sync, kwargs={"follow": True, "stop": writer_stop})
    writer.start()
    try:
        for _ in range(120):  # rounds of a second: the outbox resends, the writer writes, a receipt confirms
            if step.event_id in ledger_ids(settings, "raise-run") and len(producer.outbox) == 0:
                break
            time.sleep(1)
    finally:
        writer_stop.set()
        writer.join(timeout=60)
        producer.close()
    assert ledger_ids(settings, "raise-run") == [step.event_id]  # sent again, by the restarted producer


@pytest.mark.slow
@pytest.mark.timeout(420)
def _partition_state(state) -> dict:
    return {k: v for k, v in vars(state).items() if v not in (None, False, -1)}


def _consumer_state(reader) -> str:
    """What a consumer that gets no records thinks: its assignment, positions and metadata."""
    k = reader._kafka
    assigned = sorted(k.assignment())
    return (
        f"no records: cluster {reader.cluster_id} (polled {reader.polled_cluster}), "
        f"assigned {[(tp.partition, _partition_state(k._subscription.assignment[tp])) for tp in assigned]}, "
        f"partitions {[sorted(k.partitions_for_topic(t) or ()) for t in k.subscription() or ()]}, "
        f"coordinator {k._coordinator.coordinator_id}, generation {k._coordinator._generation}, "
        f"state {k._coordinator.state}, rejoining {k._coordinator.rejoining}, "
        f"need_rejoin {k._coordinator.need_rejoin()}, join task {k._coordinator._join_task}, "
        f"paused {sorted(tp.partition for tp in k.paused())}"
    )


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_offsets_of_a_lost_log_are_never_committed_past_what_the_new_log_handed_out(stack, settings, tmp_path):
    """A consumer computed offsets in the log a broker lost; committed to the broker that replaced it,
    they would make the group's next reader skip records it never handed out. `commit` clips them to
    what `poll()` returned in the new log."""
    from pipeline.consumer import EventConsumer
    from pipeline.topics import ROLLOUT

    from samples import sample_step

    kafka = start_tansu(tmp_path, port=None)
    own = LocalStack(data_dir=tmp_path, services=[kafka], kafka_bootstrap=f"127.0.0.1:{kafka.port}", s3=stack.s3)
    settings = settings.model_copy(update={"kafka_bootstrap": own.kafka_bootstrap, "outbox_dir": None})

    def steps(n):
        return [sample_step("r", "g", "g-t0", i, "ab" * 32, seed=i) for i in range(n)]

    try:
        create_topics(settings)
        producer = EventProducer(settings)
        producer.publish_all(steps(12))  # one key: one partition
        reader = EventConsumer(settings, "readers", [ROLLOUT], producer)
        got = []
        while len(got) < 12:
            got += reader.poll(timeout_ms=500)
        lost_log = reader.polled()  # 12, the offset in the log about to be lost
        # Every partition's, as a commit of that log would name them: a broker that comes back empty
        # can make the topic with another partition count (Tansu creates it on the first metadata
        # request, with 4), so the key's partition may change.
        lost_log = {(topic, p): offset for (topic, _), offset in lost_log.items() for p in range(ROLLOUT.partitions)}
        own.restart("kafka", crash=True)
        # The interleaving CI met under load: the fetcher reconnects and fetches at the old log's
        # position before the reader's metadata names the new broker. Metadata is held back until then.
        cluster = reader._kafka._cluster
        cluster.update_metadata = lambda _: cluster.failed_update(KafkaError("held back by the test"))
        create_topics(settings)
        producer.close()
        producer = EventProducer(settings)
        producer.publish_all(steps(20))
        held = []
        for _ in range(300):
            held += reader.poll(timeout_ms=500, max_records=5)
            if held or reader.unconfirmed:
                break
        assert not held and reader.unconfirmed, (held, reader.unconfirmed)  # fetched, not handed out
        del cluster.update_metadata
        new = []
        for _ in range(300):  # the next poll finds the broker replaced and starts the new log over
            new += reader.poll(timeout_ms=500, max_records=5)
            if new:
                break
        assert new, _consumer_state(reader)
        assert [d.offset for d in new] == [0, 1, 2, 3, 4] and reader.broker_replacements == 1
        assert reader.commit(lost_log)  # committed, but no further than the 5 records handed out
        reader.close()
        after = EventConsumer(settings, "readers", [ROLLOUT], producer)
        rest = []
        deadline = time.monotonic() + 60
        while len(rest) < 15 and time.monotonic() < deadline:
            rest += after.poll(timeout_ms=500)
        after.close()
        producer.close()
    finally:
        own.down()
    assert [d.offset for d in rest] == list(range(5, 20))  # none skipped (unclipped: 12 onwards)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_trainer_resumes_from_its_past_after_the_broker_lost_its_log(stack, settings, tmp_path):
    """v0 and v1 are in the ledger, v2 only in the trainer's outbox when the broker dies: the trainer
    started again resumes from v2, not from version 0 (the log alone: empty). And the folds that follow
    the run, the live progress (updates) and the curriculum (finished groups' episodes), count each event
    once: one of each is in the ledger's past, one is sent again by its restarted producer's outbox."""
    from app.training import RunProgress
    from pipeline.consumer import read_log
    from pipeline.history import follow_run
    from pipeline.topics import ROLLOUT, TRAINER
    from rollout.curriculum import Curriculum
    from schemas import GroupCompleted, GroupDropped, PolicyVersionPublished, UpdateApplied
    from schemas.observation import Task
    from trainer.train import TRAINER_CLIENT, _resume_state

    kafka = start_tansu(tmp_path, port=None)
    own = LocalStack(data_dir=tmp_path, services=[kafka], kafka_bootstrap=f"127.0.0.1:{kafka.port}", s3=stack.s3)
    settings = settings.model_copy(
        update={
            "kafka_bootstrap": own.kafka_bootstrap,
            "outbox_dir": tmp_path / "outbox",
            "ledger_uri": str(tmp_path / "ledger"),
        }
    )
    run_id = f"past-{uuid.uuid4().hex[:6]}"

    def version(v: int) -> PolicyVersionPublished:
        return PolicyVersionPublished(
            run_id=run_id,
            version=v,
            checkpoint_uri=f"s3://awrl/v{v}",
            checkpoint_sha256="ab" * 32,
            parent_version=v - 1 if v else None,
        )

    def update(n: int) -> UpdateApplied:
        return UpdateApplied(
            run_id=run_id,
            update_step=n,
            version_before=n,
            version_after=n + 1,
            group_ids=[],
            trajectory_ids=[],
            loss=0.0,
            grad_norm=1.0,
            stats={},
            config_json="{}",
            weights_sha256="ab" * 32,
            duration_s=1.0,
        )

    def group(g: str) -> GroupCompleted:
        return GroupCompleted(
            run_id=run_id,
            group_id=g,
            task_id="t",
            trajectory_ids=[f"{g}-{i}" for i in range(4)],
            rewards=[1.0, 0.0, 0.0, 1.0],
            num_steps=[1] * 4,
            outcomes=["success", "failure", "failure", "success"],
            min_policy_version=0,
            max_policy_version=0,
        )

    try:
        create_topics(settings)
        producer = EventProducer(settings, client_id=TRAINER_CLIENT)
        pool = EventProducer(settings, client_id="pool")
        producer.publish_all(
            [
                version(0),
                GroupDropped(
                    run_id=run_id, group_id="g1", task_id="t", reason="stale", trainer_version=1, min_policy_version=0
                ),
                past_update := update(0),
                version(1),
            ]
        )
        pool.publish_all([past_group := group("ga")])
        LedgerWriter(settings).sync(idle_exit_s=2)
        producer.publish_all([update(1), version(2)])  # acknowledged; the ledger writer is not running
        pool.publish_all([group("gb")])
        producer.close()
        pool.close()
        own.restart("kafka", crash=True)
        create_topics(settings)
        assert [e for e in read_log(settings, TRAINER) if e.run_id == run_id] == []  # the log alone: from v0
        latest, first, skip = _resume_state(settings, run_id)
        # What the pool and the dispatcher follow: the ledger's past, then the log, where the restarted
        # trainer's outbox sends v2 again; each event once.
        seen, stop = [], threading.Event()
        follower = threading.Thread(
            target=follow_run,
            args=(
                settings,
                TRAINER,
                run_id,
                [PolicyVersionPublished, GroupDropped],
                seen.append,
                stop,
                EventProducer(settings, "f"),
                "f",
            ),
        )
        progress = RunProgress()
        curriculum = Curriculum(
            [
                Task(
                    task_id="t",
                    suite="boxes",
                    site="boxes",
                    template="t",
                    difficulty="easy",
                    instruction="t",
                    start_path="/",
                )
            ]
        )
        folds = [
            threading.Thread(
                target=follow_run,
                args=(
                    settings,
                    TRAINER,
                    run_id,
                    [UpdateApplied],
                    progress.on_trainer_event,
                    stop,
                    EventProducer(settings, "p"),
                    "p",
                ),
            ),
            threading.Thread(
                target=follow_run,
                args=(
                    settings,
                    ROLLOUT,
                    run_id,
                    [GroupCompleted],
                    curriculum.on_event,
                    stop,
                    EventProducer(settings, "c"),
                    "c",
                ),
            ),
        ]
        for t in (follower, *folds):
            t.start()
        restarted = [EventProducer(settings, client_id=c) for c in (TRAINER_CLIENT, "pool")]
        restarted[0].publish_all([past_update])  # in the ledger and now in the log too: a resend whose receipt
        restarted[1].publish_all([past_group])  # never came (the outbox's last resort)
        for _ in range(120):  # each resent event, once, or the budget runs out and the asserts say which
            if len(seen) >= 4 and len(progress.updates) >= 2 and curriculum.state()[0].episodes >= 8:
                break
            time.sleep(0.5)
        time.sleep(2)  # a second copy of any of them would arrive now
        stop.set()
        for t in (follower, *folds):
            t.join(timeout=30)
        for r in restarted:
            r.close()
    finally:
        own.down()
    assert sorted(u.update_step for u in progress.updates) == [0, 1]
    assert curriculum.state()[0].episodes == 8  # two groups of 4, each once
    assert (latest.version, first.version, skip) == (2, 0, {"g1"})
    assert sorted(getattr(e, "version", -1) for e in seen) == [-1, 0, 1, 2] and len({e.event_id for e in seen}) == 4


@pytest.mark.timeout(600)
@pytest.mark.parametrize("source", ["log and ledger", "log alone"])
def test_a_group_the_broker_lost_after_the_ledger_confirmed_it_is_trained_from_the_ledger(
    stack, settings, tmp_path, monkeypatch, source
):
    """A trainer behind the ledger: g0's events were acknowledged and written by the ledger writer (so
    its producer's outbox never sends them again), and the broker lost its log before the trainer
    read them. Finding the broker replaced, the batch builder reads g0 from the ledger and hands it
    out whole, once. The control reads the log alone and never sees g0 (in the chaos soak, such
    groups stayed open past their timeout)."""
    from pipeline.hashing import sha256_hex
    from pipeline.store import ScreenshotStore
    from trainer import batch as batching
    from trainer.config import TrainConfig

    from samples import render_page, sample_group

    kafka = start_tansu(tmp_path, port=None)
    own = LocalStack(data_dir=tmp_path, services=[kafka], kafka_bootstrap=f"127.0.0.1:{kafka.port}", s3=stack.s3)
    settings = settings.model_copy(
        update={"kafka_bootstrap": own.kafka_bootstrap, "ledger_uri": str(tmp_path / "ledger")}
    )
    if source == "log alone":
        monkeypatch.setattr(batching, "ledger_groups", lambda *args: [])
    run_id = f"lost-{uuid.uuid4().hex[:6]}"
    store = ScreenshotStore.from_settings(settings)
    store.ensure_bucket()
    store.put(png := render_page(run_id, size=(320, 240)))
    events = list(sample_group(run_id, "g0", [sha256_hex(png)], group_size=3, steps=2, seed=3))
    config = TrainConfig(run_id=run_id, groups_per_update=1, dynamic_sampling=False, batch_timeout_s=2)
    try:
        create_topics(settings)
        trainer = EventProducer(settings, client_id="trainer")
        builder = batching.BatchBuilder(settings, config, trainer)
        assert builder.next_batch(0) is None  # joined, read the (empty) ledger, and now falls behind
        pool = EventProducer(settings, client_id="pool")
        pool.publish_all(events)
        pool.close()
        LedgerWriter(settings).sync(idle_exit_s=2)
        own.restart("kafka", crash=True)
        create_topics(settings)
        batches = []
        for _ in range(30):  # budgeted in batch timeouts: until the builder has found the broker replaced
            batches.append(builder.next_batch(0))
            if builder.consumer.broker_replacements and len(batches) > 2:
                break
        assert builder.consumer.broker_replacements == 1
        handed_out = [g for b in batches if b for g in b]
        if source == "log and ledger":
            assert [g.group_id for g in handed_out] == ["g0"]
            assert [len(t) for t in handed_out[0].trajectories] == handed_out[0].completed.num_steps
        else:
            assert handed_out == []
        builder.close()
        trainer.close()
    finally:
        own.down()
