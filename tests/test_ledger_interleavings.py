"""Ledger writers under the interleavings that wrote rows twice (issue 41), each made to happen: one
writer is held before its commit (a hook, or SIGSTOP at its own PUT), another runs, then the first
resumes. Each has a negative control that reproduces the steps from before the fix and shows the fault.

Against the session's real broker and object store. Waits are for events (ids in the ledger, a
marker file, a process state); `WAIT_S` only bounds a test that hangs. The one timing that matters is
the broker's session timeout, which a stopped writer must outlive to be replaced.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta
from pathlib import Path

import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from kafka.errors import KafkaError

from pipeline.bus import EventProducer, create_topics
from pipeline.consumer import Delivered
from pipeline.ledger import LedgerConfig, LedgerWriter, read_events
from pipeline.ledger_journal import Journal
from pipeline.receipts import RECEIPTS, ReceiptReader

from faults import ledger_ids
from samples import sample_group

SHA = "ef" * 32
WAIT_S = 120.0
REPO = Path(__file__).resolve().parent.parent


class OldJournal(Journal):
    """The journal before claims: each flush's entry has a name of its own (nothing is ever taken), and a
    partition's position is the end of its newest complete entry (an incomplete one is read again)."""

    def claim(self, topic, partition, start, end, files, cluster):
        return super().claim(topic, partition, None, end, files, cluster)


def unfence(writer: LedgerWriter) -> LedgerWriter:
    """The writer with the journal from before claims (the negative controls)."""
    writer.journal = OldJournal(writer.fs, writer.root, None if writer.journal.local else writer.journal._put)
    writer.chains.journal = writer.journal
    return writer


