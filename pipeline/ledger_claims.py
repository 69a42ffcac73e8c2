"""A ledger flush, placed in each source partition's chain of claims (`pipeline.ledger_journal`).

Invariant a reader relies on: each record of a partition is in the files of at most one claim, and a
claim's files hold exactly the records it lists, whoever writes them and however often. So a writer
may stall for any time at any step (a SIGSTOP, a VM pause, a store holding its PUT past the group's
session) and resume: its claim either failed (it drops those records) or won (whatever it writes, the
partition's new owner writes the same rows to the same paths).

Per partition, a flush:
1. plans one file per (run, event type) of the partition's new events (not in `RecentIds`, not found
   in the ledger by `ledger_resends`, not repeated in the batch), each listing its offsets;
2. claims [position, end of what was polled) for those files;
3. won: writes the files, and its position moves to the claim's end. Lost: the winner's range is
   written (by its writer, or now by this one, from the log, if its files are missing); the records
   below its end are dropped, and the rest are planned and claimed again from there.

A partition's files are its own (a file never holds two partitions' records), so anyone can write a
claim's files from that one partition's log.

Not covered: a batch polled across a broker's replacement claims nothing (`Journal.claim`), and a
claim whose log was lost cannot be written by anyone else (its events come back from the outboxes). And
compaction leaves a claim's files alone only while a journal entry names them: a writer paused past its
claim's deletion (a newer claim and a receipt later) and past compaction merging and deleting those
files would, resumed, put one back beside the merged copy. Closing that needs compaction to leave a
tombstone under each name it deletes and the writer's PUTs to be conditional on its absence.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import pyarrow.parquet as pq
from kafka import KafkaConsumer
from kafka.structs import TopicPartition

from pipeline.consumer import Delivered
from pipeline.ledger_journal import Claim, ClaimedFile, Journal, Position, RecentIds
from pipeline.settings import StackSettings
from schemas import Event
from schemas.columnar import decode_columnar

log = logging.getLogger(__name__)

Source = tuple[str, int]


def runs(offsets: list[int]) -> tuple[tuple[int, int], ...]:
    """Sorted offsets as runs [low, high): a batch's offsets are mostly contiguous."""
    out: list[list[int]] = []
    for o in offsets:
        if out and out[-1][1] == o:
            out[-1][1] = o + 1
        else:
            out.append([o, o + 1])
    return tuple((lo, hi) for lo, hi in out)


def in_runs(offset: int, spans: tuple[tuple[int, int], ...]) -> bool:
    return any(lo <= offset < hi for lo, hi in spans)


@dataclass
class Placed:
    """What a flush did in one partition."""

    entries: list[str] = field(default_factory=list)
    """Claims it made or found in its way (to delete once obsolete), oldest first."""
    duplicates: int = 0
    ids: list[str] = field(default_factory=list)
    """Event ids now in the ledger, for the receipts (its own and those of claims it found)."""


