"""The ledger writer: the event log folded into Parquet, exactly once.

Exactly-once here is at-least-once delivery plus idempotent writes: offsets are committed only after
the Parquet files holding the batch are durable, and an event that can come again is skipped by id.
A batch is written on a thread while the next one is collected, and committed before the next is
written. A `kill -9` at any moment therefore re-delivers at most those two batches: the one being
collected wrote nothing, and the files of the one being written are named by its journal entry
(`pipeline.journal`), whose ids the member that gets the partition next reads. Memory and start-up are
bounded by that, not by the ledger's size. Several writers in one consumer group share the partitions
(`awrl ledger sync --follow`, once per process); a member losing partitions finishes its write before
it rejoins, so their next owner finds every file the journal names.

Each message is validated per message (the dead-letter decision) by `schemas.columnar`, which keeps a
step's packed token arrays as bytes: a batch's token columns are then one concatenation, not ~2k
Python ints per step converted twice (3x the writer's events/s; bench/ledger.py).

Layout: `<root>/run_id=<run>/event_type=<Type>/part-<time>-<id>.parquet` (Hive-style, so DuckDB and
Dagster prune by run and type). A file is never visible half-written: locally it is written under a
`.tmp` name, fsynced and renamed; on S3 an object appears only once its upload completes.
"""

from __future__ import annotations

import gc
import io
import logging
import time
import uuid
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from datetime import UTC, datetime

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pipeline.bus import Delivered, EventConsumer, EventProducer, Rejected
from pipeline.compaction import CompactionConfig, CompactionResult, compact_run, manifest_rule
from pipeline.files import write_atomic
from pipeline.journal import Journal, RecentIds, s3_put
from pipeline.receipts import ReceiptReader, ReceiptWriter
from pipeline.settings import StackSettings
from pipeline.store import STORE_PATIENCE_S, ledger_filesystem, minio_client, patiently
from pipeline.summaries import with_summaries
from pipeline.topics import ROLLOUT, TASKS, TRAINER
from schemas import BY_NAME, Event, arrow_schema
from schemas.columnar import columnar_table, decode_columnar

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LedgerConfig:
    max_batch_events: int = 20_000
    """Flush after this many events (bounds memory and re-delivery after a crash)."""
    max_batch_seconds: float = 0.25
    """Flush at least this often. It bounds the writer's lag, i.e. what a restart of the local
    in-memory broker can lose (measured p50 well under 1 s with it; see the fault matrix)."""
    compression: str = "zstd"
    row_group_size: int = 64_000
    consumer_group: str = "ledger"
    dedup_window: int = 200_000
    """Event ids remembered after writing them, for a producer's duplicate (a retry seconds later);
    redelivery after a crash or rebalance is covered by the journal whatever its size."""
    store_patience_s: float = STORE_PATIENCE_S
    """How long a flush waits out an unreachable or full object store (offsets stay uncommitted)."""


@dataclass
class LedgerStats:
    written: int = 0
    """Events written to Parquet."""
    duplicates: int = 0
    """Events skipped because their id was already in the ledger."""
    files: int = 0
    bytes: int = 0
    max_lag_s: float = 0.0
    """Longest time from an event's emission to its file being durable."""
    lags: list[float] = field(default_factory=list)
    store_waited_s: float = 0.0
    """Time paused because the object store was unreachable or full."""
    dead_lettered: int = 0
    """Messages that were no valid event for their topic, moved to the dead-letter topic."""


def list_parquet(fs: pafs.FileSystem, root: str) -> list[str]:
    """The live Parquet files under `root`: compaction's manifests decide which of a merged file and
    its sources a reader sees (`pipeline.compaction`), so every row is read exactly once."""
    try:
        infos = fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
    except FileNotFoundError:
        return []
    paths = {i.path for i in infos if i.type == pafs.FileType.File}
    hidden, invisible = manifest_rule(fs, paths)  # compaction's `_compaction-*.json` manifests among them
    return sorted(p for p in paths if p.endswith(".parquet") and p not in hidden and p not in invisible
                  and not _own_folder(root, p))


def _own_folder(root: str, path: str) -> bool:
    """Under a top folder named `_...`: the ledger's own (journal, receipts, dead letters), not events."""
    return path[len(root):].lstrip("/").startswith("_")


DEAD_LETTERS = "_dead_letters"


