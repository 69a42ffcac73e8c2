"""A producer's transactional outbox: every event is on local disk before it is sent, and stays there
until the ledger has it in Parquet.

The embedded broker (Tansu) keeps its log in memory: when it dies, the events it acknowledged but the
ledger writer had not yet written are gone from it (`bench/broker_restart.py`). An outbox makes the
producer the durable copy instead:

- `add` writes the event (SQLite, WAL) before the Kafka send; `sent` records which broker (its cluster
  id, as the producer knew it when it sent) acknowledged it.
- `confirm` deletes the events the ledger's receipts name (`pipeline.receipts`): in Parquet.
- `to_resend(cluster)` is what must go out again: events acknowledged by a broker that has since lost
  its log (another cluster id than the live one; a memory broker gets a new one each start), events
  written but never acknowledged (a send that failed, a producer killed between `add` and its send),
  and, as the last resort, events unconfirmed for longer than the receipts are kept. The ledger drops
  what arrives twice, by event id (one that old, by looking it up in its files: `pipeline.ledger_resends`).
- It is bounded: `add` blocks while `capacity` events are unconfirmed (the ledger has been down for
  long), saying so in the log; nothing is ever dropped. 50,000 step events are ~750 MB of disk, and
  hours of a 4-worker pool without a ledger writer.

A send's cluster id is read before the send: a producer whose metadata already names the new broker
cannot have sent to the old one, which was dead before the new one started; one whose metadata still
names the old broker tags the event with it, which costs a needless resend, never a loss.

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

from pipeline.receipts import KEEP_S, ReceiptReader

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
    acked     REAL
)"""
UNACKED_AFTER_S = 10.0
"""A send not acknowledged after this long, by a producer that is no longer waiting for it, goes again."""


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
                (event_id, topic, key, value, encoded, time.time()),
            ).rowcount

    def pending(self) -> list[Pending]:
        """Every event not yet confirmed, oldest first."""
        with self._lock:
            found = self._db.execute(
                "SELECT event_id, topic, key, value, headers FROM pending ORDER BY added"
            ).fetchall()
        return [Pending(i, t, k, v, [(n, bytes.fromhex(h)) for n, h in json.loads(hs)]) for i, t, k, v, hs in found]

    def ids(self) -> set[str]:
        """The ids of the events not yet confirmed."""
        with self._lock:
            return {i for (i,) in self._db.execute("SELECT event_id FROM pending")}

    def _wait_for_room(self) -> None:
        log.warning(
            "outbox %s holds %d unconfirmed events (its bound): pausing until the ledger confirms "
            "some (is the ledger writer running?)",
            self.path,
            self._size,
        )
        started = time.monotonic()
        while True:
            with self._lock:
                self._size = self._count()
            if self._size < self.capacity:
                break
            time.sleep(self.full_wait_s)
        self.waited_s += time.monotonic() - started
        log.warning("outbox %s has room again after %.1f s", self.path, time.monotonic() - started)

    def sent(self, event_id: str, cluster: str) -> None:
        """The broker `cluster` acknowledged the event."""
        with self._lock:
            self._db.execute(
                "UPDATE pending SET cluster = ?, acked = ? WHERE event_id = ?", (cluster, time.time(), event_id)
            )

    def confirm(self, event_ids: list[str]) -> int:
        """Delete the events the ledger holds (named by its receipts); returns how many were here."""
        with self._lock:
            deleted = self._db.executemany("DELETE FROM pending WHERE event_id = ?", [(i,) for i in event_ids]).rowcount
            self._size = self._count()
            return max(deleted, 0)

    def oldest_s(self) -> float:
        """Age of the oldest unconfirmed event (0 when there is none)."""
        with self._lock:
            added = self._db.execute("SELECT min(added) FROM pending").fetchone()[0]
        return 0.0 if added is None else time.time() - added

    def to_resend(
        self, live: str, unacked_after_s: float, unconfirmed_after_s: float, skip: set[str] = frozenset()
    ) -> list[Pending]:
        """Events acknowledged by another cluster than `live` (a broker that lost its log), events
        never acknowledged added more than `unacked_after_s` ago and not in `skip` (in flight here),
        and events acknowledged but unconfirmed for `unconfirmed_after_s`."""
        now = time.time()
        with self._lock:
            found = self._db.execute(
                "SELECT event_id, topic, key, value, headers FROM pending "
                "WHERE (acked IS NOT NULL AND (cluster IS NOT ? OR acked < ?)) OR (acked IS NULL AND added < ?) "
                "ORDER BY added",
                (live, now - unconfirmed_after_s, now - unacked_after_s),
            ).fetchall()
        return [
            Pending(i, t, k, v, [(n, bytes.fromhex(h)) for n, h in json.loads(hs)])
            for i, t, k, v, hs in found
            if i not in skip
        ]

    def forget_sends(self, event_ids: list[str]) -> None:
        """Mark events as not acknowledged (about to be sent again)."""
        with self._lock:
            self._db.executemany(
                "UPDATE pending SET cluster = NULL, acked = NULL WHERE event_id = ?", [(i,) for i in event_ids]
            )

    def close(self) -> None:
        with self._lock:
            self._db.close()


class Reconciler:
    """Every `every_s`: confirm what the ledger's receipts name, and send again what a lost broker or
    a failed send left out. A thread of the producer that owns the outbox."""

    def __init__(
        self,
        outbox: Outbox,
        receipts: ReceiptReader,
        live_cluster,
        resend,
        every_s: float = 2.0,
        unacked_after_s: float = UNACKED_AFTER_S,
        unconfirmed_after_s: float = KEEP_S,
    ):
        """`live_cluster()`: the broker's cluster id, read by a fresh connection (None: unreachable);
        `resend(pending)`: send one event again."""
        self.outbox, self.receipts, self.live_cluster, self.resend = outbox, receipts, live_cluster, resend
        self.every_s, self.unacked_after_s, self.unconfirmed_after_s = every_s, unacked_after_s, unconfirmed_after_s
        self.inflight: set[str] = set()
        """Event ids sent by this process and not yet acknowledged or failed."""
        self.confirmed = 0
        self.resent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="outbox", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.step()
            except Exception as exc:  # noqa: BLE001 - a broker or store outage: the next round tries again
                log.info("outbox round failed: %s", exc)

    def step(self) -> None:
        if not len(self.outbox):  # nothing to confirm or send: the store is not asked
            return
        self.confirmed += self.outbox.confirm(self.receipts.new_ids())
        # A healthy ledger confirms within seconds: only an older event is worth asking the broker about.
        if self.outbox.oldest_s() < min(self.unacked_after_s, 5.0):
            return
        cluster = self.live_cluster()
        if cluster is None:
            return
        again = self.outbox.to_resend(cluster, self.unacked_after_s, self.unconfirmed_after_s, skip=set(self.inflight))
        if again:
            self.outbox.forget_sends([p.event_id for p in again])
            for pending in again:
                self.resend(pending)
            self.resent += len(again)
            log.info("outbox: sent %d unconfirmed events again (cluster %s)", len(again), cluster)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
