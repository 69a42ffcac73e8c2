"""Accounting for the fault matrix: what producers had acknowledged vs what the ledger holds.

Every fault test ends with `account(...)`, which compares the id sets (0 lost, 0 duplicated is the
contract) and adds a row to the table pytest prints at the end of the session (`conftest.py`).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import pyarrow.dataset as ds

from pipeline.bus import EventProducer
from pipeline.consumer import read_log
from pipeline.ledger import ledger_filesystem, list_parquet
from pipeline.topics import ROLLOUT, TASKS, TRAINER, Topic

from samples import sample_group


@dataclass(frozen=True)
class Accounting:
    fault: str
    produced: int
    """Distinct events the producers had acknowledged (or, for a broker that kept its log, the log)."""
    rows: int
    """Rows in the ledger for those events' ids (duplicates counted)."""
    lost: int
    duplicated: int
    note: str = ""


TABLE: list[Accounting] = []


def ledger_ids(settings, run_id: str | None = None) -> list[str]:
    """Every event id in the ledger (of one run), one entry per row."""
    fs, root = ledger_filesystem(settings)
    files = [f for f in list_parquet(fs, root) if "/event_type=" in f and (run_id is None or f"/run_id={run_id}/" in f)]
    if not files:
        return []
    return ds.dataset(files, filesystem=fs, format="parquet").to_table(columns=["event_id"]).column(0).to_pylist()


def log_ids(settings, run_id: str, topics: Iterable[Topic] = (TASKS, ROLLOUT, TRAINER)) -> set[str]:
    """Ids of the run's events in the broker's log (what producers had acknowledged)."""
    return {e.event_id for t in topics for e in read_log(settings, t) if e.run_id == run_id}


def account(fault: str, produced: Iterable[str], settings, run_id: str | None = None, note: str = "") -> Accounting:
    """Compare `produced` with the ledger; the row joins the session's table."""
    produced = set(produced)
    counts = Counter(i for i in ledger_ids(settings, run_id) if i in produced)
    row = Accounting(
        fault=fault,
        produced=len(produced),
        rows=sum(counts.values()),
        lost=len(produced - counts.keys()),
        duplicated=sum(c - 1 for c in counts.values()),
        note=note,
    )
    TABLE.append(row)
    return row


def markdown(rows: list[Accounting]) -> str:
    lines = ["| fault | events produced | rows in the ledger | lost | duplicated | note |", "|---|---|---|---|---|---|"]
    lines += [f"| {r.fault} | {r.produced} | {r.rows} | {r.lost} | {r.duplicated} | {r.note} |" for r in rows]
    return "\n".join(lines)


SHA = "cd" * 32


class Publisher:
    """Publishes groups of events the way the pool does, remembering when each was acknowledged."""

    def __init__(self, settings, run_id: str, client_id: str = "awrl"):
        self.producer = EventProducer(settings, client_id=client_id)
        self.run_id = run_id
        self.acked: dict[str, float] = {}
        self.failed: set[str] = set()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        g = 0
        while not self.stop.is_set():
            for e in sample_group(self.run_id, f"g{g}", [SHA], seed=g):
                f = self.producer.publish(e)
                f.add_callback(lambda _, i=e.event_id: self.acked.__setitem__(i, time.monotonic()))
                f.add_errback(lambda _, i=e.event_id: self.failed.add(i))
            g += 1
            time.sleep(0.05)

    def finish(self, close: bool = True) -> None:
        """Stop publishing and wait for the acknowledgements; `close=False` keeps the producer (and
        its outbox, which may still send again) running."""
        self.stop.set()
        self.thread.join()
        self.producer.flush(timeout=60)
        if close:
            self.producer.close()
