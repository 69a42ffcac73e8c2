"""Screenshots by reference (sha256 in the event, pixels in S3) vs inline (base64 in the event), side by side.

    .venv/bin/python bench/inline_pixels.py [--episodes 12] [--reps 3]

A short real rollout (demo policy, our sites' Easy tasks, Set-of-Mark, 2 browsers) on a fresh local
stack records StepRecorded events and their screenshots. The same steps then go through the same
broker and store both ways, `reps` times each, alternating:

- reference (what the system does): the event as recorded; assembling a batch = consume the topic,
  decode each event, fetch its prompt screenshots from S3 by hash (4 at a time, verified against the
  hash), as the trainer's prefetch does;
- inline (the ablation): the event's JSON also carries its prompt screenshots as base64; assembling =
  consume, decode, base64-decode.

Reports bytes through the broker per step, producer time (send until every acknowledgement) and
batch-assembly time per step, and the inline / reference ratios.
"""

from __future__ import annotations

import base64
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

console = Console()
OUT = Path(__file__).parent / "out"


def main(episodes: int = 12, reps: int = 3) -> None:
    from pipeline.consumer import read_log
    from pipeline.stack.local import LocalStack
    from pipeline.store import ScreenshotStore
    from pipeline.topics import ROLLOUT
    from rollout.episode import EpisodeConfig
    from rollout.run import RolloutRequest, run_rollout
    from schemas import StepRecorded

    with tempfile.TemporaryDirectory() as d:
        stack = LocalStack.up(Path(d) / "stack", durable=False)
        try:
            settings = stack.settings()
            run_id = f"pixels-{uuid.uuid4().hex[:6]}"
            with console.status(f"recording {episodes} episodes ..."):
                run_rollout(
                    settings,
                    RolloutRequest(
                        suite="sites",
                        policy="demo",
                        workers=2,
                        group_size=1,
                        episodes=episodes,
                        difficulty="easy",
                        run_id=run_id,
                        episode=EpisodeConfig(som=True),
                    ),
                    False,
                )
            steps = [e for e in read_log(settings, ROLLOUT) if isinstance(e, StepRecorded) and e.run_id == run_id]
            store = ScreenshotStore.from_settings(settings)
            pixels = store.get_many({h for s in steps for h in s.prompt_screenshot_sha256})
            reference = [s.model_dump_json().encode() for s in steps]
            inline = [_inline(s, pixels) for s in steps]
            results: dict[str, list[dict]] = {"reference": [], "inline": []}
            for rep in range(reps):
                for name, values in (("reference", reference), ("inline", inline)):
                    results[name].append(_round_trip(settings, store, name, values, f"{run_id}-{name}-{rep}"))
        finally:
            stack.down()
    _report(results, len(steps), episodes, reps)


def _inline(step, pixels: dict[str, bytes]) -> bytes:
    doc = json.loads(step.model_dump_json())
    doc["prompt_screenshots_b64"] = [base64.b64encode(pixels[h]).decode() for h in step.prompt_screenshot_sha256]
    return json.dumps(doc).encode()


def _round_trip(settings, store, name: str, values: list[bytes], topic: str) -> dict:
    """Produce `values` to a fresh topic and wait for every ack; then consume and assemble the batch."""
    from kafka import KafkaConsumer, KafkaProducer
    from kafka.structs import TopicPartition

    from pipeline.hashing import sha256_hex
    from schemas import decode_event

    producer = KafkaProducer(
        bootstrap_servers=settings.kafka_bootstrap,
        acks="all",
        enable_idempotence=True,
        linger_ms=5,
        batch_size=256 * 1024,
        max_request_size=16 * 1024 * 1024,
        compression_type=settings.kafka_compression,
    )
    t0 = time.perf_counter()
    futures = [producer.send(topic, value=v, key=str(i).encode()) for i, v in enumerate(values)]
    producer.flush()
    for f in futures:
        f.get(timeout=60)
    produce_s = time.perf_counter() - t0
    producer.close()

    consumer = KafkaConsumer(
        bootstrap_servers=settings.kafka_bootstrap,
        enable_auto_commit=False,
        max_partition_fetch_bytes=16 * 1024 * 1024,
        fetch_max_bytes=64 * 1024 * 1024,
    )
    t0 = time.perf_counter()
    partitions = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
    consumer.assign(partitions)
    consumer.seek_to_beginning(*partitions)
    batch: list[tuple[object, list[bytes]]] = []
    while len(batch) < len(values):
        for records in consumer.poll(timeout_ms=500).values():
            for r in records:
                if name == "inline":
                    doc = json.loads(r.value)
                    shots = [base64.b64decode(b) for b in doc.pop("prompt_screenshots_b64")]
                    event = decode_event(json.dumps(doc))
                    # the same integrity check the store applies to what it returns
                    assert all(sha256_hex(b) == h for b, h in zip(shots, event.prompt_screenshot_sha256))
                else:
                    event, shots = decode_event(r.value), None
                batch.append((event, shots))
    if name == "reference":  # fetched concurrently, as the trainer's prefetch does (4 at a time), verified
        pixels = store.get_many({h for e, _ in batch for h in e.prompt_screenshot_sha256}, workers=4)
        batch = [(e, [pixels[h] for h in e.prompt_screenshot_sha256]) for e, _ in batch]
    assemble_s = time.perf_counter() - t0
    consumer.close()
    return {"bytes": sum(len(v) for v in values), "produce_s": produce_s, "assemble_s": assemble_s}


def _report(results: dict[str, list[dict]], steps: int, episodes: int, reps: int) -> None:
    med = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for name, runs in results.items()}
    table = Table(title=f"{steps} steps of {episodes} episodes, median of {reps} round trips each")
    for c in ["transport", "bytes/step", "produce ms/step", "assemble ms/step", "vs reference (bytes / assemble)"]:
        table.add_column(c, justify="right")
    ref = med["reference"]
    for name, m in med.items():
        table.add_row(
            name,
            f"{m['bytes'] / steps:,.0f}",
            f"{1000 * m['produce_s'] / steps:.2f}",
            f"{1000 * m['assemble_s'] / steps:.2f}",
            f"{m['bytes'] / ref['bytes']:.1f}x / {m['assemble_s'] / ref['assemble_s']:.2f}x",
        )
    console.print(table)
    OUT.mkdir(exist_ok=True)
    (OUT / "inline_pixels.json").write_text(json.dumps({"steps": steps, "median": med, "runs": results}, indent=2))


if __name__ == "__main__":
    typer.run(main)
