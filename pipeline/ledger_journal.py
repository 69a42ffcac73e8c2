"""Where a ledger writer stands in each source partition, kept in the ledger itself: the claims that make
every record of a partition land in one set of files, whichever writers handle it and however long any
of them stalls.

A claim is `<root>/_journal/<topic>/<partition>/<start>-<cluster>.json`: "records [start, end) of this
partition, in the log of this broker cluster, are written to exactly these files, holding exactly the
records at these offsets". It is created with an exclusive create (an object store's `If-None-Match: *`
PUT; a local link(2)), before any of its files is written:

- A partition's claims chain: a writer claims from where its previous claim ended, or, once it is given
  the partition, from where the newest claim ends. Two writers that hold the same records (a stalled
  member the group replaced, a batch collected across a rebalance) try to create the same claim; one
  fails and takes the winner's range as written: the records it holds below the winner's end are
  dropped (`pipeline.ledger_claims`).
- After creating one, a writer checks that no claim starts after its own (a chain that moved on and
  deleted the entry it recreated): if one does, it deletes its claim and drops those records.
- A claim's files are a pure function of its offsets: anyone may write them, any number of times, and
  every write holds the same rows. A writer given a partition whose newest claim lacks files writes
  them itself from the log (its writer may be dead, or paused for good); the claimant, resumed, writes
  the same rows to the same paths. So no record is ever in two files, for any length of any pause.
- The event ids of the files named (that exist) go into `RecentIds`, so a producer's duplicate sent
  again is skipped; records below the newest claim's end are dropped on delivery. So offsets the
  broker forgot (group offsets expire after days without a member) cost reading, not duplicates.
- After a commit, older claims are deleted once a receipt names their events; the newest stays as the
  ledger's own record of the partition's position (and of the chain).

A batch whose offsets may mix two logs (the broker was found replaced while it was polled) cannot be
placed in a chain: its entry gets a unique name, claims nothing and sets no position. Entries of the
journal's first format (no `start`) are read as complete-or-not, as they were written.

The journal is per topic, not per consumer group: it describes what this ledger holds.
"""

from __future__ import annotations

import io
import json
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pipeline.files import TMP_SUFFIX, write_atomic
from pipeline.hashing import sha256_hex

JOURNAL = "_journal"


class ClaimTaken(Exception):
    """An exclusive create found the path taken: another writer's claim holds it."""


@dataclass(frozen=True)
class ClaimedFile:
    path: str
    event_type: str
    offsets: tuple[tuple[int, int], ...]
    """The records it holds, as runs [low, high) of the partition's offsets, in order."""


@dataclass(frozen=True)
class Claim:
    path: str
    start: int | None
    """None: an entry that claims nothing (first format, or a batch across two logs)."""
    end: int
    cluster: str | None
    files: tuple[ClaimedFile, ...] = ()
    paths: tuple[str, ...] = ()
    """Every file it names (first-format entries name paths without their offsets)."""


