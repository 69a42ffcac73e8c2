"""Ledger writer start-up: time and memory against the ledger's size, the former id index vs the journal.

    .venv/bin/python bench/ledger_startup.py [--sizes 100000,1000000,10000000]

For each size a local ledger is generated: StepRecorded files of 5,000 events (event ids are random
UUIDs, as the producers make them; other columns are not read by either start-up and are left out),
plus a journal as a running writer leaves it: one entry per source partition (4 + 8 + 1), each naming
one file of the last flush. Each start-up runs in a fresh process, both at each size, side by side:

  index    the former writer: every `event_id` of every file into one set (what `_load_index` did)
  journal  this writer: `LedgerWriter(...)` and the assignment of all 13 partitions (`pipeline.ledger_journal`)

Reported: wall time and the process's peak RSS over its baseline (after imports). Writes
bench/out/ledger_startup.json.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

console = Console()
ROWS_PER_FILE = 5_000
PARTITIONS = [("awrl.tasks", p) for p in range(4)] + [("awrl.rollout", p) for p in range(8)] + [("awrl.trainer", 0)]


def generate(root: Path, events: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.ledger import ledger_filesystem
    from pipeline.ledger_journal import Journal
    from pipeline.settings import StackSettings

    files = []
    for i in range(events // ROWS_PER_FILE):
        d = root / f"run_id=run-{i % 20}" / "event_type=StepRecorded"
        d.mkdir(parents=True, exist_ok=True)
        ids = pa.array([uuid.uuid4().hex for _ in range(ROWS_PER_FILE)])
        path = d / f"part-{i:08d}.parquet"
        pq.write_table(pa.table({"event_id": ids, "step": pa.array(range(ROWS_PER_FILE))}), path, compression="zstd")
        files.append(str(path))
    fs, r = ledger_filesystem(StackSettings(ledger_uri=str(root)))
    journal = Journal(fs, r)
    for n, (topic, partition) in enumerate(PARTITIONS):
        journal.record(topic, partition, 1_000_000, [files[-1 - n % len(files)]], "bench-cluster")


def start(root: str, mode: str) -> None:
    """One start-up in this process; prints seconds and peak RSS bytes over the post-import baseline."""
    import pyarrow.parquet as pq

    from pipeline.ledger import LedgerWriter, ledger_filesystem, list_parquet
    from pipeline.settings import StackSettings

    settings = StackSettings(ledger_uri=root)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    if mode == "index":
        fs, r = ledger_filesystem(settings)
        ids: set[str] = set()
        for path in list_parquet(fs, r):
            ids.update(pq.read_table(path, columns=["event_id"], filesystem=fs).column(0).to_pylist())
        held = len(ids)
    else:
        writer = LedgerWriter(settings)
        writer._assigned(set(PARTITIONS), "bench-cluster")
        held = len(writer.recent)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"seconds": seconds, "rss_bytes": peak - base, "ids_held": held}))


def main(sizes: str = "100000,1000000,10000000") -> None:
    results = []
    with tempfile.TemporaryDirectory(prefix="ledger-startup-") as tmp:
        for events in (int(s) for s in sizes.split(",")):
            root = Path(tmp) / f"ledger-{events}"
            with console.status(f"generating a {events:,}-event ledger ..."):
                generate(root, events)
            for mode in ("index", "journal"):
                with console.status(f"{mode} start-up on {events:,} events ..."):
                    out = subprocess.run(
                        [sys.executable, __file__, "--start", str(root), mode],
                        capture_output=True,
                        text=True,
                        check=True,
                    )
                results.append({"events": events, "mode": mode, **json.loads(out.stdout.strip().splitlines()[-1])})
    head = ["events in the ledger", "start-up", "seconds", "RSS over baseline MiB", "ids held"]
    table = Table(title="ledger writer start-up")
    for col in head:
        table.add_column(col)
    md = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        row = [
            f"{r['events']:,}",
            r["mode"],
            f"{r['seconds']:.2f}",
            f"{r['rss_bytes'] / 2**20:.0f}",
            f"{r['ids_held']:,}",
        ]
        table.add_row(*row)
        md.append("| " + " | ".join(row) + " |")
    console.print(table)
    console.print("\n".join(md), markup=False, highlight=False)
    out = Path(__file__).parent / "out"
    out.mkdir(exist_ok=True)
    (out / "ledger_startup.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--start":
        start(sys.argv[2], sys.argv[3])
    else:
        typer.run(main)
