"""What the producers' outbox (`pipeline.outbox`) costs a step: the SQLite write of one `StepRecorded`.

    .venv/bin/python bench/outbox.py [--events 2000]

Writes realistic step events (`tests/samples.py`, ~15 KB each) into a fresh outbox, one at a time as
the pool does, and also times the same events' encoding (which every send pays anyway) side by side,
so the ratio does not depend on how loaded the machine is. A rollout step takes ~1 s on this machine
(policy + browser); the last line puts the outbox's write against that.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/samples.py

import tempfile
import time

import typer

from pipeline.outbox import Outbox
from schemas import encode_event

from samples import sample_step


def main(events: int = 2000) -> None:
    steps = [sample_step("bench", "g", f"t{i}", 0, "ab" * 32, seed=i) for i in range(events)]
    t = time.perf_counter()
    values = [(e.event_id, encode_event(e)) for e in steps]
    encode_s = (time.perf_counter() - t) / events
    with tempfile.TemporaryDirectory() as d:
        box = Outbox(Path(d) / "bench.sqlite")
        t = time.perf_counter()
        for event_id, value in values:
            box.add(event_id, "awrl.rollout", b"key", value, [("event_type", b"StepRecorded")])
        add_s = (time.perf_counter() - t) / events
        box.close()
    size = sum(len(v) for _, v in values) / events / 1024
    print(f"{events} StepRecorded events of {size:.1f} KB")
    print(f"encode (every send pays it): {encode_s * 1e6:.0f} us/event")
    print(f"outbox write:                {add_s * 1e6:.0f} us/event ({add_s / encode_s:.2f}x the encoding)")
    print(f"against a 1 s step:          {add_s * 100:.3f}%")


if __name__ == "__main__":
    typer.run(main)
