"""How a consumer group member's departure during a rebalance affects the local broker (Tansu).

    .venv/bin/python bench/group_leave.py --trials 8 [--burners 3]

Each trial: a fresh broker, a topic of 4 partitions, consumers a and b in one group; c joins (a
rebalance) and 1.5-2.5 s later a or b departs, by LeaveGroup (the library's clean close: `leave`) or
by SIGKILL (expiry after its 6 s session: `kill`). A trial is `wedged` when the two left have not
been given all 4 partitions 40 s later. `--burners` busy processes beside it: the window between a
JoinGroup and its SyncGroup is wider on a loaded machine, which is where CI met it. The consumers are
plain kafka-python ones (no `pipeline.kafka_groups`): this measures the broker.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kafka import KafkaAdminClient
from kafka.admin import NewTopic

from pipeline.stack.tansu import start_tansu

MEMBER = r"""
import json, signal, sys, time
from kafka import KafkaConsumer
boot, name, out = sys.argv[1:4]
c = KafkaConsumer("t", bootstrap_servers=boot, group_id="g", client_id=name, session_timeout_ms=6000,
                  heartbeat_interval_ms=1000, enable_auto_commit=False)
signal.signal(signal.SIGTERM, lambda *_: (c.close(), sys.exit(0)))
while True:
    c.poll(timeout_ms=1000)
    open(out, "w").write(json.dumps(sorted(p.partition for p in c.assignment())))
"""


def _member(boot: str, name: str, d: Path) -> tuple[subprocess.Popen, Path]:
    out = d / f"{name}.json"
    return subprocess.Popen([sys.executable, "-c", MEMBER, boot, name, str(out)], stderr=subprocess.DEVNULL), out


def _partitions(out: Path) -> list[int]:
    try:
        return json.loads(out.read_text())
    except (OSError, ValueError):
        return []


def _settled(members, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if sum(len(_partitions(o)) for _, o in members) == 4 and all(_partitions(o) for _, o in members):
            return True
        time.sleep(0.5)
    return False


def trial(d: Path, how: str, rng: random.Random) -> bool:
    """True if the group settled again after the departure; False: wedged."""
    broker = start_tansu(d / "tansu")
    boot = f"127.0.0.1:{broker.port}"
    members = {}
    try:
        KafkaAdminClient(bootstrap_servers=boot).create_topics([NewTopic("t", 4, 1)])
        members = {n: _member(boot, n, d) for n in "ab"}
        _settled(members.values(), 60)
        members["c"] = _member(boot, "c", d)
        time.sleep(rng.uniform(1.5, 2.5))
        proc, _ = members.pop(rng.choice("ab"))
        proc.send_signal(signal.SIGTERM if how == "leave" else signal.SIGKILL)
        proc.wait()
        return _settled(members.values(), 40)
    finally:
        for proc, _ in members.values():
            proc.kill()
            proc.wait()
        os.kill(broker.pid, signal.SIGKILL)


def main(trials: int = 8, burners: int = 3, seed: int = 0) -> None:
    rng = random.Random(seed)
    burn = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(burners)]
    try:
        results = {}
        for how in ("leave", "kill"):
            wedged = 0
            for i in range(trials):
                with tempfile.TemporaryDirectory() as d:
                    ok = trial(Path(d), how, rng)
                wedged += not ok
                print(f"{how} {i}: {'settled' if ok else 'WEDGED'}", flush=True)
            results[how] = wedged
        print(f"wedged: leave {results['leave']}/{trials}, kill {results['kill']}/{trials} ({burners} burners)")
    finally:
        for b in burn:
            b.kill()
            b.wait()


if __name__ == "__main__":
    typer.run(main)
