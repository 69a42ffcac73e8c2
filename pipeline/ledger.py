"""The ledger writer: the event log folded into Parquet, exactly once.

Exactly-once here is at-least-once delivery plus idempotent writes: offsets are committed only after
the Parquet files holding the batch are durable, and an event that can come again is skipped by id.
A batch is written on a thread while the next one is collected, and committed before the next is
written. Several writers in one consumer group share the partitions (`awrl ledger sync --follow`, once
per process). Every writer can stall for any time at any step; what keeps each record in one file is
the journal's claims (`pipeline.ledger_journal`, `pipeline.ledger_claims`), not timing:

- A flush claims each partition's range before writing its files, and a partition's records go to
  files of their own, which anyone can write again from the log with the same rows. A writer whose
  claim is taken drops those records; a writer given a partition writes what its newest claim lacks.
  So a `kill -9`, a member the group replaced while it was paused (SIGSTOP, a store holding its PUT),
  and its resumption, all leave each record in one file.
- A member losing partitions finishes its write before it rejoins, and drops the records of those
  partitions from the batch it is collecting (their next owner reads them again).
- The partitions' journal and the receipts are read when the group assigns them, on the consumer's IO
  thread, whose caller only logs an exception: a failure there reaches the polling thread, which
  rejoins the group instead of going on without them (`AssignmentFailed`).
- Events emitted before what the writer's memory covers (a producer that resent after being down past
  the receipts' window) are looked up in the ledger's files (`pipeline.ledger_resends`).

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
import itertools
import logging
import threading
import time
import uuid
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import UTC, datetime

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pipeline.bus import EventProducer
from pipeline.compaction import CompactionConfig, CompactionResult, compact_run, visible_files
from pipeline.consumer import Delivered, EventConsumer, Rejected
from pipeline.files import write_atomic
from pipeline.ledger_claims import Chains, Placed, fetch_range
from pipeline.ledger_config import LedgerConfig, LedgerStats  # also imported from here
from pipeline.ledger_dead_letters import DEAD_LETTERS, dead_letter_table, read_dead_letters  # noqa: F401 - imported from here
from pipeline.ledger_journal import ClaimedFile, Journal, RecentIds, s3_create, s3_put
from pipeline.ledger_resends import LedgerLookup, Memory
from pipeline.receipts import ReceiptReader, ReceiptWriter
from pipeline.s3 import ledger_filesystem, minio_client, patiently
from pipeline.settings import StackSettings
from pipeline.summaries import with_summaries
from pipeline.topics import ROLLOUT, TASKS, TRAINER
from schemas import BY_NAME, Event, arrow_schema
from schemas.columnar import columnar_table, decode_columnar

log = logging.getLogger(__name__)


def list_parquet(fs: pafs.FileSystem, root: str) -> list[str]:
    """The live Parquet files under `root`: compaction's manifests decide which of a merged file and
    its sources a reader sees (`pipeline.compaction.view_steps`), so every row is read exactly once."""
    return [p for p in visible_files(fs, root) if not _own_folder(root, p)]


def _own_folder(root: str, path: str) -> bool:
    """Under a top folder named `_...`: the ledger's own (journal, receipts, dead letters), not events."""
    return path[len(root) :].lstrip("/").startswith("_")


def read_events(
    settings: StackSettings,
    run_id: str,
    event_type: str,
    columns: list[str] | None = None,
    where: pc.Expression | None = None,
) -> pa.Table:
    """All ledger events of one type in one run (those `where` selects), each `event_id` once; an empty
    table (same schema) when there are none yet.

    Files are listed explicitly rather than read as a directory, so a temporary (`*.tmp`) being written by
    the writer at this moment is never read half-finished.
    """
    fs, root = ledger_filesystem(settings)
    files = list_parquet(fs, f"{root}/run_id={run_id}/event_type={event_type}")
    dataset = ds.dataset(files, schema=arrow_schema(BY_NAME[event_type]), format="parquet", filesystem=fs)
    keyed = columns is not None and "event_id" not in columns
    table = dataset.to_table(columns=[*columns, "event_id"] if keyed else columns, filter=where)
    table = first_of_each(table)
    return table.drop_columns(["event_id"]) if keyed else table


