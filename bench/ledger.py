"""Ledger benchmark: events/s from Kafka into Parquet, and Parquet bytes per step.

    .venv/bin/python bench/ledger.py [--events 20000]

Events are published first, then, side by side in one run: one writer drains them into a local
directory and into S3 (the local radosgw); two writer processes in one consumer group drain them into
a local directory; and each stage of the writer is timed alone on the same events (one core): the
broker fetch (kafka-python), decode + validation (the dead-letter decision), event -> Arrow, token
summaries, Parquet zstd. The stages' combined rate bounds what one writer process can do.
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
    assert stats.written == n, (stats.written, n)
    # Neither the group join before the first records nor the idle wait after the last flush is
    # writing time: count from the first poll that returned events (less the events it returned).
    first_at, first_n = writer.first_poll
    return {
        "events_per_s": (n - first_n) / (writer.last_flush_at - first_at),
        "join_s": first_at - t0,
        "parquet_bytes_per_step": stats.bytes / n,
        "files": stats.files,
        "max_lag_s": stats.max_lag_s,
    }


def drain_processes(settings, root: Path, n: int, writers: int) -> dict:
    """`writers` `awrl ledger sync --follow` processes in one group; time until the ledger holds n rows."""
    import os
    import subprocess
    import sys

    import pyarrow.parquet as pq

    env = {**os.environ, **settings.environ(), "AWRL_LEDGER_URI": str(root)}
    cmd = [sys.executable, "-m", "app.cli", "ledger", "sync", "--follow"]
    t0 = time.perf_counter()
    procs = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(writers)
    ]
    try:
        rows, done_at, first = 0, None, None
        while rows < n and time.perf_counter() - t0 < 600:
            time.sleep(0.2)
            files = list(root.rglob("*.parquet"))
            rows = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
            done_at = time.perf_counter()
            if rows and first is None:  # as for one writer: from the first rows, not the start and join
                first = (done_at, rows)
        assert rows == n, (rows, n)
    finally:
        for p in procs:
            p.terminate()
            p.wait()
    return {
        "events_per_s": (n - first[1]) / (done_at - first[0]),
        "join_s": first[0] - t0,
        "files": len(files),
        "note": "from the first rows on disk (0.2 s polls); join_s includes process start",
    }


def stages(settings, batch: int = 2_000) -> dict[str, dict[str, float]]:
    """Each writer stage alone over the topic's events, in events/s: the former path (events as
    Python objects) and the columnar one side by side."""

    import gc

    from pipeline.consumer import _rejection, read_records
    from pipeline.topics import ROLLOUT
    from schemas import StepRecorded, decode_event, events_to_table
    from schemas.columnar import columnar_table, decode_columnar

    t = time.perf_counter()
    records = read_records(settings, ROLLOUT)
    fetch = len(records) / (time.perf_counter() - t)
    gc.collect()
    gc.freeze()  # as the writer does (`LedgerWriter.sync`)
    paths = {}
    for name, decode, to_table in (
        ("python objects", decode_event, lambda es: events_to_table(es, StepRecorded)),
        ("columnar", decode_columnar, lambda es: columnar_table(es, StepRecorded)),
    ):
        out = paths[name] = {"broker fetch (kafka-python)": fetch}
        t = time.perf_counter()
        events = [_rejection(ROLLOUT, r.value, decode) for r in records]
        out["decode + validation"] = len(events) / (time.perf_counter() - t)
        t = time.perf_counter()
        tables = [to_table(events[i : i + batch]) for i in range(0, len(events), batch)]
        out["event -> Arrow"] = len(events) / (time.perf_counter() - t)
        out.update(_write_stages(tables, len(events)))
        del events, tables
    gc.unfreeze()
    return paths


def _write_stages(tables, n: int) -> dict[str, float]:
    import io

    import pyarrow.parquet as pq

    from pipeline.summaries import with_summaries

    out = {}
    t = time.perf_counter()
    tables = [with_summaries("StepRecorded", tb) for tb in tables]
    out["token summaries"] = n / (time.perf_counter() - t)
    t = time.perf_counter()
    for tb in tables:
        pq.write_table(tb, io.BytesIO(), compression="zstd", row_group_size=64_000)
    out["Parquet zstd write"] = n / (time.perf_counter() - t)
    return out


def main(events: int = 20_000) -> None:
    with tempfile.TemporaryDirectory() as d:
        stack = LocalStack.up(Path(d) / "stack", durable=False)
        try:
            settings = stack.settings().model_copy(update={"topic_prefix": f"bench{uuid.uuid4().hex[:6]}"})
            create_topics(settings)
            steps = [
                sample_step("bench-ledger", f"g{i % 64}", f"g{i % 64}-t{i % 8}", i // 64, "ab" * 32, seed=i)
                for i in range(events)
            ]
            EventProducer(settings).publish_all(steps)
            json_bytes = sum(len(encode_event(e)) for e in steps[:1000]) / 1000
            results = {"events": events, "event_json_bytes": json_bytes}
            with console.status("draining into a local directory ..."):
                results["local"] = drain(settings, str(Path(d) / "ledger"), events, "ledger-local")
            with console.status("draining into S3 ..."):
                s3_uri = f"s3://{settings.s3_bucket}/bench-{uuid.uuid4().hex[:6]}"
                results["s3"] = drain(settings, s3_uri, events, "ledger-s3")
            with console.status("two writer processes draining into a local directory ..."):
                results["local, 2 writers"] = drain_processes(settings, Path(d) / "ledger2", events, 2)
            with console.status("timing each stage ..."):
                results["stages"] = stages(settings)
        finally:
            stack.down()
    table = Table(title=f"ledger writer, {events:,} StepRecorded events (~300 response tokens each)")
    for col in ("target", "events/s", "group join s", "Parquet bytes/step", "JSON bytes/event", "files"):
        table.add_column(col, justify="right")
    for target in ("local", "s3", "local, 2 writers"):
        r = results[target]
        table.add_row(
            target,
            f"{r['events_per_s']:,.0f}",
            f"{r.get('join_s', 0):.1f}",
            f"{r.get('parquet_bytes_per_step', 0):,.0f}",
            f"{json_bytes:,.0f}",
            str(r["files"]),
        )
    console.print(table)
    stage_table = Table(title="one writer's stages, each alone on the same events (events/s, one core)")
    stage_table.add_column("stage")
    for path in results["stages"]:
        stage_table.add_column(f"{path}: events/s", justify="right")
        stage_table.add_column("share", justify="right")
    totals = {path: sum(1 / r for r in rates.values()) for path, rates in results["stages"].items()}
    for name in next(iter(results["stages"].values())):
        stage_table.add_row(
            name,
            *[
                c
                for path, rates in results["stages"].items()
                for c in (f"{rates[name]:,.0f}", f"{(1 / rates[name]) / totals[path]:.0%}")
            ],
        )
    stage_table.add_row(
        "all stages in sequence (bound)", *[c for t in totals.values() for c in (f"{1 / t:,.0f}", "100%")]
    )
    console.print(stage_table)
    out = Path(__file__).parent / "out"
    out.mkdir(exist_ok=True)
    (out / "ledger.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    typer.run(main)
