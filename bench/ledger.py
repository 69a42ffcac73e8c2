"""Ledger benchmark: events/s from Kafka into Parquet, and Parquet bytes per step.

    .venv/bin/python bench/ledger.py [--events 20000]

Events are published first, then one writer drains them into a local directory and into S3 (the
local radosgw), side by side in one run.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/samples.py

import json
import tempfile
import time
import uuid

import typer
from rich.console import Console
from rich.table import Table

from pipeline.bus import EventProducer, create_topics
from pipeline.ledger import LedgerConfig, LedgerWriter
from pipeline.stack.local import LocalStack
from schemas import encode_event

from samples import sample_step

console = Console()


def drain(settings, ledger_uri: str, n: int, consumer_group: str) -> dict:
    """One writer (its own consumer group, so each target reads every event) drains the topic."""
    s = settings.model_copy(update={"ledger_uri": ledger_uri})
    writer = LedgerWriter(s, LedgerConfig(consumer_group=consumer_group))
    t0 = time.perf_counter()
    stats = writer.sync(idle_exit_s=2.0)
    # The idle wait at the end is not writing time: take the time of the last flush instead.
    elapsed = (writer.last_flush_at or time.perf_counter()) - t0
    assert stats.written == n, (stats.written, n)
    return {"events_per_s": n / elapsed, "parquet_bytes_per_step": stats.bytes / n, "files": stats.files,
            "max_lag_s": stats.max_lag_s}


def main(events: int = 20_000) -> None:
    with tempfile.TemporaryDirectory() as d:
        stack = LocalStack.up(Path(d) / "stack", durable=False)
        try:
            settings = stack.settings().model_copy(update={"topic_prefix": f"bench{uuid.uuid4().hex[:6]}"})
            create_topics(settings)
            steps = [sample_step("bench-ledger", f"g{i % 64}", f"g{i % 64}-t{i % 8}", i // 64, "ab" * 32, seed=i)
                     for i in range(events)]
            EventProducer(settings).publish_all(steps)
            json_bytes = sum(len(encode_event(e)) for e in steps[:1000]) / 1000
            results = {"events": events, "event_json_bytes": json_bytes}
            with console.status("draining into a local directory ..."):
                results["local"] = drain(settings, str(Path(d) / "ledger"), events, "ledger-local")
            with console.status("draining into S3 ..."):
                s3_uri = f"s3://{settings.s3_bucket}/bench-{uuid.uuid4().hex[:6]}"
                results["s3"] = drain(settings, s3_uri, events, "ledger-s3")
        finally:
            stack.down()
    table = Table(title=f"ledger writer, {events:,} StepRecorded events (~300 response tokens each)")
    for col in ("target", "events/s", "Parquet bytes/step", "JSON bytes/event", "files"):
        table.add_column(col, justify="right")
    for target in ("local", "s3"):
        r = results[target]
        table.add_row(target, f"{r['events_per_s']:,.0f}", f"{r['parquet_bytes_per_step']:,.0f}",
                      f"{json_bytes:,.0f}", str(r["files"]))
    console.print(table)
    out = Path(__file__).parent / "out"
    out.mkdir(exist_ok=True)
    (out / "ledger.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    typer.run(main)