class Chains:
    """This writer's position in each partition's chain of claims, the claims it must write for a
    writer that left them, and the placing of a flush's records (the module docstring)."""

    def __init__(
        self,
        journal: Journal,
        recent: RecentIds,
        write: Callable[[ClaimedFile, list[Event]], None],
        fetch: Callable[[str, int, int, int], dict[int, Event]],
        path_for: Callable[[str, str], str],
    ):
        """`write(file, events)`: one file; `fetch(topic, partition, start, end)`: the log's valid
        events in [start, end), by offset; `path_for(run_id, event_type)`: a new file's path."""
        self.journal, self.recent, self.write, self.fetch, self.path_for = journal, recent, write, fetch, path_for
        self._positions: dict[Source, tuple[str | None, int | None]] = {}
        """Per partition: the log (cluster id) its position counts in, and the position."""
        self._pending: dict[Source, Claim] = {}
        self._lock = threading.Lock()  # the consumer's IO thread assigns, the flush thread places
        self.completed = 0
        """Files this writer wrote for claims of another writer (or of itself before a restart)."""

    def assigned(self, source: Source, position: Position, cluster: str | None) -> None:
        with self._lock:
            self._positions[source] = (cluster, position.start)
            self._pending.pop(source, None)
            if position.pending is not None:
                self._pending[source] = position.pending

    def revoked(self, sources: set[Source]) -> None:
        """Their next owner continues their chains (and writes what a claim still lacks)."""
        with self._lock:
            for source in sources:
                self._positions.pop(source, None)
                self._pending.pop(source, None)

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def write_pending(self, cluster: str | None) -> Placed:
        """Write the claims found without their files when their partitions were assigned."""
        with self._lock:
            pending, self._pending = self._pending, {}
        placed = Placed()
        for source, claim in sorted(pending.items()):
            self._complete(source, claim, cluster, placed)
        return placed

    def place(
        self,
        source: Source,
        records: list[Delivered],
        first: int | None,
        end: int,
        cluster: str | None,
        known: set[str],
    ) -> Placed:
        """Claim and write one partition's records of a batch: `records` (offset order) and the
        offsets up to `end` (exclusive) that gave none; `first`: its lowest offset in the batch (the
        chain's start where the journal had no claim of this log); `known`: ids found in the ledger."""
        placed = Placed()
        with self._lock:
            log_of, start = self._positions.get(source, (None, None))
        # A position counts in one log: after a broker lost its log (a new cluster id, offsets from 0
        # again) or for a batch that mixes two logs (no cluster), it would drop new records as old.
        start = first if start is None or cluster is None or log_of != cluster else start
        if start is None or start >= end:
            return placed
        while True:
            batch = [d for d in records if d.offset >= start]
            files, tables, duplicates = self._plan(source, batch, known)
            won, claim = self.journal.claim(*source, start, end, files, cluster)
            if won:
                break
            log.info("claim of %s from %d taken (to %d): its records are that claim's", source, start, claim.end)
            self._complete(source, claim, cluster, placed)
            if claim.end >= end:
                return self._moved(source, claim.end, cluster, placed)
            start = claim.end
        for f in files:
            self.write(f, tables[f.path])
            ids = [e.event_id for e in tables[f.path]]
            self.recent.update(ids)
            placed.ids += ids
        placed.entries.append(claim.path)
        placed.duplicates += duplicates
        return self._moved(source, end, cluster, placed)

    def _moved(self, source: Source, position: int, cluster: str | None, placed: Placed) -> Placed:
        with self._lock:
            self._positions[source] = (cluster, position)
        return placed

    def _plan(
        self, source: Source, batch: list[Delivered], known: set[str]
    ) -> tuple[list[ClaimedFile], dict[str, list[Event]], int]:
        """One file per (run, type) of the new events; `RecentIds` is not touched (a lost claim
        plans again)."""
        seen: set[str] = set()
        groups: dict[tuple[str, str], list[Delivered]] = defaultdict(list)
        duplicates = 0
        for d in batch:
            e = d.event
            if e.event_id in self.recent or e.event_id in known or e.event_id in seen:
                duplicates += 1
                continue
            seen.add(e.event_id)
            groups[(e.run_id, e.event_type)].append(d)
        files, tables = [], {}
        for (run_id, event_type), ds in groups.items():
            f = ClaimedFile(self.path_for(run_id, event_type), event_type, runs([d.offset for d in ds]))
            files.append(f)
            tables[f.path] = [d.event for d in ds]
        return files, tables, duplicates

    def _complete(self, source: Source, claim: Claim, cluster: str | None, placed: Placed) -> None:
        """Make sure another writer's claim is in the ledger: its missing files are written here,
        from the log (the same rows its writer would write)."""
        placed.entries.append(claim.path)
        missing = [f for f in claim.files if not self.journal.exists(f.path)]
        if missing and (claim.cluster is None or claim.cluster != cluster):
            log.warning(
                "claim %s lacks %d files and its log is not the live one: its events come again "
                "only from their producers' outboxes",
                claim.path,
                len(missing),
            )
            missing = []
        if missing:
            events = self.fetch(*source, claim.start, claim.end)
            for f in missing:
                listed = [o for lo, hi in f.offsets for o in range(lo, hi)]
                if any(o not in events for o in listed):
                    raise LookupError(f"the log no longer holds every record of claim {claim.path}")
                self.write(f, [events[o] for o in listed])
                self.completed += 1
            log.info("wrote %d files of claim %s, which its writer had not written", len(missing), claim.path)
        for f in claim.files:
            if self.journal.exists(f.path):
                ids = pq.read_table(f.path, columns=["event_id"], filesystem=self.journal.fs).column(0).to_pylist()
                self.recent.update(ids)
                placed.ids += ids


def fetch_range(
    settings: StackSettings, topic: str, partition: int, start: int, end: int, timeout_s: float = 120.0
) -> dict[int, Event]:
    """The valid events at offsets [start, end) of one partition, read without joining a group.
    A position the log no longer holds is reset to its start by the client: the caller checks that
    every offset it needs came."""
    kafka = KafkaConsumer(
        bootstrap_servers=settings.kafka_bootstrap,
        client_id="ledger-claims",
        enable_auto_commit=False,
        max_partition_fetch_bytes=16 * 1024 * 1024,
    )
    tp = TopicPartition(topic, partition)
    try:
        kafka.assign([tp])
        kafka.seek(tp, start)
        out: dict[int, Event] = {}
        deadline = time.monotonic() + timeout_s
        while kafka.position(tp) < end:
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading {topic}/{partition} [{start}, {end}) did not finish in {timeout_s} s")
            for r in kafka.poll(timeout_ms=500).get(tp, []):
                if r.offset < end and r.value is not None:
                    try:
                        out[r.offset] = decode_columnar(r.value)
                    except ValueError:  # dead-lettered when it was polled: no claim lists it
                        continue
        return out
    finally:
        kafka.close()