class RecentIds:
    """A set of the last `capacity` event ids added (oldest forgotten first). The writer's flush thread
    and its consumer's IO thread (loading the journal of a partition just assigned) both add.
    `forgotten_at`: the wall time at which the newest forgotten id was added (0.0: none forgotten),
    the start of what this set still knows."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._order: deque[tuple[str, float]] = deque()
        self._ids: set[str] = set()
        self._lock = threading.Lock()
        self.forgotten_at = 0.0

    def __contains__(self, event_id: str) -> bool:
        return event_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def add(self, event_id: str) -> None:
        with self._lock:
            if event_id in self._ids:
                return
            self._order.append((event_id, time.time()))
            self._ids.add(event_id)
            while len(self._order) > self.capacity:
                forgotten, self.forgotten_at = self._order.popleft()
                self._ids.discard(forgotten)

    def update(self, event_ids: Iterable[str]) -> None:
        for event_id in event_ids:
            self.add(event_id)


class Journal:
    """The claims of flushes into one ledger, per source partition."""

    def __init__(self, fs: pafs.FileSystem, root: str, put=None, create=None):
        """`put(path, data)`: an atomic object write (S3); `create(path, data)`: the same, raising
        `ClaimTaken` when the path exists. None for both: local files."""
        self.fs, self.root = fs, root
        self.local = put is None
        self._put = put or write_atomic
        self._create = create or create_exclusive
        self.loaded_files = 0
        """Ledger files whose ids were read back from the journal (a figure for tests and benchmarks)."""

    def _dir(self, topic: str, partition: int) -> str:
        return f"{self.root}/{JOURNAL}/{topic}/{partition}"

    def claim(
        self, topic: str, partition: int, start: int | None, end: int, files: list[ClaimedFile], cluster: str | None
    ) -> tuple[bool, Claim]:
        """Claim records [start, end) for `files`: (True, the claim), or (False, the claim of another
        writer that holds `start` or a later one). `start` None, or no `cluster`: an entry that claims
        nothing (always made)."""
        doc = {
            "start": start,
            "end": end,
            "last_offset": end - 1,
            "cluster": cluster,
            "files": [f.path for f in files],
            "rows": {f.path: {"event_type": f.event_type, "offsets": f.offsets} for f in files},
        }
        if start is None or cluster is None:
            path = f"{self._dir(topic, partition)}/{end - 1:020d}-{uuid.uuid4().hex[:8]}.json"
            self._put(path, json.dumps({**doc, "start": None}).encode())
            return True, _claim(path, {**doc, "start": None})
        path = f"{self._dir(topic, partition)}/{start:020d}-{_tag(cluster)}.json"
        while True:
            try:
                self._create(path, json.dumps(doc).encode())
                break
            except ClaimTaken:
                try:
                    return False, self.load(path)
                except FileNotFoundError:  # deleted since, as obsolete: the check below decides
                    continue
        ours = _claim(path, doc)
        later = [
            c
            for c in self.claims(topic, partition)
            if c.cluster == cluster and c.start is not None and c.path != path and c.start > start
        ]
        if later:  # the chain moved on past `start` and deleted the claim this one recreates
            self.delete([path])
            return False, min(later, key=lambda c: c.start)
        return True, ours

    def entries(self, topic: str, partition: int) -> list[str]:
        infos = self.fs.get_file_info(pafs.FileSelector(self._dir(topic, partition), allow_not_found=True))
        return sorted(i.path for i in infos if i.type == pafs.FileType.File and i.path.endswith(".json"))

    def claims(self, topic: str, partition: int) -> list[Claim]:
        out = []
        for entry in self.entries(topic, partition):
            try:
                out.append(self.load(entry))
            except FileNotFoundError:  # deleted by its writer after its commit since the listing
                continue
        return out

    def load(self, path: str) -> Claim:
        return _claim(path, json.loads(self._read(path)))

    def exists(self, path: str) -> bool:
        return self.fs.get_file_info(path).type == pafs.FileType.File

    def read(self, topic: str, partition: int, cluster: str | None) -> Position:
        """The event ids the partition's entries name in existing files, the offset below which every
        record is in the ledger, and the newest claim if its files are still to be written."""
        if self.local:  # an entry whose write a crash cut short was never renamed into place: it named nothing
            for tmp in Path(self._dir(topic, partition)).glob(f"*.json*{TMP_SUFFIX}"):
                tmp.unlink(missing_ok=True)
        claims = self.claims(topic, partition)
        position = Position(set(), [c.path for c in claims], None)
        complete = {c.path: self._load_ids(c, position.ids) for c in claims}
        ours = [
            c
            for c in claims
            if cluster is not None and c.cluster == cluster and (c.start is not None or complete[c.path])
        ]
        if ours:
            newest = max(ours, key=lambda c: c.end)
            position.start = newest.end
            position.pending = None if complete[newest.path] else newest
            position.superseded = [c.path for c in claims if c.path != newest.path]
        return position

    def _load_ids(self, claim: Claim, ids: set[str]) -> bool:
        """Add the ids of the claim's files that exist; whether all exist."""
        complete = True
        for path in claim.paths:
            if self.exists(path):
                ids.update(pq.read_table(path, columns=["event_id"], filesystem=self.fs).column(0).to_pylist())
                self.loaded_files += 1
            else:
                complete = False
                if self.local:  # what a crash left of it: a temporary beside it
                    for tmp in Path(path).parent.glob(f"{Path(path).name}.*{TMP_SUFFIX}"):
                        tmp.unlink(missing_ok=True)
        return complete

    def named_files(self) -> set[str]:
        """Every ledger file any entry names (compaction leaves these alone)."""
        infos = self.fs.get_file_info(pafs.FileSelector(f"{self.root}/{JOURNAL}", recursive=True, allow_not_found=True))
        out: set[str] = set()
        for i in infos:
            if i.type == pafs.FileType.File and i.path.endswith(".json"):
                try:
                    out.update(json.loads(self._read(i.path))["files"])
                except FileNotFoundError:  # a writer deleted it after its commit: it named nothing needed
                    continue
        return out

    def delete(self, entries: Iterable[str]) -> None:
        """Best effort: an entry left behind names files that exist, which costs a reader only time
        (the store may be down or full; pyarrow's S3 delete writes a folder marker)."""
        for entry in entries:
            try:
                self.fs.delete_file(entry)
            except OSError:
                pass

    def _read(self, path: str) -> bytes:
        with self.fs.open_input_stream(path) as f:
            return f.read()