def dead_letter_table(rejected: list[Rejected]) -> pa.Table:
    """The ledger's copy of dead-lettered messages, one row each (`read_dead_letters` reads them)."""
    now = datetime.now(UTC)
    return pa.table({
        "dead_letter_id": pa.array([r.dead_letter_id for r in rejected], pa.string()),
        "reason": pa.array([r.reason for r in rejected], pa.string()),
        "source_topic": pa.array([r.source_topic for r in rejected], pa.string()),
        "source_partition": pa.array([r.source_partition for r in rejected], pa.int32()),
        "source_offset": pa.array([r.source_offset for r in rejected], pa.int64()),
        "key": pa.array([r.key for r in rejected], pa.binary()),
        "value": pa.array([r.value for r in rejected], pa.binary()),
        "dead_lettered_at": pa.array([now] * len(rejected), pa.timestamp("us", tz="UTC")),
    })


def read_dead_letters(settings: StackSettings) -> pa.Table:
    """Every dead letter the ledger holds, once each (a crash before a commit dead-letters a message
    again: same id)."""
    fs, root = ledger_filesystem(settings, create=False)
    infos = fs.get_file_info(pafs.FileSelector(f"{root}/{DEAD_LETTERS}", allow_not_found=True))
    files = sorted(i.path for i in infos if i.type == pafs.FileType.File and i.path.endswith(".parquet"))
    if not files:
        return dead_letter_table([])
    table = ds.dataset(files, filesystem=fs, format="parquet").to_table()
    first = {}
    for i, dead_letter_id in enumerate(table.column("dead_letter_id").to_pylist()):
        first.setdefault(dead_letter_id, i)
    return table.take(sorted(first.values()))


def read_events(settings: StackSettings, run_id: str, event_type: str, columns: list[str] | None = None) -> pa.Table:
    """All ledger events of one type in one run; an empty table (same schema) when there are none yet.

    Files are listed explicitly rather than read as a directory, so a temporary (`*.tmp`) being written by
    the writer at this moment is never read half-finished.
    """
    fs, root = ledger_filesystem(settings)
    files = list_parquet(fs, f"{root}/run_id={run_id}/event_type={event_type}")
    dataset = ds.dataset(files, schema=arrow_schema(BY_NAME[event_type]), format="parquet", filesystem=fs)
    return dataset.to_table(columns=columns)


def compact_ledger(settings: StackSettings, run_id: str, config: CompactionConfig = CompactionConfig()
                   ) -> dict[str, CompactionResult]:
    """Merge one run's small files (`pipeline.compaction`), on the local or S3 ledger."""
    fs, root = ledger_filesystem(settings)
    return compact_run(fs, root, run_id, config, _object_put(settings, fs))


def _object_put(settings: StackSettings, fs: pafs.FileSystem):
    """The S3 ledger's atomic write (`s3_put` through one client); None on a local ledger, whose
    writers use `write_atomic`."""
    if isinstance(fs, pafs.LocalFileSystem):
        return None
    client = minio_client(settings)
    return lambda path, data: s3_put(client, path, data)


@dataclass(frozen=True)
class _Flush:
    future: Future
    """Of `_flush`: the batch's journal entries, once its files are durable."""
    polled: dict[tuple[str, int], int]
    """The offsets to commit then: everything polled up to the end of the batch."""
    cluster: str | None
    """The log those offsets count in; None when the broker was replaced while the batch was polled."""


