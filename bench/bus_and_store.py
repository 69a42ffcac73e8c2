"""Foundation benchmark: event bus throughput and screenshot store rates on the local stack.

    .venv/bin/python bench/bus_and_store.py [--events 20000] [--screenshots 200]

Everything is measured in one run against one freshly started stack, so the figures compare with each
other (this machine is noisy). Prints a table and writes bench/out/bus_and_store.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/samples.py

import json
import multiprocessing as mp
import os
import tempfile
import time
import uuid

import typer
import zstandard
from rich.console import Console
from rich.table import Table

from pipeline.bus import EventProducer, create_topics
from pipeline.consumer import EventConsumer
from pipeline.stack.local import LocalStack
from pipeline.store import ScreenshotStore
from pipeline.topics import ROLLOUT
from schemas import encode_event

from samples import render_page, sample_step

console = Console()


def _consume(settings, n: int, ready, out) -> None:
    """The consumer runs in its own process, as the ledger writer and trainer do."""
    producer = EventProducer(settings, client_id="bench-dlq")
    consumer = EventConsumer(settings, "bench", [ROLLOUT], producer, client_id="bench")
    consumer.poll(timeout_ms=3000)  # join the group before the clock starts
    ready.set()
    got = 0
    while got < n:
        got += len(consumer.poll(timeout_ms=200))
    consumer.commit()
    out.put(time.time())
    consumer.close(), producer.close()


def bus(settings, n: int) -> dict:
    settings = settings.model_copy(update={"topic_prefix": f"bench{uuid.uuid4().hex[:6]}"})
    create_topics(settings)
    sha = "ab" * 32
    events = [sample_step("bench", f"g{i % 64}", f"g{i % 64}-t{i % 8}", i // 64, sha, seed=i) for i in range(n)]
    raw = [encode_event(e) for e in events]
    ctx = mp.get_context("spawn")
    ready, out = ctx.Event(), ctx.Queue()
    reader = ctx.Process(target=_consume, args=(settings, n, ready, out))
    reader.start()
    ready.wait(60)
    producer = EventProducer(settings, client_id="bench")
    t0 = time.time()
    for e in events:
        producer.publish(e)
    producer.flush()
    t_produced = time.time()
    t_consumed = out.get(timeout=600)
    reader.join(timeout=60)
    producer.close()
    return {
        "events": n,
        "bytes_per_event": sum(map(len, raw)) / n,
        "bytes_per_event_zstd": len(zstandard.compress(b"".join(raw[:2000]))) / min(n, 2000),
        "produce_events_per_s": n / (t_produced - t0),
        "end_to_end_events_per_s": n / (t_consumed - t0),
    }


def store(settings, n: int) -> dict:
    s = ScreenshotStore.from_settings(settings)
    s.prefix = f"bench-{uuid.uuid4().hex[:6]}"
    pages = [render_page(f"page {i}", seed=i) for i in range(n)]
    t0 = time.perf_counter()
    hashes = [s.put(p) for p in pages[: n // 2]]
    tp = time.perf_counter()
    hashes += s.put_many(pages[n // 2 :], workers=8)
    t1 = time.perf_counter()
    for p in pages:
        s.put(p)  # every one a dedup hit: a HEAD, no upload
    t2 = time.perf_counter()
    for h in hashes:
        s.get(h)
    t3 = time.perf_counter()
    s.get_many(hashes, workers=8)
    t4 = time.perf_counter()
    return {
        "png_bytes_mean": sum(map(len, pages)) / n,
        "puts_per_s": (n // 2) / (tp - t0),
        "parallel_puts_per_s": (n - n // 2) / (t1 - tp),
        "dedup_puts_per_s": n / (t2 - t1),
        "gets_per_s": n / (t3 - t2),
        "parallel_gets_per_s": n / (t4 - t3),
    }


def idle_rss_mb(stack: LocalStack) -> dict:
    out = {}
    for s in stack.services:
        out[s.name] = psutil.Process(s.pid).memory_info().rss / 2**20
    out["total"] = sum(out.values())
    return out


def main(events: int = 20_000, screenshots: int = 200) -> None:
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        stack = LocalStack.up(Path(d), durable=False)
        cold = time.perf_counter() - t0
        try:
            time.sleep(5)
            results = {"stack_cold_start_s": cold, "idle_rss_mb": idle_rss_mb(stack)}
            with console.status("event bus ..."):
                results["bus"] = bus(stack.settings(), events)
            with console.status("screenshot store ..."):
                results["store"] = store(stack.settings(), screenshots)
        finally:
            stack.down()
    table = Table(title="bus and store (one run, one stack)")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for section, vals in results.items():
        if isinstance(vals, dict):
            for k, v in vals.items():
                table.add_row(f"{section}.{k}", f"{v:,.1f}")
        else:
            table.add_row(section, f"{vals:,.1f}")
    table.add_row("end-to-end / goal 5,000 ev/s", f"{results['bus']['end_to_end_events_per_s'] / 5000:.2f}x")
    for k in ("puts_per_s", "parallel_puts_per_s", "gets_per_s", "parallel_gets_per_s"):
        table.add_row(f"{k} / goal 100/s", f"{results['store'][k] / 100:.2f}x")
    console.print(table)
    out = Path(__file__).parent / "out"
    out.mkdir(exist_ok=True)
    (out / "bus_and_store.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    typer.run(main)
