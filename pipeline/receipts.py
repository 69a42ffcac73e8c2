"""The ledger's receipts: which events are in Parquet, by event id, for the producers' outboxes.

Once a flush is durable, a ledger writer notes the event ids it held; every `every_s` it writes what
it noted as one small object, `<ledger>/_receipts/<minute>/<time>-<writer>.json`. A producer's
outbox (`pipeline.outbox`) deletes the events a receipt names.

By event id, not by offset floors: an id means the same event whichever broker delivered it, while
an offset means something only in the log that numbered it, and a memory broker that restarts
numbers from 0 again. A client's cached cluster id lags behind the broker it talks to, so floors
tagged with it confirmed events the ledger did not have (seen in the 3-kill test; the broker here
also keeps no commit metadata to tag them with).

Receipts older than `keep_s` are deleted by the writers. An outbox sends again whatever stayed
unconfirmed that long; the ledger drops it by event id, found in its own files (no writer remembers
an id that old: `pipeline.ledger_resends`), and its next receipt names it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta

import pyarrow.fs as pafs

from pipeline.files import write_atomic

log = logging.getLogger(__name__)

RECEIPTS = "_receipts"
MINUTE = "%Y%m%dT%H%M"
KEEP_S = 600.0
"""How long receipts are kept: a producer stopped for longer sends its unconfirmed events again."""


class ReceiptWriter:
    """A ledger writer's receipts: `add` ids once their files are durable, `maybe_write` often."""

    def __init__(self, fs: pafs.FileSystem, root: str, put=None, every_s: float = 2.0, keep_s: float = KEEP_S):
        """`put(path, data)`: an atomic object write (S3); None writes local files atomically."""
        self.fs, self.root, self.every_s, self.keep_s = fs, root, every_s, keep_s
        self._put = put or write_atomic
        self._name = uuid.uuid4().hex[:8]
        self._ids: list[str] = []
        self._lock = threading.Lock()  # the flush thread adds, the writer's loop writes
        self._written_at = time.monotonic()
        self._swept_at = 0.0
        self.written = 0
        """Receipts written."""

    def add(self, event_ids: list[str]) -> None:
        with self._lock:
            self._ids.extend(event_ids)

    def maybe_write(self, force: bool = False) -> bool:
        """Write what was noted, at most every `every_s` (or now, with `force`); True when everything
        noted before the call is in a receipt. A store that refuses costs only time: the ids stay
        noted for the next try, and an outbox waits or sends again."""
        if not force and time.monotonic() - self._written_at < self.every_s:
            return False
        with self._lock:
            ids, self._ids = self._ids, []
        if not ids:
            return True
        now = datetime.now(UTC)
        path = f"{self.root}/{RECEIPTS}/{now:{MINUTE}}/{now:%Y%m%dT%H%M%S%f}-{self._name}.json"
        try:
            self._put(path, json.dumps(ids).encode())
        except Exception as exc:  # noqa: BLE001 - the object store is down or full: try again later
            log.warning("could not write a ledger receipt (%d events), will retry: %s", len(ids), exc)
            with self._lock:
                self._ids[:0] = ids
            return False
        self._written_at = time.monotonic()
        self.written += 1
        if time.monotonic() - self._swept_at > 60:
            self._swept_at = time.monotonic()
            self._sweep(now)
        return True

    def _sweep(self, now: datetime) -> None:
        """Delete the minutes older than `keep_s` (any writer may: they are the ledger's, not its)."""
        oldest = f"{now - timedelta(seconds=self.keep_s):{MINUTE}}"
        try:
            for minute in _minutes(self.fs, self.root):
                if minute < oldest:
                    self.fs.delete_dir(f"{self.root}/{RECEIPTS}/{minute}")
        except (OSError, FileNotFoundError) as exc:  # another writer swept it first, or the store is down
            log.info("sweeping old ledger receipts: %s", exc)


class ReceiptReader:
    """A producer's view of the receipts: the ids named by receipts it has not read yet."""

    def __init__(self, fs: pafs.FileSystem, root: str):
        self.fs, self.root = fs, root
        self._read: dict[str, set[str]] = {}
        """Receipts already read, per minute."""

    def new_ids(self) -> list[str]:
        """Event ids of the receipts written since the last call (all kept ones, the first time).
        The newest three minutes are listed again each time: a receipt can land in a minute that
        was already listed (its write started before the listing, or another writer's clock)."""
        minutes = _minutes(self.fs, self.root)
        if self._read:
            newest = max(self._read)
            recent = f"{datetime.strptime(newest, MINUTE) - timedelta(minutes=2):{MINUTE}}"
            minutes = [m for m in minutes if m >= recent]
        ids: list[str] = []
        for minute in minutes:
            seen = self._read.setdefault(minute, set())
            infos = self.fs.get_file_info(pafs.FileSelector(f"{self.root}/{RECEIPTS}/{minute}", allow_not_found=True))
            for info in infos:
                if info.type != pafs.FileType.File or not info.path.endswith(".json") or info.path in seen:
                    continue
                try:
                    with self.fs.open_input_stream(info.path) as f:
                        ids.extend(json.loads(f.read()))
                except FileNotFoundError:  # swept meanwhile
                    pass
                seen.add(info.path)
        for minute in sorted(self._read)[:-3]:  # older minutes are never listed again
            del self._read[minute]
        return ids


def _minutes(fs: pafs.FileSystem, root: str) -> list[str]:
    infos = fs.get_file_info(pafs.FileSelector(f"{root}/{RECEIPTS}", allow_not_found=True))
    return sorted(i.base_name for i in infos if i.type == pafs.FileType.Directory)