def until(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"waited {WAIT_S} s for {what}"
        time.sleep(0.1)


def sample_events(run_id: str, groups: int, seed: int = 0) -> list:
    return [e for g in range(groups) for e in sample_group(run_id, f"g{g}", [SHA], seed=seed + g)]


def publish(settings, events) -> dict[str, tuple[str, int]]:
    """Each event's (topic, partition), once acknowledged."""
    producer = EventProducer(settings)
    futures = [(e.event_id, producer.publish(e)) for e in events]
    producer.flush(60)
    where = {}
    for event_id, future in futures:
        meta = future.get(timeout=60)
        where[event_id] = (meta.topic, meta.partition)
    producer.close()
    return where


class Following:
    """A writer's `sync(follow=True)` on a thread of the test."""

    def __init__(self, writer: LedgerWriter, on_flush=None):
        self.writer, self.stop, self.error = writer, threading.Event(), None
        self.thread = threading.Thread(target=self._run, args=(on_flush,), daemon=True)
        self.thread.start()

    def _run(self, on_flush) -> None:
        try:
            self.writer.sync(follow=True, stop=self.stop, on_flush=on_flush)
        except BaseException as exc:  # noqa: BLE001 - reported by `end`
            self.error = exc

    def end(self) -> None:
        self.stop.set()
        self.thread.join(60)
        assert not self.thread.is_alive() and self.error is None, self.error


def local(settings, tmp_path, name: str = "ledger"):
    return settings.model_copy(update={"ledger_uri": str(tmp_path / name)})


# 1. Records polled before a rebalance -------------------------------------------------------------


class Recording(LedgerWriter):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.partitions: set[tuple[str, int]] = set()

    def _load(self, partitions, cluster):
        self.partitions |= partitions
        return super()._load(partitions, cluster)


class Collecting(Recording):
    """Its first batch is collected until the test releases it, polling all the while (so the group can
    rebalance meanwhile). `keep_revoked`: the step order from before, where the records of partitions
    taken away stayed in the batch."""

    def __init__(self, *args, keep_revoked: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.keep_revoked, self.held, self.revocations = keep_revoked, 0, 0
        self.rejoined = self.settled = 0
        """Revocations the group's latest assignment to this member answers; of them, those its batch
        was filtered after."""
        self.release, self.flushed = threading.Event(), threading.Event()
        self.kept: int | None = None
        """What the held batch had left when it was released."""

    def _partitions_revoked(self, partitions):
        self.revocations += 1
        if self.keep_revoked:
            self._wait_for_flush()
            self.chains.revoked(partitions)
        else:
            super()._partitions_revoked(partitions)

    def _assigned(self, partitions, cluster):
        floors = super()._assigned(partitions, cluster)
        self.rejoined = self.revocations
        return floors

    def _collect(self, consumer):
        if self.release.is_set():
            return super()._collect(consumer)
        batch = []
        while not self.release.is_set():
            answered = self.rejoined
            got = consumer.poll(timeout_ms=200)
            batch = self._still_ours(batch, consumer) + got
            self.held, self.settled = len(batch), answered
        self.kept = len(batch)
        return batch


@pytest.mark.parametrize(
    "drop, fence, once",
    [(True, True, True), (True, False, True), (False, True, True), (False, False, False)],
    ids=["fixed", "drop-only", "claims-only", "control"],
)
def test_records_collected_before_a_rebalance_are_written_once(settings, tmp_path, drop, fence, once):
    """Writer 1 holds every event in the batch it collects; writer 2 joins and the group moves about half
    the partitions to it; writer 2 writes them; writer 1 rejoins, is released and flushes. Dropping the revoked
    partitions' records, and the claims, each keep every row once; the control (neither) writes writer
    2's share twice."""
    settings = local(settings, tmp_path)
    events = sample_events("run-r", 12)
    where = publish(settings, events)
    config = LedgerConfig(consumer_group=f"ledger-{settings.topic_prefix}")
    first, second = Collecting(settings, config, keep_revoked=not drop), Recording(settings, config)
    if not fence:
        unfence(first), unfence(second)
    one = Following(first, on_flush=lambda _: first.flushed.set())
    until(lambda: first.held == len(events), "writer 1 to hold every event")
    two = Following(second)
    until(lambda: second.partitions and first.revocations, "the rebalance")
    theirs = {i for i, source in where.items() if source in second.partitions}
    assert theirs, "the rebalance should have moved partitions with events"
    until(lambda: theirs <= set(ledger_ids(settings)), "writer 2 to write its partitions")
    # Writer 1's side of the rebalance can lag writer 2's on a loaded machine: until its join completes,
    # the client still lists the revoked partitions as assigned, so a batch flushed then keeps their
    # records. That flush is the claims' to fence (claims-only); dropping acts once the join is done.
    until(lambda: first.settled == first.revocations, "writer 1 to finish its side of the rebalance")
    first.release.set()
    until(
        lambda: first.kept == 0 or first.flushed.is_set(),
        f"writer 1's held batch to be written ({first.kept} events, partitions {sorted(first.partitions)})",
    )
    until(lambda: set(ledger_ids(settings)) == {e.event_id for e in events}, "every event in the ledger")
    one.end(), two.end()
    ids = ledger_ids(settings)
    if once:
        assert sorted(ids) == sorted(e.event_id for e in events)
    else:
        assert len(ids) - len(set(ids)) >= len(theirs), "the control should have written writer 2's share twice"


# 2. A late resend ---------------------------------------------------------------------------------


def test_a_resend_after_the_receipts_are_gone_is_written_once(settings, tmp_path):
    """A producer stayed down past the receipts' window and resends events the ledger has: the restarted
    writer knows none of their ids (no receipt, no journal entry names them). It finds them in the
    ledger's files; the control (no lookup) writes them twice."""
    for lookup, name in ((True, "ledger"), (False, "control")):
        s = local(settings, tmp_path, name).model_copy(update={"topic_prefix": f"{settings.topic_prefix}{name[0]}"})
        create_topics(s)
        old = [
            e.model_copy(update={"emitted_at": e.emitted_at - timedelta(hours=1)}) for e in sample_events("run-l", 3)
        ]
        later = sample_events("run-l", 3, seed=100)  # the same groups: the same partitions
        publish(s, old)
        LedgerWriter(s).sync(idle_exit_s=1)
        publish(s, later)
        LedgerWriter(s).sync(idle_exit_s=1)  # its journal moves on; the entries naming `old` go
        fs, root = pafs.LocalFileSystem(), str(tmp_path / name)
        named = Journal(fs, root).named_files()
        assert not {e.event_id for e in old} & {
            i for f in named for i in pq.read_table(f).column("event_id").to_pylist()
        }
        shutil.rmtree(tmp_path / name / RECEIPTS)  # the receipts' window has passed
        publish(s, old)  # the outbox's last resort: sent again
        writer = LedgerWriter(s)
        if not lookup:
            writer.lookup.known = lambda events, since: set()
        writer.sync(idle_exit_s=1)
        ids = ledger_ids(s)
        if lookup:
            assert sorted(ids) == sorted(e.event_id for e in old + later)
            assert writer.stats.duplicates == len(old) and writer.lookup.lookups > 0
        else:
            assert len(ids) == len(set(ids)) + len(old), "the control should have written the resends again"


# 3. A stalled writer ------------------------------------------------------------------------------

STALLING = textwrap.dedent('''
    import os, signal, sys
    from pathlib import Path

    sys.path.insert(0, "tests")
    from test_ledger_interleavings import unfence
    from pipeline.ledger import LedgerConfig, LedgerWriter
    from pipeline.settings import StackSettings

    marks, mode, group = Path(sys.argv[1]), sys.argv[2], sys.argv[3]

    class Stalling(LedgerWriter):
        """Stops its whole process (heartbeats too) at the PUT of its first ledger file, after its claims."""

        stopped = False

        def _write_file(self, path, table, what):
            if not self.stopped and "/event_type=" in path:
                self.stopped = True
                (marks / "stopping").write_text(path)
                os.kill(os.getpid(), signal.SIGSTOP)
            super()._write_file(path, table, what)

        def _flush(self, *args):
            entries = super()._flush(*args)
            if self.stopped:
                (marks / "flushed").touch()
            return entries

    writer = Stalling(StackSettings(), LedgerConfig(consumer_group=group))
    if mode == "control":
        unfence(writer)
    writer.sync(follow=True)
''')


def _stopped(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    return any(line.startswith("State:") and "T" in line.split()[1] for line in status.splitlines())


@pytest.mark.parametrize("fenced", [True, False], ids=["fixed", "control"])
def test_a_writer_stopped_at_its_put_past_its_session_is_fenced(settings, tmp_path, fenced):
    """Writer 1 (a process) claims its first batch and is stopped at the PUT of its first file; the
    group drops it after its session; writer 2 takes every partition and writes everything; writer 1
    is resumed and finishes its write. With claims, writer 2 wrote writer 1's claimed files itself, the
    same rows at the same paths; the control writes them twice. On S3: the claims' exclusive create."""
    settings = settings.model_copy(update={"ledger_uri": f"s3://{settings.s3_bucket}/ledger-{settings.topic_prefix}"})
    events = sample_events("run-s", 6)
    publish(settings, events)
    group, marks = f"ledger-{settings.topic_prefix}", tmp_path / "marks"
    marks.mkdir()
    env = {**os.environ, **settings.environ(), "PYTHONPATH": str(REPO)}
    with open(tmp_path / "writer1.log", "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", STALLING, str(marks), "fixed" if fenced else "control", group],
            env=env,
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    two = None
    try:
        until(lambda: (marks / "stopping").exists() and _stopped(proc.pid), "writer 1 to stop at its PUT")
        second = LedgerWriter(settings, LedgerConfig(consumer_group=group))
        if not fenced:
            unfence(second)
        two = Following(second)
        until(lambda: set(ledger_ids(settings)) >= {e.event_id for e in events}, "writer 2 to write everything")
        os.kill(proc.pid, signal.SIGCONT)
        until(lambda: (marks / "flushed").exists() or proc.poll() is not None, "writer 1 to finish its write")
        assert proc.poll() is None, (tmp_path / "writer1.log").read_text()[-3000:]
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        proc.wait(30)
        if two is not None:
            two.end()
    ids = ledger_ids(settings)
    if fenced:
        assert sorted(ids) == sorted(e.event_id for e in events)
        assert second.chains.completed > 0, "writer 2 should have written writer 1's claimed files"
    else:
        assert set(ids) == {e.event_id for e in events} and len(ids) > len(set(ids)), "the control should write twice"


# 4. A store error while partitions are assigned ---------------------------------------------------


class NeverCommits(LedgerWriter):
    """Killed, as it were, between a durable write and its commit: the journal is all that says so."""

    @staticmethod
    def _commit(consumer, polled):
        return False


class FailingOnce(LedgerWriter):
    """Its first read of the assigned partitions' journal meets an unreachable store."""

    loads = 0

    def _load(self, partitions, cluster):
        self.loads += 1
        if self.loads == 1:
            raise OSError("the object store did not answer")
        return super()._load(partitions, cluster)


class RaisedIntoTheClient(FailingOnce):
    """The step order from before: the error is raised into the consumer client's rebalance code."""

    def _assigned(self, partitions, cluster):
        return self._load(partitions, cluster)


@pytest.mark.parametrize("carried", [True, False], ids=["fixed", "control"])
def test_a_store_error_in_the_assignment_never_lets_the_writer_go_on_without_the_journal(settings, tmp_path, carried):
    """Writer A writes everything and commits nothing; writer B's first read of the journal fails. The
    error reaches B's polling thread, which rejoins and reads it: B skips what A wrote. In the control
    the error is raised into the client: kafka-python 3.0 raises it again from `poll()` (a KafkaError),
    so a passing store error stops the writer (the issue saw it only logged, the writer going on)."""
    settings = local(settings, tmp_path)
    events = sample_events("run-a", 4)
    publish(settings, events)
    NeverCommits(settings).sync(idle_exit_s=1)
    assert sorted(ledger_ids(settings)) == sorted(e.event_id for e in events)
    if carried:
        writer = FailingOnce(settings)
        writer.sync(idle_exit_s=1)
        assert sorted(ledger_ids(settings)) == sorted(e.event_id for e in events)
        assert writer.stats.rejoins == 1 and writer.loads == 2 and writer.stats.written == 0
    else:
        with pytest.raises(KafkaError) as raised:
            RaisedIntoTheClient(settings).sync(idle_exit_s=1)
        assert isinstance(raised.value.__cause__, OSError), "the control should stop on the store error"


# 5. A broker that lost its log ---------------------------------------------------------------------


def test_a_log_replaced_under_a_writer_loses_nothing_to_its_old_position(settings, tmp_path):
    """The broker comes back with a new log (offsets from 0 again) before the group reassigns the
    writer's partition: its batches of the new log, and one that mixes both logs, are written whole,
    not dropped below the old log's position. And a receipt (which lets an outbox delete an event)
    never names an event the ledger's files lack, even one a flush skipped as an earlier claim's."""
    settings = local(settings, tmp_path)
    writer = LedgerWriter(settings)
    source = ("t", 0)
    old, new, mixed, skipped = (sample_events(f"run-{n}", 1, seed=i) for i, n in enumerate("onms"))

    def batch(events, first):
        return [Delivered(e, *source, first + i) for i, e in enumerate(events)]

    writer._load({source}, "log-a")
    writer._flush(batch(old, 100), "log-a", polled={source: 100 + len(old)})
    writer._flush(batch(new, 0), "log-b", polled={source: len(new)})  # not reassigned yet
    writer._flush(batch(mixed, len(new)), None, polled={source: len(new) + len(mixed)})
    written = old + new + mixed
    assert sorted(ledger_ids(settings)) == sorted(e.event_id for e in written)
    # In one log, records below the position are an earlier claim's: skipped, and not receipted.
    writer.chains._positions[source] = ("log-b", 1000)
    writer._flush(batch(skipped, 500), "log-b", polled={source: 500 + len(skipped)})
    writer._receipt(force=True)
    receipted = set(ReceiptReader(writer.fs, writer.root).new_ids())
    assert receipted == {e.event_id for e in written}, "a receipt named an event the ledger lacks"
    assert sorted(ledger_ids(settings)) == sorted(e.event_id for e in written)


# 6. Readers --------------------------------------------------------------------------------------


def test_read_events_reads_each_event_id_once(settings, tmp_path):
    settings = local(settings, tmp_path)
    events = sample_events("run-d", 2)
    publish(settings, events)
    LedgerWriter(settings).sync(idle_exit_s=1)
    steps = tmp_path / "ledger" / "run_id=run-d" / "event_type=StepRecorded"
    some = sorted(steps.iterdir())[0]
    shutil.copy(some, steps / "part-copy.parquet")  # a duplicate that got in anyway
    assert len(ledger_ids(settings)) > len(events)
    expected = sorted(e.event_id for e in events if e.event_type == "StepRecorded")
    assert sorted(read_events(settings, "run-d", "StepRecorded").column("event_id").to_pylist()) == expected
    assert read_events(settings, "run-d", "StepRecorded", columns=["step"]).num_rows == len(expected)