def stored_event_ids(settings: StackSettings, run_id: str, event_type: str) -> list[str]:
    """The event id of every stored row of one type in one run, a row written twice twice: what an
    exactly-once check counts (`read_events` reads each id once)."""
    fs, root = ledger_filesystem(settings)
    files = list_parquet(fs, f"{root}/run_id={run_id}/event_type={event_type}")
    if not files:
        return []
    return ds.dataset(files, filesystem=fs, format="parquet").to_table(columns=["event_id"]).column(0).to_pylist()


def first_of_each(table: pa.Table) -> pa.Table:
    """The table with each `event_id`'s first row only: a defence against a duplicate that got into the
    ledger anyway. One hash pass when there is none (the usual case)."""
    ids = table.column("event_id")
    if pc.count_distinct(ids).as_py() == table.num_rows:
        return table
    rows = pa.table({"event_id": ids, "row": pa.array(range(table.num_rows), pa.int64())})
    first = rows.group_by("event_id", use_threads=False).aggregate([("row", "min")]).column("row_min")
    return table.take(pc.sort_indices(first))


def compact_ledger(
    settings: StackSettings, run_id: str, config: CompactionConfig = CompactionConfig()
) -> dict[str, CompactionResult]:
    """Merge one run's small files (`pipeline.compaction`), on the local or S3 ledger."""
    fs, root = ledger_filesystem(settings)
    return compact_run(fs, root, run_id, config, _object_put(settings, fs))


def _object_put(settings: StackSettings, fs: pafs.FileSystem, exclusive: bool = False):
    """The S3 ledger's atomic write (`s3_put` through one client), or with `exclusive` its atomic
    create (`s3_create`); None on a local ledger, whose writers use `write_atomic`."""
    if isinstance(fs, pafs.LocalFileSystem):
        return None
    client, write = minio_client(settings), s3_create if exclusive else s3_put
    return lambda path, data: write(client, path, data)


