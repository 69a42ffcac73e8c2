"""A chaos soak: the whole system under one random fault at a time, then a reconciliation.

    .venv/bin/python bench/chaos.py --minutes 30 --every 60 [--seed N]
    .venv/bin/python bench/chaos.py --matrix --minutes 2 --every 45     # the loaded fault matrix

A stack of its own (Tansu, radosgw) and, kept running as compose's `restart: always` would (whatever
exits is started again): a rollout pool (4 browsers, our sites, the demo policy), 2 ledger writers
and the trainer (2 ranks). Every `--every` seconds one fault drawn from the fault matrix: the broker
SIGKILLed (it comes back empty), the object store down for 10 s, the object store full for 10 s,
the pool, one browser, one ledger writer or the trainer SIGKILLed. The seed is printed first, so a
failure can be replayed.

Then the pool stops, the trainer gets a minute to train what is left, the writers drain the outboxes,
and the run is reconciled:
- every event a producer handed to its outbox (acknowledged or not) is in the ledger: the outboxes
  are empty, and no trajectory in the ledger misses a step below its last;
- no event is in the ledger twice;
- every completed group was trained once, dropped with a reason, or is still open (never twice);
- every published version has its checkpoint in the store.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil
import tenacity
import typer

from pipeline.bus import EventProducer, create_topics
from pipeline.checkpoints import CheckpointStore
from pipeline.ledger import read_events
from pipeline.outbox import Outbox
from pipeline.stack.ceph import s3_healthy
from pipeline.stack.local import LocalStack

FAULTS = ("broker", "store_down", "store_full", "pool", "browser", "writer", "trainer")


def _say(line: str) -> None:
    print(line, flush=True)  # as it happens, also into a file


@dataclass
class Service:
    """One long-running command, started again whenever it exits (compose's `restart: always`)."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    proc: subprocess.Popen | None = None
    starts: int = 0

    def start(self) -> None:
        with open(self.log, "a") as f:
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=f, stderr=subprocess.STDOUT,
                                         start_new_session=True)  # its own group: SIGKILL takes its children
        self.starts += 1

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group (torchrun's ranks, the pool's browsers) and reap it."""
        if self.proc is None:
            return
        with suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@dataclass
class Reconciliation:
    seed: int
    faults: list[tuple[float, str]]
    events: int = 0
    duplicated: int = 0
    left_in_outboxes: int = 0
    resent_at_drain: int = 0
    """Events the restarted producers sent again at the end (never acknowledged, another broker's, or,
    after half the drain, unconfirmed for 30 s: the outbox's last resort, here not after 10 min)."""
    left_but_in_ledger: int = 0
    """Of those, in the ledger all the same (a receipt that never came), as opposed to not yet written."""
    trajectories: int = 0
    missing_steps: int = 0
    groups: int = 0
    trained: int = 0
    trained_twice: int = 0
    dropped: int = 0
    dropped_without_reason: int = 0
    open_groups: int = 0
    updates: int = 0
    """Updates in a published version's lineage."""
    updates_lost: int = 0
    """Updates no published version names: lost with a killed trainer, or after its last version."""
    versions: int = 0
    versions_without_checkpoint: int = 0
    versions_twice: int = 0
    """Version numbers published by two different events (a trainer that resumed from too early)."""
    restarts: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not (self.duplicated or self.left_in_outboxes or self.missing_steps or self.trained_twice
                    or self.dropped_without_reason or self.versions_without_checkpoint or self.versions_twice)

    def lines(self) -> list[str]:
        drawn = Counter(f for _, f in self.faults)
        return [
            f"seed {self.seed}: {len(self.faults)} faults ({', '.join(f'{k} {v}' for k, v in sorted(drawn.items()))})",
            f"events in the ledger: {self.events}, twice: {self.duplicated}; left unconfirmed in outboxes: "
            f"{self.left_in_outboxes} ({self.left_but_in_ledger} of them in the ledger); sent again at the end: "
            f"{self.resent_at_drain}",
            f"trajectories finished: {self.trajectories}, with a missing step: {self.missing_steps}",
            f"groups completed: {self.groups}: trained {self.trained} (twice: {self.trained_twice}), dropped "
            f"{self.dropped} (without a reason: {self.dropped_without_reason}), still open {self.open_groups}",
            f"updates in a published version: {self.updates}; not (lost with a killed trainer, or after its "
            f"last version): {self.updates_lost}",
            f"versions published: {self.versions}, without a checkpoint: {self.versions_without_checkpoint}, "
            f"published twice: {self.versions_twice}",
            "services started again after dying: " + ", ".join(f"{k} {v}" for k, v in sorted(self.restarts.items())),
            "reconciled: OK" if self.ok else "reconciled: FAILED",
        ]


class Soak:
    def __init__(self, workdir: Path, seed: int, run_id: str = "chaos"):
        self.workdir, self.rng, self.run_id = workdir, random.Random(seed), run_id
        self.stack = LocalStack.up(workdir / "stack", durable=False)
        self.settings = self.stack.settings()
        create_topics(self.settings)
        env = {**os.environ, **self.settings.environ(), "AWRL_RUN_ID": run_id}
        awrl = [sys.executable, "-m", "app.cli"]
        logs = workdir / "logs"
        logs.mkdir(exist_ok=True)
        self.pool = Service("pool", [*awrl, "rollout", "--suite", "sites", "--policy", "demo", "--noise", "0.3",
                                     "--workers", "4", "--group-size", "2", "--forever", "--run-id", run_id, "--eta", "4",
                                     "--groups-per-update", "2", "--difficulty", "easy",
                                     "--journal", str(workdir / "journal")], env, logs / "pool.log")
        self.writers = [Service(f"writer{i}", [*awrl, "ledger", "sync", "--follow"], env, logs / f"writer{i}.log")
                        for i in range(2)]
        self.trainer = Service("trainer", [*awrl, "train", "--run-id", run_id, "--nproc", "2", "--groups-per-update",
                                           "2", "--minibatches", "1", "--ppo-epochs", "1", "--eta", "4"],
                               env, logs / "trainer.log")
        self.services = [*self.writers, self.trainer, self.pool]
        self.faults: list[tuple[float, str]] = []
        self.last_resort = 0

    def supervise(self) -> None:
        for s in self.services:
            if not s.alive():
                s.start()

    def inject(self, fault: str) -> None:
        """Inject `fault`; a recovery the loaded machine makes slow (a topic creation or radosgw's
        start timing out) is retried, as an operator would, rather than ending the soak."""
        try:
            self._inject(fault)
        except Exception as exc:  # noqa: BLE001 - the stack's own recovery, not the system under test
            print(f"         {fault}: recovery slow ({type(exc).__name__}: {exc}); retrying", flush=True)
            for attempt in tenacity.Retrying(wait=tenacity.wait_fixed(5), stop=tenacity.stop_after_delay(300),
                                             reraise=True):
                with attempt:
                    if fault == "store_down" and not s3_healthy(self.stack.s3):
                        self.stack.restart("s3")
                    create_topics(self.settings)

    def _inject(self, fault: str) -> None:
        if fault == "broker":
            self.stack.restart("kafka", crash=True)
        elif fault == "store_down":
            self.stack.restart("s3", downtime_s=10)
        elif fault == "store_full":
            self._quota("set", "--max-size=1")
            self._quota("enable")
            time.sleep(10)
            self._quota("disable")
        elif fault == "browser":
            browsers = _browsers(self.pool)
            if browsers:
                self.rng.choice(browsers).kill()
        else:
            {"pool": self.pool, "trainer": self.trainer, "writer": self.rng.choice(self.writers)}[fault].kill()

    def _quota(self, *args: str) -> None:
        conf = self.stack.data_dir / "ceph" / "ceph.conf"
        subprocess.run(["radosgw-admin", "-c", str(conf), "quota", *args, "--quota-scope=bucket",
                        f"--bucket={self.settings.s3_bucket}"], check=True, capture_output=True, timeout=60)

    def run(self, minutes: float, every_s: float, on_fault=_say, only: str | None = None) -> None:
        """`only`: that one fault, once, `every_s` in (a row of the loaded matrix), not random ones."""
        self.supervise()
        started = time.monotonic()
        next_fault = started + every_s
        while time.monotonic() - started < minutes * 60:
            time.sleep(1)
            self.supervise()
            if time.monotonic() >= next_fault and not (only and self.faults):
                fault = only or self.rng.choice(FAULTS)
                self.faults.append((time.monotonic() - started, fault))
                on_fault(f"{time.monotonic() - started:6.0f} s  {fault}")
                self.inject(fault)
                next_fault += every_s  # on the clock: a fault that takes long does not delay the next

    def drain(self, train_s: float = 60.0, outbox_s: float = 180.0) -> None:
        """Stop the pool, give the trainer `train_s`, stop it; then, as producers that start again
        would, confirm and resend what their outboxes hold until the writers have it all."""
        self.pool.kill(signal.SIGINT)
        deadline = time.monotonic() + train_s
        while time.monotonic() < deadline:
            for s in (*self.writers, self.trainer):
                if not s.alive():
                    s.start()
            time.sleep(1)
        self.trainer.kill(signal.SIGTERM)
        prefix = f"{self.settings.topic_prefix}."
        producers = [EventProducer(self.settings, client_id=p.stem.removeprefix(prefix))
                     for p in self._outboxes()]
        for p in producers:
            p._reconciler.unacked_after_s = 0.0  # nothing of theirs is in flight any more
        try:
            deadline = time.monotonic() + outbox_s
            while self._left() and time.monotonic() < deadline:
                if time.monotonic() > deadline - outbox_s / 2:  # the soak's time, compressed: the last
                    for p in producers:                      # resort (10 min unconfirmed) comes now
                        p._reconciler.unconfirmed_after_s = 30.0
                for w in self.writers:
                    if not w.alive():
                        w.start()
                time.sleep(2)
        finally:
            for p in producers:
                p.close(timeout=10)
            self.last_resort = sum(p._reconciler.resent for p in producers)
        for w in self.writers:
            w.kill(signal.SIGTERM)

    def _outboxes(self) -> list[Path]:
        return sorted((self.settings.outbox_dir or Path("/nonexistent")).glob("*.sqlite"))

    def _left(self) -> int:
        return len(self._left_ids())

    def _left_ids(self) -> set[str]:
        left = set()
        for path in self._outboxes():
            box = Outbox(path)
            left |= box.ids()
            box.close()
        return left

    def reconcile(self, seed: int) -> Reconciliation:
        r = Reconciliation(seed, self.faults, restarts={s.name: s.starts - 1 for s in self.services},
                           resent_at_drain=self.last_resort)
        left = self._left_ids()
        r.left_in_outboxes = len(left)
        ids = Counter()
        tables = {}
        for event_type in ("StepRecorded", "EpisodeFinished", "GroupCompleted", "GroupDropped", "UpdateApplied",
                           "PolicyVersionPublished", "EpisodeStarted", "TaskGroupDispatched", "PolicyVersionLoaded"):
            t = read_events(self.settings, self.run_id, event_type).to_pylist()
            tables[event_type] = t
            ids.update(e["event_id"] for e in t)
        r.events, r.duplicated = sum(ids.values()), sum(n - 1 for n in ids.values() if n > 1)
        r.left_but_in_ledger = len(left & set(ids))
        steps: dict[str, set[int]] = {}
        for s in tables["StepRecorded"]:
            steps.setdefault(s["trajectory_id"], set()).add(s["step"])
        finished = tables["EpisodeFinished"]
        r.trajectories = len(finished)
        r.missing_steps = sum(1 for f in finished if steps.get(f["trajectory_id"], set()) != set(range(f["num_steps"])))
        completed = {g["group_id"] for g in tables["GroupCompleted"]}
        # Trained = in an update that a published version's lineage names. An update whose version a
        # killed trainer never published was lost with it; its groups were consumed again.
        lineage = {u for v in tables["PolicyVersionPublished"] for u in v["update_ids"]}
        kept = [u for u in tables["UpdateApplied"] if u["event_id"] in lineage]
        r.updates, r.updates_lost = len(kept), len(tables["UpdateApplied"]) - len(kept)
        trained = Counter(g for u in kept for g in u["group_ids"])
        dropped = {d["group_id"]: d.get("reason") for d in tables["GroupDropped"]}
        r.groups, r.trained = len(completed), len(completed & set(trained))
        r.trained_twice = sum(1 for n in trained.values() if n > 1)
        r.dropped = len(completed & set(dropped))
        r.dropped_without_reason = sum(1 for reason in dropped.values() if not reason)
        r.open_groups = len(completed - set(trained) - set(dropped))
        store = CheckpointStore.from_settings(self.settings)
        versions = {v["version"] for v in tables["PolicyVersionPublished"] if v["version"] > 0}
        r.versions = len(versions)
        numbers = Counter(n for n, _ in {(v["version"], v["event_id"]) for v in tables["PolicyVersionPublished"]})
        r.versions_twice = sum(1 for n in numbers.values() if n > 1)
        r.versions_without_checkpoint = sum(1 for v in versions if not store.exists(self.run_id, v))
        return r

    def down(self) -> None:
        try:
            for s in self.services:
                s.kill()
        finally:
            self.stack.down()


def _browsers(service: Service) -> list[psutil.Process]:
    """The pool's live Chromium browsers (their main processes, not renderers or zombies)."""
    out = []
    try:
        children = psutil.Process(service.proc.pid).children(recursive=True)
    except (psutil.Error, AttributeError):
        return []
    for p in children:
        try:
            if "chromium" in p.name() and p.status() != psutil.STATUS_ZOMBIE and \
                    not any(a.startswith("--type=") for a in p.cmdline()):
                out.append(p)
        except psutil.Error:  # gone meanwhile
            continue
    return out


def soak(workdir: Path, minutes: float, every_s: float, seed: int | None = None, on_fault=_say,
         only: str | None = None) -> Reconciliation:
    seed = random.SystemRandom().randrange(2**31) if seed is None else seed
    what = f"only {only}, once" if only else f"a fault every {every_s:g} s"
    on_fault(f"chaos soak: seed {seed} ({minutes:g} min, {what}; replay with --seed {seed})")
    s = Soak(workdir, seed)
    try:
        s.run(minutes, every_s, on_fault, only)
        s.drain()
        return s.reconcile(seed)
    finally:
        s.down()


MATRIX_HEAD = ("| fault (under load) | events in the ledger | twice | unconfirmed in outboxes | trajectories with a "
               "missing step | groups: trained / dropped / open | versions (without checkpoint) | restarted |\n"
               "|---|---|---|---|---|---|---|---|")


def matrix_row(fault: str, r: Reconciliation) -> str:
    restarted = ", ".join(f"{k} {v}" for k, v in sorted(r.restarts.items()) if v) or "-"
    return (f"| {fault} | {r.events} | {r.duplicated} | {r.left_in_outboxes} | {r.missing_steps} | "
            f"{r.trained} / {r.dropped} / {r.open_groups} | {r.versions} ({r.versions_without_checkpoint}) | "
            f"{restarted} |")


def main(minutes: float = typer.Option(30.0, help="Length of the soak."),
         every: float = typer.Option(60.0, help="Seconds between faults."),
         seed: int = typer.Option(None, help="Replay a soak (printed first by every run)."),
         matrix: bool = typer.Option(False, help="The loaded fault matrix instead: each fault alone, once, "
                                                 "`--every` s into a `--minutes` run of the whole system."),
         only: str = typer.Option(None, help=f"One row of the matrix: {', '.join(FAULTS)}."),
         workdir: Path = typer.Option(Path(".awrl/chaos"))) -> None:
    workdir = workdir.resolve() / time.strftime("%Y%m%dT%H%M%S")
    workdir.mkdir(parents=True)
    if only and only not in FAULTS:
        raise typer.BadParameter(f"{only!r} is not one of {', '.join(FAULTS)}", param_hint="--only")
    if matrix or only:
        rows, ok = [MATRIX_HEAD], True
        for fault in [only] if only else FAULTS:
            r = soak(workdir / fault, minutes, every, seed, only=fault)
            rows.append(matrix_row(fault, r))
            ok &= r.ok
            print(rows[-1], flush=True)
            if not r.ok:  # the row shows the counts; this, which check failed
                print("\n".join(r.lines()), flush=True)
        print("\n".join(rows))
        raise typer.Exit(0 if ok else 1)
    r = soak(workdir, minutes, every, seed)
    for line in r.lines():
        print(line)
    raise typer.Exit(0 if r.ok else 1)


if __name__ == "__main__":
    typer.run(main)
