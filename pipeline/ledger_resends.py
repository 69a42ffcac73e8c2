"""Late resends, deduplicated by the ledger's own files.

A writer skips an event delivered again by id, from what it knows: the receipts of the last
`receipts.KEEP_S` (read when it is given partitions), the journal's claims, and what it wrote since
(`RecentIds`, which forgets its oldest ids past its capacity). A producer down for longer than the
receipts are kept sends its unconfirmed events again (`pipeline.outbox`'s last resort), and a writer
that restarted, or took their partition over, since they were written knows none of their ids.

Such an event was emitted before anything the writer knows began: `Memory.since`. For those only, the
writer looks the ids up in the event's own directory (`run_id=/event_type=`), in the files written
after the event was emitted (no file older than an event can hold it). So the cost is one listing and
a few `event_id` columns per old batch, never per fresh event, and the answer needs no bound on how
long a producer was down. Every Parquet file there is read, compaction's hidden sources and pending
outputs included: each holds only rows that are in the ledger.

Clocks: `emitted_at` is the producer's, file times the store's; `SKEW_S` is allowed between them.
"""

from __future__ import annotations

import time
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field

import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pipeline.files import TMP_SUFFIX
from pipeline.ledger_journal import RecentIds
from pipeline.receipts import KEEP_S
from schemas import Event

SKEW_S = 120.0
"""Clock difference allowed between producers, writers and the store (plus a receipt minute's slack)."""


@dataclass
class Memory:
    """Since when a writer knows every id written: the receipts it last read reach `KEEP_S` back (before
    its first read, it knows only what it writes itself), and `RecentIds` knows everything since the
    newest id it forgot."""

    recent: RecentIds
    receipts_from: float = field(default_factory=time.time)

    def read_receipts(self) -> None:
        self.receipts_from = time.time() - KEEP_S

    @property
    def since(self) -> float:
        return max(self.receipts_from, self.recent.forgotten_at) + SKEW_S


class LedgerLookup:
    """The ids of old events already in the ledger's files (module docstring)."""

    def __init__(self, fs: pafs.FileSystem, root: str, max_files: int = 4096):
        self.fs, self.root, self.max_files = fs, root, max_files
        self._files: OrderedDict[str, frozenset[str]] = OrderedDict()
        """Ids of the files read lately (a file's rows never change; compaction writes new files)."""
        self.lookups = 0

    def known(self, events: list[Event], since: float) -> set[str]:
        old: dict[tuple[str, str], list[Event]] = defaultdict(list)
        for e in events:
            if e.emitted_at.timestamp() < since:
                old[(e.run_id, e.event_type)].append(e)
        found: set[str] = set()
        for (run_id, event_type), group in old.items():
            self.lookups += 1
            wanted = {e.event_id for e in group}
            after = min(e.emitted_at.timestamp() for e in group) - SKEW_S
            for path in self._files_after(f"{self.root}/run_id={run_id}/event_type={event_type}", after):
                found |= wanted & self._ids(path)
        return found

    def _files_after(self, directory: str, after: float) -> list[str]:
        infos = self.fs.get_file_info(pafs.FileSelector(directory, allow_not_found=True))
        return [
            i.path
            for i in infos
            if i.type == pafs.FileType.File
            and i.path.endswith(".parquet")
            and not i.path.endswith(TMP_SUFFIX)
            and i.mtime.timestamp() >= after
        ]

    def _ids(self, path: str) -> frozenset[str]:
        if path in self._files:
            self._files.move_to_end(path)
            return self._files[path]
        try:
            ids = frozenset(pq.read_table(path, columns=["event_id"], filesystem=self.fs).column(0).to_pylist())
        except FileNotFoundError:  # compaction deleted it since the listing: its rows are in its output
            return frozenset()
        self._files[path] = ids
        while len(self._files) > self.max_files:
            self._files.popitem(last=False)
        return ids