def _claim(path: str, doc: dict) -> Claim:
    rows = doc.get("rows") or {}
    files = tuple(ClaimedFile(p, r["event_type"], tuple(tuple(run) for run in r["offsets"])) for p, r in rows.items())
    return Claim(
        path, doc.get("start"), doc.get("end", doc["last_offset"] + 1), doc["cluster"], files, tuple(doc["files"])
    )


def _tag(cluster: str) -> str:
    return sha256_hex(cluster.encode())[:12]


@dataclass
class Position:
    """What the journal says of one partition."""

    ids: set[str]
    """Event ids already in the ledger that may be delivered again."""
    entries: list[str]
    """The journal entries read."""
    start: int | None
    """Every record below this offset is in the ledger, or claimed (None: no claim of this cluster)."""
    superseded: list[str] = field(default_factory=list)
    """The entries but the newest claim: once their events are in a receipt, they are needed no more
    (a writer killed before its receipt leaves a few)."""
    pending: Claim | None = None
    """The newest claim, when some of its files are missing: the new owner writes them."""


def create_exclusive(path: str, data: bytes) -> None:
    """A local atomic write that fails with `ClaimTaken` if `path` exists: a complete temporary,
    hard-linked to its name (link(2) never replaces)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{path}.{uuid.uuid4().hex[:8]}{TMP_SUFFIX}"
    write_atomic(tmp, data)
    try:
        os.link(tmp, path)
    except FileExistsError as exc:
        raise ClaimTaken(path) from exc
    finally:
        os.unlink(tmp)
    dir_fd = os.open(Path(path).parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def s3_put(client, path: str, data: bytes) -> None:
    """One PUT with a length: the object appears whole or not at all. (pyarrow's multipart writer
    sends parts without Content-Length, which radosgw refuses with HTTP 411.)"""
    bucket, key = path.split("/", 1)
    client.put_object(bucket, key, io.BytesIO(data), len(data))


def s3_create(client, path: str, data: bytes) -> None:
    """`s3_put` that fails with `ClaimTaken` where the object exists: `If-None-Match: *`, which
    radosgw (16.2 here) and MinIO decide atomically. minio-py has no public parameter for it."""
    from minio.error import S3Error

    bucket, key = path.split("/", 1)
    try:
        client._put_object(bucket, key, data, headers={"If-None-Match": "*", "Content-Length": str(len(data))})
    except S3Error as exc:
        if exc.code in ("PreconditionFailed", "ConditionalRequestConflict"):
            raise ClaimTaken(path) from exc
        raise
