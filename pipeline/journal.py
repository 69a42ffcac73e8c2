"""Where a ledger writer stands in each source partition, kept in the ledger itself, so that exactly-once
needs memory and start-up bounded by what can be delivered again, not by the ledger's size.

A consumer re-reads only records after its partition's position, and a writer commits right after each
flush is durable. The records that can come twice are those of a flush whose commit did not happen (a
crash, a lost partition) and an event a producer sent twice seconds apart (a retry after a timeout):

- Before writing a flush's files, the writer records its intent per source partition:
  `<root>/_journal/<topic>/<partition>/<last offset>-<id>.json`, naming the files that will hold that
  partition's events and the broker's cluster id. After the commit, older entries are deleted; the newest
  stays as the ledger's own record of its position.
- A member given a partition (at start, on a rebalance, after another member died) reads the few
  entries there: the event ids of the named files that exist go into `RecentIds` (they are skipped if
  they come again), and records below the newest entry whose files all exist are dropped on delivery
  (of the same cluster: a broker that lost its log numbers offsets from 0 again). So offsets the
  broker forgot (group offsets expire after days without a member) cost reading, not duplicates.
- `RecentIds` keeps the last `capacity` event ids written, for a producer's duplicate.

The journal is per topic, not per consumer group: it describes what this ledger holds.
"""

from __future__ import annotations

import io
import json
import threading
import uuid
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pipeline.files import TMP_SUFFIX, write_atomic

JOURNAL = "_journal"


class RecentIds:
    """A set of the last `capacity` event ids added (oldest forgotten first). The writer's flush thread
    and its consumer's IO thread (loading the journal of a partition just assigned) both add."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._order: deque[str] = deque()
        self._ids: set[str] = set()
        self._lock = threading.Lock()

    def __contains__(self, event_id: str) -> bool:
        return event_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def add(self, event_id: str) -> None:
        with self._lock:
            if event_id in self._ids:
                return
            self._order.append(event_id)
            self._ids.add(event_id)
            while len(self._order) > self.capacity:
                self._ids.discard(self._order.popleft())

    def update(self, event_ids: Iterable[str]) -> None:
        for event_id in event_ids:
            self.add(event_id)


class Journal:
    """Intent records of flushes into one ledger, per source partition."""

    def __init__(self, fs: pafs.FileSystem, root: str, put=None):
        """`put(path, data)`: an atomic object write (S3); None writes local files atomically."""
        self.fs, self.root = fs, root
        self.local = put is None
        self._put = put or write_atomic
        self.loaded_files = 0
        """Ledger files whose ids were read back from the journal (a figure for tests and benchmarks)."""

    def _dir(self, topic: str, partition: int) -> str:
        return f"{self.root}/{JOURNAL}/{topic}/{partition}"

    def record(self, topic: str, partition: int, last_offset: int, files: list[str], cluster: str | None) -> str:
        """Durably note that `files` are about to hold this partition's events up to `last_offset`."""
        path = f"{self._dir(topic, partition)}/{last_offset:020d}-{uuid.uuid4().hex[:8]}.json"
        self._put(path, json.dumps({"last_offset": last_offset, "files": files, "cluster": cluster}).encode())
        return path

    def entries(self, topic: str, partition: int) -> list[str]:
        """The partition's entries, oldest first."""
        infos = self.fs.get_file_info(pafs.FileSelector(self._dir(topic, partition), allow_not_found=True))
        return sorted(i.path for i in infos if i.type == pafs.FileType.File and i.path.endswith(".json"))

    def read(self, topic: str, partition: int, cluster: str | None) -> Position:
        """The event ids the partition's entries name in existing files, and the offset below which
        every record is in the ledger."""
        position = Position(set(), self.entries(topic, partition), None)
        if self.local:  # an entry whose write a crash cut short was never renamed into place: it named nothing
            for tmp in Path(self._dir(topic, partition)).glob(f"*.json.*{TMP_SUFFIX}"):
                tmp.unlink(missing_ok=True)
        for entry in position.entries:
            record = json.loads(self._read(entry))
            complete = True
            for path in record["files"]:
                if self.fs.get_file_info(path).type == pafs.FileType.File:
                    position.ids.update(pq.read_table(path, columns=["event_id"], filesystem=self.fs).column(0).to_pylist())
                    self.loaded_files += 1
                else:
                    complete = False
                    if self.local:  # what the crash left of it: a temporary beside it
                        for tmp in Path(path).parent.glob(f"{Path(path).name}.*{TMP_SUFFIX}"):
                            tmp.unlink(missing_ok=True)
            if complete:
                position.superseded = position.entries[:position.entries.index(entry)]
            if complete and record["cluster"] == cluster and cluster is not None:
                position.start = max(position.start or 0, record["last_offset"] + 1)
        return position

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


@dataclass
class Position:
    """What the journal says of one partition."""

    ids: set[str]
    """Event ids already in the ledger that may be delivered again."""
    entries: list[str]
    """The journal entries read (oldest first)."""
    start: int | None
    """Every record below this offset is in the ledger (None: no complete entry of this cluster)."""
    superseded: list[str] = field(default_factory=list)
    """The entries older than the newest complete one: once their events are in a receipt, they are
    needed no more (a writer killed before its receipt leaves a few)."""


def s3_put(client, path: str, data: bytes) -> None:
    """One PUT with a length: the object appears whole or not at all. (pyarrow's multipart writer
    sends parts without Content-Length, which radosgw refuses with HTTP 411.)"""
    bucket, key = path.split("/", 1)
    client.put_object(bucket, key, io.BytesIO(data), len(data))
