"""A chaos soak: the whole system under one random fault at a time, then a reconciliation.

    .venv/bin/python bench/chaos.py --faults 30 --every 60 [--seed N]
    .venv/bin/python bench/chaos.py --matrix --every 45                 # the loaded fault matrix
    .venv/bin/python bench/chaos.py --faults 30 --every 60 --rebalance  # and the writers churning

A stack of its own (Tansu, radosgw) and, kept running as compose's `restart: always` would (whatever
exits is started again): a rollout pool (4 browsers, our sites, the demo policy), 2 ledger writers
and the trainer (2 ranks). `--faults` faults drawn from the fault matrix: the broker SIGKILLed (it
comes back empty), the object store down for 10 s, the object store full for 10 s, the pool, one
browser, one ledger writer or the trainer SIGKILLed. The seed is printed first, so a failure can be
replayed. A fault comes `--every` seconds after the one before at the earliest, and only once a
finished episode more is in the ledger: the soak is budgeted in faults and events, so a loaded
machine makes it longer, never emptier (a 3-minute clock once gave CI a run with no update at all).

With `--rebalance` (the matrix's `rebalance` row), also half-way between those: 3 more ledger
writers join the consumer group, or leave it (`writers_churn`), and every 4th time one of the 2
writers is SIGSTOPped for longer than its Kafka session, so the group hands its partitions on, then
resumed (`writer_stop`). These draw nothing from the seed's faults.

After the last fault the system runs on until the trainer has published a version with an update.
Then the pool stops, the trainer gets a minute to train what is left, the writers drain the
outboxes, and the run is reconciled (`bench/chaos_reconcile.py`): nothing lost, nothing twice, no group trained
twice or with a step missing, none open past its timeout.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil
import tenacity
import typer

from pipeline.bus import EventProducer, create_topics
from pipeline.ledger import read_events, stored_event_ids
from pipeline.outbox import Outbox
from pipeline.stack.ceph import s3_healthy
from pipeline.stack.local import LocalStack

from chaos_reconcile import Reconciliation, reconcile

FAULTS = ("broker", "store_down", "store_full", "pool", "browser", "writer", "trainer")
REBALANCE = ("writers_churn", "writer_stop")
"""Not drawn: on their own schedule with `rebalance` (a seed draws the same `FAULTS` with or without)."""
GUESTS = 3
"""Ledger writers that join and leave (`writers_churn`), beside the 2 that are always there."""
STOP_EVERY = 4
"""Every this many `writers_churn`, also a `writer_stop`."""
STOP_S = 15.0
"""How long `writer_stop` holds a writer: past its consumer's 6 s session (`pipeline.consumer`), so the
group has handed its partitions to the others when it resumes with the records it held."""
ROWS = (*FAULTS, *REBALANCE, "rebalance")
"""The loaded matrix's rows: each fault alone, once; `rebalance`: the `REBALANCE` schedule alone."""
ETA = 4
"""The pool's and trainer's staleness bound (also the timeout of a group that waits for a step)."""
DRAIN_PATIENCE_S = 180.0
"""How long the drain waits on a count of groups past their timeout that no longer falls (the
reconciliation then reports them)."""


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
            self.proc = subprocess.Popen(
                self.argv, env=self.env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
            )  # its own group: SIGKILL takes its children
        self.starts += 1

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def send(self, sig: int) -> None:
        """Signal the whole process group (torchrun's ranks, the pool's browsers)."""
        if self.proc is not None:
            with suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group and reap it."""
        if self.proc is None:
            return
        self.send(sig)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


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
        self.pool = Service(
            "pool",
            [
                *awrl,
                "rollout",
                "--suite",
                "sites",
                "--policy",
                "demo",
                "--noise",
                "0.3",
                "--workers",
                "4",
                "--group-size",
                "2",
                "--forever",
                "--run-id",
                run_id,
                "--eta",
                str(ETA),
                "--groups-per-update",
                "2",
                "--difficulty",
                "easy",
                "--journal-dir",
                str(workdir / "journal"),
            ],
            env,
            logs / "pool.log",
        )
        self.writers = [
            Service(f"writer{i}", [*awrl, "ledger", "sync", "--follow"], env, logs / f"writer{i}.log") for i in range(2)
        ]
        self.trainer = Service(
            "trainer",
            [
                *awrl,
                "train",
                "--run-id",
                run_id,
                "--nproc",
                "2",
                "--groups-per-update",
                "2",
                "--minibatches",
                "1",
                "--ppo-epochs",
                "1",
                "--eta",
                str(ETA),
            ],
            env,
            logs / "trainer.log",
        )
        self.services = [*self.writers, self.trainer, self.pool]
        self.guests = [
            Service(f"guest{i}", [*awrl, "ledger", "sync", "--follow"], env, logs / f"guest{i}.log")
            for i in range(GUESTS)
        ]
        """Writers that `writers_churn` starts and stops (not restarted when they exit)."""
        self.stopped: tuple[subprocess.Popen, float] | None = None
        """The writer `writer_stop` holds, and when (monotonic) it is to resume."""
        self.churns = 0
        self.faults: list[tuple[float, str]] = []
        self.last_resort = 0
        self.patience_s = 600.0
        """Seconds without a finished episode or a version more in the ledger after which the soak ends
        as `stalled`: a hang guard, far above a loaded machine's pace (a few episodes a minute)."""
        self.stalled = ""

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
            for attempt in tenacity.Retrying(
                wait=tenacity.wait_fixed(5), stop=tenacity.stop_after_delay(300), reraise=True
            ):
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
        elif fault == "writers_churn":
            self.churns += 1
            if any(g.alive() for g in self.guests):
                for g in self.guests:  # all leave at once, as compose's scale-down: their flushes settled
                    g.send(signal.SIGTERM)
                for g in self.guests:
                    g.kill(signal.SIGTERM)
            else:
                for g in self.guests:
                    g.start()
        elif fault == "writer_stop":
            self.resume()
            target = self.writers[self.churns // STOP_EVERY % len(self.writers)]
            target.send(signal.SIGSTOP)
            self.stopped = (target.proc, time.monotonic() + STOP_S)
        elif fault == "browser":
            browsers = _browsers(self.pool)
            if browsers:
                self.rng.choice(browsers).kill()
        else:
            {"pool": self.pool, "trainer": self.trainer, "writer": self.rng.choice(self.writers)}[fault].kill()

    def resume(self, due_only: bool = False) -> None:
        """SIGCONT the writer `writer_stop` holds (only once its time is up, with `due_only`)."""
        if self.stopped is None or (due_only and time.monotonic() < self.stopped[1]):
            return
        proc, self.stopped = self.stopped[0], None
        if proc.poll() is None:  # not SIGKILLed meanwhile by a `writer` fault
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGCONT)

    def _quota(self, *args: str) -> None:
        conf = self.stack.data_dir / "ceph" / "ceph.conf"
        subprocess.run(
            [
                "radosgw-admin",
                "-c",
                str(conf),
                "quota",
                *args,
                "--quota-scope=bucket",
                f"--bucket={self.settings.s3_bucket}",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )

    def run(self, faults: int, every_s: float, on_fault=_say, only: str | None = None, rebalance: bool = False) -> None:
        """Inject `faults` faults drawn from `FAULTS` (`only`: that one; `rebalance` as `only`: none, that
        many `writers_churn`), with `rebalance` a `writers_churn` half-way between. Each waits `every_s`
        (half of it between two of a rebalance schedule) and until a finished episode more than at the
        one before is in the ledger, so the system did work between any two faults however slow the
        machine. Then the system runs on, fault-free, until the trainer has published a version with an
        update since the last fault. Budgeted in events: `patience_s` without any progress ends it as
        `stalled` (a failure), never a clock that a loaded machine runs out."""
        self.supervise()
        started = time.monotonic()
        gap = every_s / 2 if rebalance and only != "rebalance" else every_s
        last = (started, self._finished() or 0)
        for fault in _schedule(faults, only, rebalance):
            if fault != "writer_stop" and not self._wait(
                lambda ledger, at=last: self._progressed(at, gap, ledger[0]), "before a fault"
            ):
                return
            if fault == "drawn":  # drawn when due, between the faults' own draws (a browser, a writer)
                fault = only or self.rng.choice(FAULTS)
            self.faults.append((time.monotonic() - started, fault))
            on_fault(f"{time.monotonic() - started:6.0f} s  {fault}")
            self.inject(fault)
            done = self._finished()
            last = (time.monotonic(), last[1] if done is None else done)
        versions = self._versions() or 0
        self._wait(lambda ledger: (ledger[1] or 0) > versions, "for a version after the last fault")

    def _tick(self, seconds: int = 3) -> None:
        for _ in range(seconds):
            time.sleep(1)
            self.supervise()
            self.resume(due_only=True)

    def _wait(self, until, what: str) -> bool:
        """Keep the system running until `until((finished, versions))`, the ledger's counts read once a
        round; False (and `stalled` set) if `patience_s` passes without either growing."""
        seen, since = (self._finished(), self._versions()), time.monotonic()
        now = seen
        while not until(now):
            self._tick()
            now = (self._finished(), self._versions())
            if now != seen and None not in now:
                seen, since = now, time.monotonic()
            elif time.monotonic() - since > self.patience_s:
                self.stalled = (
                    f"no finished episode and no version reached the ledger in {self.patience_s:g} s ({what})"
                )
                _say(f"         stalled: {self.stalled}")
                return False
        return True

    @staticmethod
    def _progressed(last: tuple[float, int], gap: float, done: int | None) -> bool:
        """`gap` seconds since the last fault, and a finished episode more than then (`done`)."""
        return time.monotonic() - last[0] >= gap and done is not None and done > last[1]

    def _finished(self) -> int | None:
        """Finished episodes in the ledger (None while the store cannot be read: store down)."""
        try:
            return len(stored_event_ids(self.settings, self.run_id, "EpisodeFinished"))
        except Exception:  # noqa: BLE001 - a fault of the soak's own making
            return None

    def _versions(self) -> int | None:
        """Published versions in the ledger that name an update (None while the store cannot be read)."""
        try:
            published = read_events(self.settings, self.run_id, "PolicyVersionPublished", ["update_ids"])
        except Exception:  # noqa: BLE001 - a fault of the soak's own making
            return None
        return sum(1 for ids in published.column("update_ids").to_pylist() if ids)

    def drain(self, train_s: float = 60.0, last_resort_s: float = 90.0) -> None:
        """Stop the pool, give the trainer `train_s` more and then until no group is past its timeout
        (or that count stays put for `DRAIN_PATIENCE_S`), stop it; then, as producers that start again
        would, confirm and resend what their outboxes hold until the writers have it all (after
        `last_resort_s`, also what stayed unconfirmed for 30 s: the outbox's last resort, compressed)."""
        self.pool.kill(signal.SIGINT)
        self.resume()
        for g in self.guests:
            g.kill(signal.SIGTERM)
        # At least `train_s`, then until the trainer has trained or dropped every group past its timeout:
        # on an idle machine the pool completes groups far faster than the trainer reads them.
        started = since = polled = time.monotonic()
        behind = None
        while True:
            for s in (*self.writers, self.trainer):
                if not s.alive():
                    s.start()
            time.sleep(1)
            if time.monotonic() - started < train_s or time.monotonic() - polled < 10:
                continue
            polled = time.monotonic()
            now = self._past_timeout()
            if now == 0:
                break
            if now != behind:
                behind, since = now, time.monotonic()
            elif time.monotonic() - since > DRAIN_PATIENCE_S:
                break  # the reconciliation reports them
        self.trainer.kill(signal.SIGTERM)
        prefix = f"{self.settings.topic_prefix}."
        producers = [EventProducer(self.settings, client_id=p.stem.removeprefix(prefix)) for p in self._outboxes()]
        for p in producers:
            p._reconciler.unacked_after_s = 0.0  # nothing of theirs is in flight any more
        try:
            started = since = time.monotonic()
            left = self._left()
            while left:
                if time.monotonic() - started > last_resort_s:  # the soak's time, compressed: the last
                    for p in producers:  # resort (10 min unconfirmed) comes now
                        p._reconciler.unconfirmed_after_s = 30.0
                for w in self.writers:
                    if not w.alive():
                        w.start()
                time.sleep(2)
                now = self._left()
                if now < left:
                    since = time.monotonic()
                elif time.monotonic() - since > self.patience_s:
                    self.stalled = f"the outboxes kept {now} events for {self.patience_s:g} s"
                    break
                left = now
        finally:
            for p in producers:
                p.close(timeout=10)
            self.last_resort = sum(p._reconciler.resent for p in producers)
        for w in self.writers:
            w.kill(signal.SIGTERM)

    def _past_timeout(self) -> int | None:
        """Groups the trainer should have trained or dropped by now (None while the store cannot be read)."""
        try:
            return reconcile(Reconciliation(0, []), self.settings, self.run_id, set(), ETA).open_past_timeout
        except Exception:  # noqa: BLE001 - a fault of the soak's own making
            return None

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
        r = Reconciliation(
            seed,
            self.faults,
            restarts={s.name: s.starts - 1 for s in self.services},
            resent_at_drain=self.last_resort,
            stalled=self.stalled,
        )
        r = reconcile(r, self.settings, self.run_id, self._left_ids(), ETA)
        r.logs = {s.name: _tail(s.log) for s in [*self.services, *self.guests] if s.log.exists()}
        return r

    def down(self) -> None:
        self.resume()
        try:
            for s in [*self.services, *self.guests]:
                s.kill()
        finally:
            self.stack.down()


def _tail(log: Path, lines: int = 12) -> list[str]:
    return log.read_text(errors="replace").splitlines()[-lines:]


def _schedule(faults: int, only: str | None, rebalance: bool) -> list[str]:
    """The soak's faults in order: `faults` drawn ones (`drawn`: from `FAULTS` when due, or `only`), each
    after a `writers_churn` with `rebalance`, every `STOP_EVERY`-th of those followed by a `writer_stop`;
    with `only="rebalance"`, `faults` churns and their stops alone."""
    out, churns = [], 0
    for _ in range(faults):
        if rebalance or only == "rebalance":
            churns += 1
            out += ["writers_churn", "writer_stop"] if churns % STOP_EVERY == 0 else ["writers_churn"]
        if only != "rebalance":
            out.append("drawn")
    return out


def _browsers(service: Service) -> list[psutil.Process]:
    """The pool's live Chromium browsers (their main processes, not renderers or zombies)."""
    out = []
    try:
        children = psutil.Process(service.proc.pid).children(recursive=True)
    except (psutil.Error, AttributeError):
        return []
    for p in children:
        try:
            if (
                "chromium" in p.name()
                and p.status() != psutil.STATUS_ZOMBIE
                and not any(a.startswith("--type=") for a in p.cmdline())
            ):
                out.append(p)
        except psutil.Error:  # gone meanwhile
            continue
    return out


def soak(
    workdir: Path,
    faults: int,
    every_s: float,
    seed: int | None = None,
    on_fault=_say,
    only: str | None = None,
    rebalance: bool = False,
) -> Reconciliation:
    seed = random.SystemRandom().randrange(2**31) if seed is None else seed
    what = f"only {only}" if only else "drawn"
    what += ", writers joining and leaving between" if rebalance or only == "rebalance" else ""
    on_fault(
        f"chaos soak: seed {seed} ({faults} faults, {what}; each at least {every_s:g} s and a finished "
        f"episode after the one before; replay with --seed {seed})"
    )
    s = Soak(workdir, seed)
    try:
        s.run(faults, every_s, on_fault, only, rebalance)
        s.drain()
        return s.reconcile(seed)
    finally:
        s.down()


MATRIX_HEAD = (
    "| fault (under load) | events in the ledger | twice | unconfirmed in outboxes | trajectories with a "
    "missing step | groups: trained / dropped / open | trained with a missing step / open past timeout | "
    "versions (without checkpoint) | restarted |\n|---|---|---|---|---|---|---|---|---|"
)


def matrix_row(fault: str, r: Reconciliation) -> str:
    restarted = ", ".join(f"{k} {v}" for k, v in sorted(r.restarts.items()) if v) or "-"
    return (
        f"| {fault} | {r.events} | {r.duplicated} | {r.left_in_outboxes} | {r.missing_steps} | "
        f"{r.trained} / {r.dropped} / {r.open_groups} | {r.trained_with_missing_step} / {r.open_past_timeout} | "
        f"{r.versions} ({r.versions_without_checkpoint}) | "
        f"{restarted} |"
    )


def main(
    faults: int = typer.Option(30, help="Faults drawn (at least `--every` s and a finished episode apart)."),
    every: float = typer.Option(60.0, help="Least seconds between faults."),
    seed: int = typer.Option(None, help="Replay a soak (printed first by every run)."),
    matrix: bool = typer.Option(
        False,
        help="The loaded fault matrix instead: each fault alone, once, `--every` s into a run of the whole system.",
    ),
    only: str = typer.Option(None, help=f"One row of the matrix: {', '.join(ROWS)}."),
    rebalance: bool = typer.Option(False, help="Also the writers joining, leaving and stalling (`REBALANCE`)."),
    workdir: Path = typer.Option(Path(".awrl/chaos")),
) -> None:
    workdir = workdir.resolve() / time.strftime("%Y%m%dT%H%M%S")
    workdir.mkdir(parents=True)
    if only and only not in ROWS:
        raise typer.BadParameter(f"{only!r} is not one of {', '.join(ROWS)}", param_hint="--only")
    if matrix or only:
        rows, ok = [MATRIX_HEAD], True
        for fault in [only] if only else ROWS:
            r = soak(workdir / fault, STOP_EVERY if fault == "rebalance" else 1, every, seed, only=fault)
            rows.append(matrix_row(fault, r))
            ok &= r.ok
            print(rows[-1], flush=True)
            if not r.ok:  # the row shows the counts; this, which check failed
                print("\n".join(r.lines()), flush=True)
        print("\n".join(rows))
        raise typer.Exit(0 if ok else 1)
    r = soak(workdir, faults, every, seed, rebalance=rebalance)
    for line in r.lines():
        print(line)
    raise typer.Exit(0 if r.ok else 1)


if __name__ == "__main__":
    typer.run(main)