class AssignmentFailed(RuntimeError):
    """The journal or receipts of partitions just assigned could not be read (the writer rejoins)."""


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
        self.memory = Memory(self.recent)
        self.lookup = LedgerLookup(self.fs, self.root)
        """Ids of old events in the ledger's files (`pipeline.ledger_resends`)."""
        self._put = _object_put(settings, self.fs)
        self.journal = Journal(
            self.fs,
            self.root,
            self._patient(self._put, "writing the ledger's journal"),
            self._patient(_object_put(settings, self.fs, exclusive=True), "claiming in the journal"),
        )
        self.chains = Chains(
            self.journal, self.recent, self._write_claimed, lambda *r: fetch_range(settings, *r), self._path
        )
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
        self._revoked: set[tuple[str, int]] = set()
        """Partitions taken away while a batch is collected: their records in it are dropped."""
        self._lock = threading.Lock()
        self._assign_error: BaseException | None = None

    def _patient(self, put, what: str):
        return (
            None
            if put is None
            else (
                lambda path, data: patiently(lambda: put(path, data), what, self.config.store_patience_s, self._waited)
            )
        )

    def _assigned(self, partitions: set[tuple[str, int]], cluster: str | None) -> dict[tuple[str, int], int]:
        """A partition's uncommitted flushes (ours or a dead member's) are in the ledger: skip their ids,
        and every record up to the newest claim (`EventConsumer` drops them). Runs inside the client's
        rebalance, which logs an exception and goes on, or (kafka-python 3.0) raises it again from
        `poll()`: no floors, or a writer stopped by a passing store error. The error
        is kept for `_collect` instead, and the writer joins the group again."""
        try:
            return self._load(partitions, cluster)
        except Exception as exc:  # noqa: BLE001 - raised on the polling thread (`_collect`)
            with self._lock:
                self._assign_error = exc
            return {}

    def _load(self, partitions: set[tuple[str, int]], cluster: str | None) -> dict[tuple[str, int], int]:
        starts = {}
        # What any writer wrote lately, from its receipts: an outbox sends again what a broker lost,
        # some of which a writer (maybe a dead one) had already written.
        self.recent.update(self._receipts_read.new_ids())
        self.memory.read_receipts()
        for source in sorted(partitions):
            position = self.journal.read(*source, cluster)
            self.recent.update(position.ids)
            # Written, but maybe never in a receipt (a writer killed between the two): say so again.
            self.receipts.add(sorted(position.ids))
            self._obsolete += position.superseded  # deleted once that receipt is written
            self._entries[source] = [e for e in position.entries if e not in position.superseded]
            self.chains.assigned(source, position, cluster)
            if position.start is not None:
                starts[source] = position.start
        return starts

    def _partitions_revoked(self, partitions: set[tuple[str, int]]) -> None:
        """Before the member rejoins: the flush in flight ends, so the next owner of a partition reads a
        journal whose files all exist; and what the batch being collected holds of them is dropped."""
        self._wait_for_flush()
        with self._lock:
            self._revoked |= partitions
        self.chains.revoked(partitions)

    def sync(
        self, follow: bool = False, idle_exit_s: float = 3.0, on_flush=None, join_timeout_s: float = 60.0, stop=None
    ) -> LedgerStats:
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
        # One flush at a time runs on this thread while the next batch is collected (Parquet encoding
        # and fsync release the GIL); its offsets are committed once it is durable, before the next.
        flusher = ThreadPoolExecutor(1, thread_name_prefix="ledger-flush")
        try:
            for attempt in itertools.count():
                consumer = EventConsumer(
                    self.settings,
                    self.config.consumer_group,
                    [TASKS, ROLLOUT, TRAINER],
                    producer,
                    client_id="ledger",
                    on_assigned=self._assigned,
                    decode=decode_columnar,
                    on_revoked=self._partitions_revoked,
                )
                try:
                    return self._run(consumer, flusher, follow, idle_exit_s, on_flush, join_timeout_s, stop)
                except AssignmentFailed as exc:
                    self.stats.rejoins += 1
                    log.warning("rejoining the group: %s (%s)", exc, exc.__cause__)
                finally:
                    self._wait_for_flush()  # after an error: let a running write finish (nothing is committed)
                    self._inflight = None
                    self._receipt(force=True)
                    consumer.close()
                time.sleep(min(0.5 * 2**attempt, 10.0))
        finally:
            flusher.shutdown()
            producer.close()
            gc.unfreeze()

    def _run(
        self,
        consumer: EventConsumer,
        flusher: ThreadPoolExecutor,
        follow: bool,
        idle_exit_s: float,
        on_flush,
        join_timeout_s: float,
        stop,
    ) -> LedgerStats:
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
            # A run of bad messages is progress too (kept, then committed); a claim found without its
            # files is written even when nothing new comes.
            if batch or rejected or self.chains.has_pending:
                self._inflight = _Flush(flusher.submit(self._flush, batch, cluster, rejected, polled), polled, cluster)
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
        with self._lock:
            self._revoked.clear()
        while len(batch) < self.config.max_batch_events and time.monotonic() < deadline:
            remaining_ms = max(1, int((deadline - time.monotonic()) * 1000))
            got = consumer.poll(timeout_ms=min(remaining_ms, 200))
            batch = self._still_ours(batch, consumer) + got
            if got and self.first_poll is None:
                self.first_poll = (time.perf_counter(), len(got))
        self.stats.dead_lettered += consumer.dead_lettered - dead_lettered
        return batch

    def _still_ours(self, batch: list[Delivered], consumer: EventConsumer) -> list[Delivered]:
        """The batch without the records of partitions the group has taken away (their next owner reads
        them again from the journal's position), or `AssignmentFailed` if an assignment could not read
        its journal (nothing of this batch is written or committed). A partition revoked and given
        back keeps its records: the client keeps its position, so they would not come again."""
        with self._lock:
            error, self._assign_error = self._assign_error, None
            revoked = self._revoked - consumer.assignment() if self._revoked else set()
        if error is not None:
            raise AssignmentFailed("reading the journal of the partitions just assigned failed") from error
        return [d for d in batch if (d.topic, d.partition) not in revoked] if revoked else batch

    def _flush(
        self,
        batch: list[Delivered],
        cluster: str | None = None,
        rejected: list[Rejected] = (),
        polled: dict[tuple[str, int], int] | None = None,
    ) -> dict[tuple[str, int], list[str]]:
        """Write the dead letters, what claims found without their files lack, and each partition's
        new events, claimed first (`pipeline.ledger_claims`); returns the journal entries per partition
        (to delete once the offsets are committed and a receipt names their events)."""
        if rejected:  # the dead-letter topic is in memory too on the local stack: the ledger keeps them
            self._write_file(
                f"{self.root}/{DEAD_LETTERS}/part-{datetime.now(UTC):%Y%m%dT%H%M%S%f}-{uuid.uuid4().hex[:8]}.parquet",
                dead_letter_table(rejected),
                "writing dead letters",
            )
            self.receipts.add([r.dead_letter_id for r in rejected])
        pending = self.chains.write_pending(cluster)
        self.receipts.add(pending.ids)
        by_source: dict[tuple[str, int], list[Delivered]] = defaultdict(list)
        first, ends = {}, dict(polled or {})  # a partition revoked and given back is not in `polled`
        for source, offset in [((d.topic, d.partition), d.offset) for d in batch] + [
            ((r.source_topic, r.source_partition), r.source_offset) for r in rejected
        ]:
            first[source] = min(first.get(source, offset), offset)
            ends[source] = max(ends.get(source, 0), offset + 1)
        for d in batch:
            by_source[(d.topic, d.partition)].append(d)
        known = self.lookup.known([d.event for d in batch], self.memory.since)
        entries: dict[tuple[str, int], list[str]] = defaultdict(list)
        for source, end in sorted(ends.items()):
            placed: Placed = self.chains.place(
                source, by_source.get(source, []), first.get(source), end, cluster, known
            )
            entries[source] += placed.entries
            self.stats.duplicates += placed.duplicates
            self.receipts.add(placed.ids)
        # Repeats found in the ledger too, but nothing `place` skipped unwritten: a receipt lets the
        # producer's outbox delete an event, so it names only what the ledger's files hold.
        self.receipts.add([i for i in (d.event.event_id for d in batch) if i in known or i in self.recent])
        now = datetime.now(UTC)
        lag = max(((now - d.event.emitted_at).total_seconds() for d in batch), default=0.0)
        self.stats.lags.append(lag)
        self.stats.max_lag_s = max(self.stats.max_lag_s, lag)
        return dict(entries)

    def _receipt(self, force: bool = False) -> None:
        obsolete, self._obsolete = self._obsolete, []
        if self.receipts.maybe_write(force):
            self.journal.delete(obsolete)
        else:
            self._obsolete[:0] = obsolete

    def _journaled(self, entries: dict[tuple[str, int], list[str]], committed: bool) -> None:
        """After a commit, a partition's older journal entries name nothing that can come again; its
        newest stays as the ledger's record of its position."""
        for source, made in entries.items():
            known = list(dict.fromkeys(self._entries.get(source, []) + made))
            if committed and known:
                self._obsolete += known[:-1]
                known = known[-1:]
            self._entries[source] = known

    def _path(self, run_id: str, event_type: str) -> str:
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%f")
        return f"{self.root}/run_id={run_id}/event_type={event_type}/part-{stamp}-{uuid.uuid4().hex[:8]}.parquet"

    def _write(self, run_id: str, event_type: str, events: list[Event], path: str | None = None) -> None:
        """One file outside any claim (tests and benchmarks plant files with it)."""
        self._write_claimed(ClaimedFile(path or self._path(run_id, event_type), event_type, ()), events)

    def _write_claimed(self, f: ClaimedFile, events: list[Event]) -> None:
        table = with_summaries(f.event_type, columnar_table(events, BY_NAME[f.event_type]))
        self._write_file(f.path, table, "writing a ledger file")
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
