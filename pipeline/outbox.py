"""A producer's transactional outbox: every event is on local disk before it is sent, and stays there
until the ledger has it in Parquet.

The embedded broker (Tansu) keeps its log in memory: when it dies, the events it acknowledged but the
ledger writer had not yet written are gone from it (`bench/broker_restart.py`). An outbox makes the
producer the durable copy instead:

- `add` writes the event (SQLite, WAL) before the Kafka send; `sent` records where the broker put it
  (cluster id, partition, offset) once acknowledged.
- The ledger writer commits a partition's offset only once the files holding everything below it are
  durable, so the ledger group's committed offsets are the floor below which every event is in
  Parquet. Each commit names the cluster id of the log it counts in (its metadata), and `confirm`
  deletes what lies below a floor on that cluster only: a broker that restarted empty has a new
  cluster id and numbers offsets from 0 again.
- `to_resend(cluster)` is what must go out again: events acknowledged by a broker that has since lost
  its log (another cluster id), and events written but never acknowledged by anyone (a send that
  failed, or a producer killed between `add` and its send). The ledger drops what arrives twice, by
  event id.
- It is bounded: `add` blocks while `capacity` events are unconfirmed (the ledger has been down for
  long), saying so in the log; nothing is ever dropped. 50,000 step events are ~750 MB of disk, and
  hours of a 4-worker pool without a ledger writer.

`pipeline.bus.EventProducer` uses one when `StackSettings.outbox_dir` is set (the local stack sets it).
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

SCHEMA = """
CREATE TABLE IF NOT EXISTS pending (
    event_id  TEXT PRIMARY KEY,
    topic     TEXT NOT NULL,
    key       BLOB,
    value     BLOB NOT NULL,
    headers   TEXT NOT NULL,
    added     REAL NOT NULL,
    cluster   TEXT,
    partition INTEGER,
    "offset"  INTEGER
)"""


@dataclass(frozen=True)
class Pending:
    """An event in the outbox, as it is sent again."""

    event_id: str
    topic: str
    key: bytes | None
    value: bytes
    headers: list[tuple[str, bytes]]


class Outbox:
    """Events not yet confirmed in the ledger, in one SQLite file (several processes may share it)."""

    def __init__(self, path: Path | str, capacity: int = 50_000, full_wait_s: float = 1.0):
        self.path, self.capacity, self.full_wait_s = Path(path), capacity, full_wait_s
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, check_same_thread=False, timeout=60, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")  # durable across a process crash (not a power cut)
        self._db.execute(SCHEMA)
        self._lock = threading.Lock()
        self._size = self._count()
        self.waited_s = 0.0
        """Seconds `add` blocked on a full outbox (backpressure)."""

    def _count(self) -> int:
        return self._db.execute("SELECT count(*) FROM pending").fetchone()[0]

    def __len__(self) -> int:
        with self._lock:
            return self._count()

    def add(self, event_id: str, topic: str, key: bytes | None, value: bytes, headers: list[tuple[str, bytes]]) -> None:
        """Keep the event until the ledger confirms it; blocks while the outbox is full."""
        if self._size >= self.capacity:
            self._wait_for_room()
        encoded = json.dumps([(k, v.hex()) for k, v in headers])
        with self._lock:
            self._size += self._db.execute(
                "INSERT OR IGNORE INTO pending (event_id, topic, key, value, headers, added) VALUES (?, ?, ?, ?, ?, ?)",
                (event_id, topic, key, value, encoded, time.time())).rowcount

    def _wait_for_room(self) -> None:
        log.warning("outbox %s holds %d unconfirmed events (its bound): pausing until the ledger confirms "
                    "some (is the ledger writer running?)", self.path, self._size)
        started = time.monotonic()
        while True:
            with self._lock:
                self._size = self._count()
            if self._size < self.capacity:
                break
            time.sleep(self.full_wait_s)
        self.waited_s += time.monotonic() - started
        log.warning("outbox %s has room again after %.1f s", self.path, time.monotonic() - started)

    def sent(self, event_id: str, cluster: str | None, partition: int, offset: int) -> None:
        """The broker `cluster` acknowledged the event at (partition, offset)."""
        with self._lock:
            self._db.execute('UPDATE pending SET cluster = ?, partition = ?, "offset" = ? WHERE event_id = ?',
                             (cluster, partition, offset, event_id))

    def confirm(self, floors: dict[tuple[str, int], tuple[str, int]]) -> int:
        """Delete the events below each partition's committed ledger offset `(cluster, offset)`, on
        that cluster only; returns how many."""
        with self._lock:
            deleted = 0
            for (topic, partition), (cluster, floor) in floors.items():
                deleted += self._db.execute(
                    'DELETE FROM pending WHERE cluster = ? AND topic = ? AND partition = ? AND "offset" < ?',
                    (cluster, topic, partition, floor)).rowcount
            self._size = self._count()
            return deleted

    def to_resend(self, cluster: str, older_than_s: float, skip: set[str] = frozenset()) -> list[Pending]:
        """Events acknowledged by another cluster (a broker that lost its log), and events never
        acknowledged that were added more than `older_than_s` ago and are not in `skip` (in flight)."""
        with self._lock:
            found = self._db.execute(
                'SELECT event_id, topic, key, value, headers FROM pending '
                'WHERE ("offset" IS NOT NULL AND cluster IS NOT ?) OR ("offset" IS NULL AND added < ?) '
                'ORDER BY added', (cluster, time.time() - older_than_s)).fetchall()
        return [Pending(i, t, k, v, [(n, bytes.fromhex(h)) for n, h in json.loads(hs)])
                for i, t, k, v, hs in found if i not in skip]

    def forget_sends(self, event_ids: list[str]) -> None:
        """Mark events as not acknowledged (about to be sent again)."""
        with self._lock:
            self._db.executemany('UPDATE pending SET cluster = NULL, partition = NULL, "offset" = NULL '
                                 'WHERE event_id = ?', [(i,) for i in event_ids])

    def close(self) -> None:
        with self._lock:
            self._db.close()


class Reconciler:
    """Every `every_s`: confirm what the ledger holds, and send again what a lost broker or a failed
    send left out. A thread of the producer that owns the outbox."""

    def __init__(self, outbox: Outbox, floors, cluster_id, resend, every_s: float = 2.0,
                 resend_after_s: float = 10.0):
        """`floors()`: the ledger's committed (cluster id, offset) per (topic, partition);
        `cluster_id()`: the broker's now, as the producer sees it; `resend(pending)`: send one again."""
        self.outbox, self.floors, self.cluster_id, self.resend = outbox, floors, cluster_id, resend
        self.every_s, self.resend_after_s = every_s, resend_after_s
        self.inflight: set[str] = set()
        """Event ids sent by this process and not yet acknowledged or failed."""
        self.resent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="outbox", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.step()
            except Exception as exc:  # noqa: BLE001 - a broker or ledger outage: the next round tries again
                log.info("outbox round failed: %s", exc)

    def step(self) -> None:
        self.outbox.confirm(self.floors())
        cluster = self.cluster_id()
        if cluster is None:
            return
        again = self.outbox.to_resend(cluster, self.resend_after_s, skip=set(self.inflight))
        if again:
            self.outbox.forget_sends([p.event_id for p in again])
            for pending in again:
                self.resend(pending)
            self.resent += len(again)
            log.info("outbox: sent %d unconfirmed events again (cluster %s)", len(again), cluster)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
