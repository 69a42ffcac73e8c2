"""What a restart of the local in-memory broker (Tansu) can lose: the ledger writer's lag, measured,
and what producers with an outbox (`pipeline.outbox`) lose instead.

Events flow at a steady rate through a real Tansu broker into the ledger writer (local Parquet). The
broker is SIGKILLed `--restarts` times; each time, the acknowledged events that never reached the
ledger are the loss, and how long before the crash they had been acknowledged is the window at risk.
Two flush intervals run side by side (the default and twice it), and then producers with an outbox:
there the broker is started again (empty, as a memory broker restarts), the writer follows, and the
loss is counted once the outbox has sent again what the dead broker had acknowledged.

    .venv/bin/python bench/broker_restart.py --restarts 5
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/samples.py

import argparse
import statistics
import tempfile
import threading
import time
import uuid
from contextlib import suppress

import pyarrow.dataset as ds
from kafka.errors import KafkaError, KafkaTimeoutError
from rich.console import Console
from rich.progress import track
from rich.table import Table

from pipeline.bus import EventProducer, create_topics
from pipeline.ledger import LedgerConfig, LedgerWriter, ledger_filesystem, list_parquet
from pipeline.settings import StackSettings
from pipeline.stack.process import stop
from pipeline.stack.tansu import start_tansu

from samples import sample_group


def one_restart(tmp: Path, flush_s: float, rate_groups: float, warm_s: float, outbox: bool = False) -> dict:
    kafka = start_tansu(tmp)
    settings = StackSettings(
        kafka_bootstrap=f"127.0.0.1:{kafka.port}",
        ledger_uri=str(tmp / "ledger"),
        topic_prefix=f"b{uuid.uuid4().hex[:6]}",
        outbox_dir=tmp / "outbox" if outbox else None,
        _env_file=None,
    )
    create_topics(settings)
    writer, done = LedgerWriter(settings, LedgerConfig(max_batch_seconds=flush_s)), threading.Event()
    follower = threading.Thread(target=_follow, args=(writer, done), daemon=True)
    follower.start()
    producer, acked, g = EventProducer(settings), {}, 0
    started = time.monotonic()
    while time.monotonic() - started < warm_s:
        for e in sample_group("bench", f"g{g}", ["ab" * 32], seed=g):
            producer.publish(e).add_callback(lambda _, i=e.event_id: acked.__setitem__(i, time.monotonic()))
        g += 1
        time.sleep(1 / rate_groups)
    crash = time.monotonic()
    stop(kafka, timeout=0)  # SIGKILL straight away
    left = 0
    if outbox:  # the broker comes back empty; the outbox sends again what it had acknowledged
        kafka = _restarted(tmp, kafka.port)
        create_topics(settings)
        deadline = time.monotonic() + 120
        while len(producer.outbox) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = len(producer.outbox)
        done.set()
        follower.join(timeout=30)
        stop(kafka, timeout=0)
    done.set()
    time.sleep(0.5)
    fs, root = ledger_filesystem(settings)
    files = list_parquet(fs, root)
    written = (
        set(ds.dataset(files, format="parquet").to_table(columns=["event_id"]).column(0).to_pylist())
        if files
        else set()
    )
    lost = [crash - t for i, t in acked.items() if i not in written]
    with suppress(KafkaTimeoutError):  # what the dead broker never acknowledged is abandoned
        producer.close(timeout=0)
    return {"acked": len(acked), "lost": len(lost), "window": max(lost, default=0.0), "left": left}


def _follow(writer: LedgerWriter, done: threading.Event) -> None:
    try:
        writer.sync(follow=True, stop=done)
    except KafkaError:  # the broker is gone for good: what it had is all there was to write
        pass


def _restarted(tmp: Path, port: int):
    """Tansu again on its port (a killed broker's connections can hold it a moment)."""
    for attempt in range(60):
        try:
            return start_tansu(tmp, port=port)
        except Exception:  # noqa: BLE001 - the port is not free yet
            if attempt == 59:
                raise
            time.sleep(0.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--restarts", type=int, default=5)
    ap.add_argument("--rate", type=float, default=20.0, help="Groups per second (about 12 events each).")
    ap.add_argument("--warm", type=float, default=8.0, help="Seconds of steady flow before each crash.")
    ap.add_argument("--outbox-only", action="store_true", help="Only the producers with the outbox.")
    args = ap.parse_args()
    default = LedgerConfig().max_batch_seconds
    rows = {}
    for flush_s in () if args.outbox_only else (default, 2 * default):
        runs = []
        for _ in track(range(args.restarts), description=f"flush every {flush_s:.2f} s"):
            with tempfile.TemporaryDirectory() as tmp:
                runs.append(one_restart(Path(tmp), flush_s, args.rate, args.warm))
        rows[flush_s] = runs
    with_outbox = []
    for _ in track(range(args.restarts), description="with the outbox"):
        with tempfile.TemporaryDirectory() as tmp:
            with_outbox.append(one_restart(Path(tmp), default, args.rate, args.warm, outbox=True))
    table = Table(
        "flush interval",
        "restarts",
        "acked/restart",
        "lost/restart (mean)",
        "window at risk (max s)",
        "window vs default",
    )
    base = max((r["window"] for r in rows.get(default, [])), default=0) or 1e-9
    for flush_s, runs in rows.items():
        window = max(r["window"] for r in runs)
        table.add_row(
            f"{flush_s:.2f} s",
            str(len(runs)),
            f"{statistics.mean(r['acked'] for r in runs):.0f}",
            f"{statistics.mean(r['lost'] for r in runs):.1f}",
            f"{window:.2f}",
            f"{window / base:.2f}x",
        )
    table.add_row(
        f"{default:.2f} s, producers with the outbox",
        str(len(with_outbox)),
        f"{statistics.mean(r['acked'] for r in with_outbox):.0f}",
        f"{statistics.mean(r['lost'] for r in with_outbox):.1f}",
        "-",
        "-",
    )
    print("left unconfirmed in the outbox at the end, per restart:", [r["left"] for r in with_outbox])
    Console(width=150).print(table)


if __name__ == "__main__":
    main()
