"""`awrl demo`: the main job on the embedded stack.

Today it exercises the foundation end to end: publish a few hundred sample step events whose
screenshots go to the object store by hash, consume them back through a consumer group, verify every
screenshot, and print a summary. Later stages (rollout, ledger, training) plug in here.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from dataclasses import dataclass

from rich.progress import Progress

from pipeline.bus import EventConsumer, EventProducer
from pipeline.samples import render_page, sample_group
from pipeline.settings import StackSettings
from pipeline.store import ScreenshotStore
from pipeline.topics import ROLLOUT
from schemas import StepRecorded


@dataclass
class DemoSummary:
    run_id: str
    events_published: int
    events_consumed: int
    by_type: dict[str, int]
    screenshots_referenced: int
    screenshots_stored: int
    dedup_hits: int
    screenshots_verified: int
    seconds: float


def run_demo(settings: StackSettings, groups: int = 40, pages: int = 30) -> DemoSummary:
    start = time.perf_counter()
    run_id = f"demo-{uuid.uuid4().hex[:8]}"
    store = ScreenshotStore.from_settings(settings)
    producer = EventProducer(settings, client_id="awrl-demo")
    with Progress(transient=True) as progress:
        task = progress.add_task("storing screenshots", total=pages)
        hashes = []
        for i in range(pages):
            hashes.append(store.put(render_page(f"Page {i % (pages // 2)}", seed=i % (pages // 2))))
            progress.advance(task)
        events = []
        task = progress.add_task("publishing events", total=groups)
        for g in range(groups):
            group = list(sample_group(run_id, f"{run_id}-g{g}", hashes, seed=g))
            events.extend(group)
            producer.publish_all(group)
            progress.advance(task)
        consumer = EventConsumer(settings, f"{run_id}-reader", [ROLLOUT], producer, client_id="awrl-demo")
        task = progress.add_task("consuming events", total=len(events))
        seen: dict[str, object] = {}
        deadline = time.monotonic() + 60
        while len(seen) < len(events) and time.monotonic() < deadline:
            for d in consumer.poll(timeout_ms=500):
                if d.event.run_id == run_id and d.event.event_id not in seen:
                    seen[d.event.event_id] = d.event
                    progress.advance(task)
            consumer.commit()
        consumer.close()
        producer.close()
        referenced = {e.screenshot_sha256 for e in seen.values() if isinstance(e, StepRecorded)}
        fetched = store.get_many(referenced)
    return DemoSummary(
        run_id=run_id,
        events_published=len(events),
        events_consumed=len(seen),
        by_type=dict(Counter(type(e).__name__ for e in seen.values())),
        screenshots_referenced=len(referenced),
        screenshots_stored=store.stats.puts,
        dedup_hits=store.stats.dedup_hits,
        screenshots_verified=len(fetched),
        seconds=time.perf_counter() - start,
    )