class LedgerWriter:
    def __init__(self, settings: StackSettings, config: LedgerConfig = LedgerConfig()):
        self.settings, self.config = settings, config
        self.fs, self.root = ledger_filesystem(settings)
        self.stats = LedgerStats()
        self.last_flush_at: float | None = None
        """perf_counter() of the last durable flush (benchmarks exclude the idle wait after it)."""
        self.first_poll: tuple[float, int] | None = None
        """perf_counter() after the first poll that returned events, and how many (benchmarks exclude
        the consumer group's join before it)."""
        self.recent = RecentIds(config.dedup_window)
        self._put = _object_put(settings, self.fs)
        patient = None if self._put is None else (lambda path, data: patiently(
            lambda: self._put(path, data), "writing the ledger's journal", config.store_patience_s, self._waited))
        self.journal = Journal(self.fs, self.root, patient)
        self.receipts = ReceiptWriter(self.fs, self.root, self._put)
        """What is in Parquet, by event id, for the producers' outboxes (`pipeline.receipts`)."""
        self._receipts_read = ReceiptReader(self.fs, self.root)
        self._obsolete: list[str] = []
        """Journal entries a commit made obsolete, deleted once a receipt names their events: until
        then they name files whose ids a restarted writer must know (an outbox may send them again)."""
        self._inflight: _Flush | None = None
        self._entries: dict[tuple[str, int], list[str]] = {}
        """Each partition's journal entries this member knows of, oldest first: all but the newest go
        once a commit covers them."""

    def _assigned(self, partitions: set[tuple[str, int]], cluster: str | None) -> dict[tuple[str, int], int]:
        """A partition's uncommitted flushes (ours or a dead member's) are in the ledger: skip their ids,
        and every record up to the last complete one (`EventConsumer` drops them)."""
        starts = {}
        # What any writer wrote lately, from its receipts: an outbox sends again what a broker lost,
        # some of which a writer (maybe a dead one) had already written.
        try:
            self.recent.update(self._receipts_read.new_ids())
        except OSError as exc:  # the store is down: the journal still covers this writer's partitions
            log.warning("could not read the ledger's receipts (%s): a resent event may be written twice", exc)
        for source in sorted(partitions):
            position = self.journal.read(*source, cluster)
            self.recent.update(position.ids)
            # Written, but maybe never in a receipt (a writer killed between the two): say so again.
            self.receipts.add(sorted(position.ids))
            self._obsolete += position.superseded  # deleted once that receipt is written
            self._entries[source] = [e for e in position.entries if e not in position.superseded]
            if position.start is not None:
                starts[source] = position.start
        return starts

    def sync(self, follow: bool = False, idle_exit_s: float = 3.0, on_flush=None,
             join_timeout_s: float = 60.0, stop=None) -> LedgerStats:
        """Write everything in the log; with `follow`, keep going until interrupted or `stop` (a
        `threading.Event`) is set.

        Without `follow`, stop once this member has owned every partition and seen nothing new for
        `idle_exit_s` (or, when other writers share the group, `join_timeout_s` after starting)."""
        # Every batch's events outlive a few young collections, so full collections run often; freezing
        # what is alive at start (modules, schemas, clients: most of the heap) keeps each one
        # proportional to the batches (measured: ~30% of the writer's CPU time otherwise).
        gc.collect()
        gc.freeze()
        producer = EventProducer(self.settings, client_id="ledger-dlq")
        consumer = EventConsumer(self.settings, self.config.consumer_group, [TASKS, ROLLOUT, TRAINER], producer,
                                 client_id="ledger", on_assigned=self._assigned, decode=decode_columnar,
                                 on_revoked=self._wait_for_flush)
        # One flush at a time runs on this thread while the next batch is collected (Parquet encoding
        # and fsync release the GIL); its offsets are committed once it is durable, before the next.
        flusher = ThreadPoolExecutor(1, thread_name_prefix="ledger-flush")
        try:
            idle_since = None  # counted from when the group gave us every partition
            started = time.monotonic()
            while stop is None or not stop.is_set():
                replacements = consumer.broker_replacements
                batch = self._collect(consumer)
                rejected = consumer.take_rejected()
                polled = consumer.polled()
                # The log its offsets count in; none when the broker was found replaced meanwhile (the
                # batch may mix both logs' offsets, so its journal entries must set no position).
                cluster = consumer.polled_cluster if consumer.broker_replacements == replacements else None
                flushed = self._settle(consumer, on_flush)
                self._receipt()
                if batch or rejected:  # a run of bad messages is progress too: kept, then committed
                    self._inflight = _Flush(flusher.submit(self._flush, batch, cluster, rejected), polled, cluster)
                    idle_since = None
                elif flushed:
                    idle_since = None
                elif idle_since is None:
                    complete = consumer.owns_all_partitions or time.monotonic() - started > join_timeout_s
                    idle_since = time.monotonic() if complete and consumer.assigned else None
                elif not follow and time.monotonic() - idle_since > idle_exit_s:
                    break
            self._settle(consumer, on_flush)
            return self.stats
        finally:
            self._wait_for_flush()  # after an error: let a running write finish (nothing is committed)
            self._receipt(force=True)
            flusher.shutdown()
            consumer.close()
            producer.close()
            gc.unfreeze()

    def _settle(self, consumer: EventConsumer, on_flush) -> bool:
        """Wait for the flush in flight (raising its error), then commit what it covered."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return False
        entries = inflight.future.result()
        # Only now: its files are durable. Never into another log: offsets of a lost log, committed to
        # the group on the broker that replaced it, would make the next owner of a partition skip
        # that many new records (2 events of a soak were, until their outbox sent them again).
        same_log = inflight.cluster is not None and inflight.cluster == consumer.polled_cluster
        committed = same_log and self._commit(consumer, inflight.polled)
        self._journaled(entries, committed)
        self.last_flush_at = time.perf_counter()
        if on_flush:
            on_flush(self.stats)
        return True

    def _wait_for_flush(self) -> None:
        """Block until the flush in flight has ended (the group waits with the rebalance meanwhile, so
        the next owner of a partition reads a journal whose files all exist)."""
        inflight = self._inflight
        if inflight is not None:
            wait([inflight.future])

    @staticmethod
    def _commit(consumer: EventConsumer, polled: dict[tuple[str, int], int]) -> bool:
        held = consumer.assignment()  # a partition taken away meanwhile is its new owner's to commit
        offsets = {source: offset for source, offset in polled.items() if source in held}
        return bool(offsets) and consumer.commit(offsets)

    def _waited(self, seconds: float) -> None:
        self.stats.store_waited_s += seconds

    def _collect(self, consumer: EventConsumer) -> list[Delivered]:
        batch: list[Delivered] = []
        dead_lettered = consumer.dead_lettered
        deadline = time.monotonic() + self.config.max_batch_seconds
        while len(batch) < self.config.max_batch_events and time.monotonic() < deadline:
            remaining_ms = max(1, int((deadline - time.monotonic()) * 1000))
            got = consumer.poll(timeout_ms=min(remaining_ms, 200))
            if got and self.first_poll is None:
                self.first_poll = (time.perf_counter(), len(got))
            batch += got
        self.stats.dead_lettered += consumer.dead_lettered - dead_lettered
        return batch

    def _flush(self, batch: list[Delivered], cluster: str | None = None, rejected: list[Rejected] = ()
               ) -> dict[tuple[str, int], str]:
        """Write the batch's new events, after journaling which files will hold each partition's, and
        the messages dead-lettered meanwhile; returns the journal entries (to delete once the
        offsets are committed)."""
        if rejected:  # the dead-letter topic is in memory too on the local stack: the ledger keeps them
            self._write_file(f"{self.root}/{DEAD_LETTERS}/part-{datetime.now(UTC):%Y%m%dT%H%M%S%f}-"
                             f"{uuid.uuid4().hex[:8]}.parquet", dead_letter_table(rejected), "writing dead letters")
            self.receipts.add([r.dead_letter_id for r in rejected])
        groups: dict[tuple[str, str], list[Event]] = defaultdict(list)
        files: dict[tuple[str, str], str] = {}
        by_partition: dict[tuple[str, int], set[str]] = defaultdict(set)
        last: dict[tuple[str, int], int] = {}
        for d in batch:
            source = (d.topic, d.partition)
            last[source] = max(last.get(source, -1), d.offset)
            e = d.event
            if e.event_id in self.recent:
                self.stats.duplicates += 1
                continue
            self.recent.add(e.event_id)  # also drops a duplicate inside this batch
            key = (e.run_id, e.event_type)
            groups[key].append(e)
            files.setdefault(key, self._path(*key))
            by_partition[source].add(files[key])
        entries = {source: self.journal.record(*source, last[source], sorted(paths), cluster)
                   for source, paths in by_partition.items()}
        for key, events in groups.items():
            self._write(*key, events, files[key])
        self.receipts.add([d.event.event_id for d in batch])  # durable now, repeats included
        now = datetime.now(UTC)
        lag = max(((now - d.event.emitted_at).total_seconds() for d in batch), default=0.0)
        self.stats.lags.append(lag)
        self.stats.max_lag_s = max(self.stats.max_lag_s, lag)
        return entries

    def _receipt(self, force: bool = False) -> None:
        obsolete, self._obsolete = self._obsolete, []
        if self.receipts.maybe_write(force):
            self.journal.delete(obsolete)
        else:
            self._obsolete[:0] = obsolete

    def _journaled(self, entries: dict[tuple[str, int], str], committed: bool) -> None:
        """After a commit, a partition's older journal entries name nothing that can come again; its
        newest stays as the ledger's record of its position."""
        for source, entry in entries.items():
            known = self._entries.setdefault(source, []) + [entry]
            if committed:
                self._obsolete += known[:-1]
                known = known[-1:]
            self._entries[source] = known

    def _path(self, run_id: str, event_type: str) -> str:
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%f")
        return f"{self.root}/run_id={run_id}/event_type={event_type}/part-{stamp}-{uuid.uuid4().hex[:8]}.parquet"

    def _write(self, run_id: str, event_type: str, events: list[Event], path: str | None = None) -> None:
        table = with_summaries(event_type, columnar_table(events, BY_NAME[event_type]))
        self._write_file(path or self._path(run_id, event_type), table, "writing a ledger file")
        self.stats.written += len(events)
        self.stats.files += 1

    def _write_file(self, path: str, table: pa.Table, what: str) -> None:
        buf = io.BytesIO()
        pq.write_table(table, buf, compression=self.config.compression, row_group_size=self.config.row_group_size)
        data = buf.getvalue()
        if self._put is None:
            write_atomic(path, data)
        else:
            patiently(lambda: self._put(path, data), what, self.config.store_patience_s, self._waited)
        self.stats.bytes += len(data)
