"""The everlasting rollout pool: N browser workers fed task groups from Kafka, never rebuilt.

Task groups arrive on the tasks topic, consumed by every pool process as one consumer group, so adding
pool processes on more machines adds throughput with no other change. A group's G episodes fan out to
this process's workers; when all have ended (and their events are acknowledged) the pool emits
`GroupCompleted` and only then commits the group's offset, so a crash re-runs a group rather than
losing it. New policy versions are loaded between steps, in place (AsyncWebRL's weight broadcast).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from playwright.async_api import async_playwright

from pipeline.bus import EventProducer
from pipeline.consumer import EventConsumer
from pipeline.hashing import sha256_hex
from pipeline.history import follow_run
from pipeline.settings import StackSettings
from pipeline.store import ScreenshotStore
from pipeline.topics import TASKS, TRAINER
from rollout.browser import BrowserConfig, BrowserWorker
from rollout.episode import EpisodeConfig, EpisodeContext, PolicyLoadError, run_episode
from rollout.episode_journal import EpisodeJournal, reap
from rollout.judges import ModelJudge
from rollout.types import Policy, Suite
from schemas import (
    EpisodeFinished,
    EpisodeStarted,
    Event,
    GroupCompleted,
    PolicyVersionLoaded,
    PolicyVersionPublished,
    StepRecorded,
    TaskGroupDispatched,
)
from schemas.observation import Task

log = logging.getLogger("awrl.rollout")


@dataclass(frozen=True)
class PoolConfig:
    workers: int = 4
    """Browsers in this process, each alive for the whole run."""
    consumer_group: str = "rollout"
    """Kafka consumer group shared by all pool processes of a deployment."""
    run_id: str | None = None
    """Serve only this run's task groups and load the versions its trainer publishes (give each run
    its own `consumer_group`); None serves every run (one-run deployments)."""
    browser: BrowserConfig = BrowserConfig()
    episode: EpisodeConfig = EpisodeConfig()
    everlasting: bool = True
    """Keep each browser for the whole run; False relaunches it after every episode (the ablation)."""
    journal_dir: Path | None = Path(".awrl/rollout-journal")
    """Open-episode journals of the pools on this host (`rollout.episode_journal`): a killed pool's open
    episodes are sent again and ended (as env_error) by the next pool to look. None: no journal."""


@dataclass
class PoolStats:
    episodes: int = 0
    successes: int = 0
    env_errors: int = 0
    judge_errors: int = 0
    """Episodes the model judge gave no verdict on (`judge_error`: their groups are dropped)."""
    steps: int = 0
    groups: int = 0
    screenshots_uploaded: int = 0
    screenshot_dedup_hits: int = 0
    """Screenshots not uploaded because the same page was already stored."""
    groups_dispatched: int = 0
    """Groups this process dispatched (when it is also the dispatcher)."""
    dispatch_paused_s: float = 0.0
    """Time the dispatcher held groups back because the staleness budget was exhausted."""
    busy_s: float = 0.0
    """Worker time spent on episodes and on completing their groups (summed over workers)."""
    record_s: float = 0.0
    """Of `busy_s`, the time spent recording: storing screenshots, publishing events, awaiting acks."""
    orphans_closed: int = 0
    """Open episodes of dead pool processes this pool sent again and ended (`rollout.episode_journal`)."""
    groups_rerun: int = 0
    """Groups run again because the broker did not acknowledge all their events."""
    store_waited_s: float = 0.0
    """Time paused because the object store was unreachable or full."""
    started: float = field(default_factory=time.monotonic)

    @property
    def steps_per_s(self) -> float:
        return self.steps / max(time.monotonic() - self.started, 1e-9)


@dataclass
class _Group:
    dispatch: TaskGroupDispatched
    task: Task
    offset: tuple[str, int, int]
    results: list[EpisodeFinished] = field(default_factory=list)
    acks: list = field(default_factory=list)
    versions: set[int] = field(default_factory=set)
    """Policy versions that produced the group's steps (a trajectory can span several)."""


class RolloutPool:
    def __init__(self, settings: StackSettings, suites: dict[str, Suite], policy: Policy, config: PoolConfig):
        self.settings, self.suites, self.policy, self.config = settings, suites, policy, config
        self.stats = PoolStats()
        self.judge = ModelJudge(config.episode.model_judge) if config.episode.judge == "model" else None
        self.producer = EventProducer(settings, client_id="rollout")
        self.store = ScreenshotStore.from_settings(settings)
        self._tasks = {(s.name, t.task_id): t for s in suites.values() for t in s.tasks()}
        self._latest: PolicyVersionPublished | None = None
        self._refresh_lock = asyncio.Lock()
        self._done_offsets: list[tuple[str, int, int]] = []
        self._stop = threading.Event()
        self._stop_requested = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        # Journals are per deployment (broker + topic prefix): a reaper publishes where the dead pool did.
        deployment = sha256_hex(f"{settings.kafka_bootstrap}/{settings.topic_prefix}".encode())[:16]
        self._journals = config.journal_dir / deployment if config.journal_dir is not None else None
        self.journal = EpisodeJournal(self._journals) if self._journals is not None else None

    # -- public ----------------------------------------------------------------------------------
    async def run(self, max_groups: int | None = None, on_progress=None) -> PoolStats:
        """Run until `max_groups` groups completed (forever if None). A group whose last episode ends
        while the pool stops is still completed and committed, so a pool may complete a few more."""
        loop = asyncio.get_running_loop()
        self._reap()
        jobs: asyncio.Queue = asyncio.Queue()
        self._jobs = jobs
        capacity = threading.Semaphore(max(1, self.config.workers // 2) + 1)
        feeder = threading.Thread(target=self._feed, args=(loop, jobs, capacity), daemon=True)
        watcher = threading.Thread(target=self._watch_versions, daemon=True)
        feeder.start(), watcher.start()
        self._all_done = asyncio.Event()
        self._announcing: set[asyncio.Future] = set()
        self._loop = loop
        if self._stop_requested.is_set():
            self._all_done.set()
        self._max_groups, self._capacity, self._on_progress = max_groups, capacity, on_progress
        async with async_playwright() as pw:
            workers = [BrowserWorker(pw, f"w{i}", self.config.browser) for i in range(self.config.workers)]
            if any(s.needs_browser for s in self.suites.values()):  # synthetic suites draw their own screens
                await asyncio.gather(*(w.ensure() for w in workers))
            self.workers = workers
            self.stats.started = time.monotonic()  # rates count from when the browsers are up
            runners = [asyncio.create_task(self._work(w, jobs)) for w in workers]
            failed = await _first_failure(self._all_done, runners)
            await _cancel_all(runners)
            if failed is not None:  # a worker that died quietly would leave a pool that looks alive
                self._stop.set()
                raise failed
            await asyncio.gather(*self._announcing, return_exceptions=True)  # groups already announced
            await asyncio.gather(*(w.close() for w in workers))
        self._stop.set()
        self.stats.screenshots_uploaded = self.store.stats.puts
        self.stats.screenshot_dedup_hits = self.store.stats.dedup_hits
        self.stats.store_waited_s = self.store.stats.waited_s
        feeder.join(timeout=30), watcher.join(timeout=10)
        if self.journal is not None:
            self.journal.close()
        self.producer.close()
        return self.stats

    def request_stop(self) -> None:
        """Stop `run` from another thread: running episodes are cancelled, their groups never
        complete, so their dispatch offsets stay uncommitted and another pool re-runs them."""
        self._stop_requested.set()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._all_done.set)

    # -- workers ---------------------------------------------------------------------------------
    async def _work(self, worker: BrowserWorker, jobs: asyncio.Queue) -> None:
        while not self._all_done.is_set():
            group: _Group = await jobs.get()
            ctx = EpisodeContext(
                run_id=group.dispatch.run_id,
                worker=worker,
                policy=self.policy,
                suite=self.suites[group.task.suite],
                emit=lambda e, g=group: self._emit(e, g),
                put_screenshot=self._put_screenshot,
                refresh=self._refresh,
                config=self.config.episode,
                judge=self.judge,
            )
            await self._catch_up(group.dispatch.dispatched_at_version)
            t0 = time.perf_counter()
            finished = await run_episode(ctx, group.task, group.dispatch.group_id)
            if not self.config.everlasting and ctx.suite.needs_browser:
                await worker.close()
                await worker.ensure()
            self._count(finished)
            group.results.append(finished)
            if len(group.results) == group.dispatch.group_size:
                await self._complete(group)
            self.stats.busy_s += time.perf_counter() - t0
            if self._on_progress:
                self._on_progress(self)

    async def _put_screenshot(self, png: bytes) -> str:
        t0 = time.perf_counter()
        sha = await asyncio.to_thread(self.store.put, png)
        self.stats.record_s += time.perf_counter() - t0
        return sha

    def _emit(self, event: Event, group: _Group) -> None:
        t0 = time.perf_counter()
        if isinstance(event, StepRecorded):
            group.versions.update(event.token_policy_versions or [event.policy_version])
        elif isinstance(event, EpisodeStarted):
            group.versions.add(event.policy_version)
        if self.journal is not None:  # ahead of the send: a reaper can send it again, never miss it
            self.journal.record(event)
        group.acks.append(self.producer.publish(event))
        if self.journal is not None:
            self.journal.sent(event)
        self.stats.record_s += time.perf_counter() - t0

    def _reap(self) -> None:
        """End the open episodes of pool processes on this host that died."""
        if self._journals is None:
            return
        try:
            self.stats.orphans_closed += reap(self._journals, self.producer.publish_all)
        except Exception as exc:  # the broker is away: the claimed journal is retried next time
            log.warning("ending a dead pool's episodes failed (%s: %s); will retry", type(exc).__name__, exc)

    def _count(self, f: EpisodeFinished) -> None:
        s = self.stats
        s.episodes += 1
        s.steps += f.num_steps
        s.successes += f.outcome == "success"
        s.env_errors += f.outcome == "env_error"
        s.judge_errors += f.outcome == "judge_error"
        if self._on_progress:
            self._on_progress(self)

    async def _complete(self, group: _Group) -> None:
        # Shielded: once `GroupCompleted` is sent, its offset must be recorded even if the pool stops
        # meanwhile (another group reaching `max_groups` cancels this worker), or the next pool in the
        # consumer group runs the group again and it completes twice. `run` awaits these before its
        # feeder's last commit.
        task = asyncio.ensure_future(self._announce(group))
        self._announcing.add(task)
        task.add_done_callback(self._announcing.discard)
        await asyncio.shield(task)

    async def _announce(self, group: _Group) -> None:
        d, rs = group.dispatch, group.results
        versions = group.versions or {self.policy.version}
        completed = GroupCompleted(
            run_id=d.run_id,
            group_id=d.group_id,
            task_id=d.task_id,
            trajectory_ids=[r.trajectory_id for r in rs],
            rewards=[r.reward for r in rs],
            num_steps=[r.num_steps for r in rs],
            outcomes=[r.outcome for r in rs],
            min_policy_version=min(versions),
            max_policy_version=max(versions),
        )
        # Every step of the group must be acknowledged before the group is announced complete.
        t0 = time.perf_counter()
        acks = group.acks + [self.producer.publish(completed)]
        try:
            await asyncio.to_thread(lambda: [f.get(timeout=60) for f in acks])
        except Exception as exc:  # part of it never reached the log: run the whole group again
            log.warning(
                "group %s not acknowledged by the broker (%s); running it again", d.group_id, type(exc).__name__
            )
            self.stats.groups_rerun += 1
            group.results, group.acks, group.versions = [], [], set()
            for _ in range(d.group_size):
                self._jobs.put_nowait(group)
            return
        finally:
            self.stats.record_s += time.perf_counter() - t0
        self._done_offsets.append(group.offset)
        self.stats.groups += 1
        self._capacity.release()
        if self._max_groups is not None and self.stats.groups >= self._max_groups:
            self._all_done.set()

    async def _catch_up(self, version: int, timeout_s: float = 60.0) -> None:
        """Load at least `version` before starting a group dispatched at it: otherwise a group sent
        right after a publish could start on the previous weights and be dropped as stale."""
        deadline = time.monotonic() + timeout_s
        while self.policy.version < version and time.monotonic() < deadline:
            await self._refresh()
            if self.policy.version < version:
                await asyncio.sleep(0.1)

    async def _refresh(self) -> None:
        latest = self._latest
        if latest is not None and latest.version > self.policy.version:
            async with self._refresh_lock:
                if latest.version > self.policy.version:
                    t0 = time.perf_counter()
                    try:
                        await self.policy.refresh(latest.version, latest.checkpoint_uri, latest.checkpoint_sha256)
                    except Exception as exc:
                        raise PolicyLoadError(f"loading version {latest.version} failed: {exc!r}") from exc
                    self._loaded(latest, time.perf_counter() - t0)

    def _loaded(self, version: PolicyVersionPublished, load_s: float) -> None:
        """Record how the version came (the ledger's answer to "push or store?"); a policy that does not
        say (vLLM, scripted) loaded it from the store."""
        delivery = getattr(self.policy, "delivered", {}).get(version.version, "store")
        self.producer.publish(
            PolicyVersionLoaded(
                run_id=version.run_id,
                version=version.version,
                checkpoint_sha256=version.checkpoint_sha256,
                delivery=delivery,
                load_s=load_s,
                since_published_s=(datetime.now(UTC) - version.emitted_at).total_seconds(),
            )
        )

    # -- Kafka threads (kafka-python is blocking; the browsers stay on the event loop) -------------
    def _feed(self, loop, jobs: asyncio.Queue, capacity: threading.Semaphore) -> None:
        consumer = EventConsumer(self.settings, self.config.consumer_group, [TASKS], self.producer, client_id="rollout")
        tracker = _OffsetTracker()
        reaped_at = time.monotonic()
        try:
            while not self._stop.is_set():
                if time.monotonic() - reaped_at > 10:  # a peer on this host may have died meanwhile
                    self._reap()
                    reaped_at = time.monotonic()
                while self._done_offsets:
                    tracker.done(*self._done_offsets.pop())
                if tracker.committable:
                    consumer.commit(tracker.take())
                if not capacity.acquire(timeout=0.2):
                    consumer.pause()
                    consumer.poll(timeout_ms=0)
                    continue
                consumer.resume()
                got = consumer.poll(timeout_ms=500, max_records=1)
                if not got:
                    capacity.release()
                    continue
                d = got[0]
                tracker.started(d.topic, d.partition, d.offset)
                if self.config.run_id not in (None, d.event.run_id):  # another run's group: not ours
                    tracker.done(d.topic, d.partition, d.offset)
                    capacity.release()
                    continue
                group = self._group(d)
                if group is None:  # a task this pool does not serve: skip it, loudly
                    log.warning("unknown task %s/%s; skipped", d.event.suite, d.event.task_id)
                    tracker.done(d.topic, d.partition, d.offset)
                    capacity.release()
                    continue
                for _ in range(group.dispatch.group_size):
                    loop.call_soon_threadsafe(jobs.put_nowait, group)
        finally:
            # The groups completed since the last pass: commit them now, or the next pool in this
            # consumer group runs them again (a sync schedule stops its pool after every batch).
            while self._done_offsets:
                tracker.done(*self._done_offsets.pop())
            try:
                if tracker.committable:
                    consumer.commit(tracker.take())
            except Exception as exc:  # the broker is gone: those groups run again, which is safe
                log.warning("could not commit finished groups at shutdown: %s", exc)
            consumer.close()

    def _group(self, d) -> _Group | None:
        dispatch: TaskGroupDispatched = d.event
        task = self._tasks.get((dispatch.suite, dispatch.task_id))
        if task is None:
            return None
        return _Group(dispatch=dispatch, task=task, offset=(d.topic, d.partition, d.offset))

    def _watch_versions(self) -> None:
        """Follow `PolicyVersionPublished` (the run's past first), keeping the newest."""

        def on_event(e) -> None:
            if self._latest is None or e.version > self._latest.version:
                self._latest = e

        follow_run(
            self.settings,
            TRAINER,
            self.config.run_id,
            [PolicyVersionPublished],
            on_event,
            self._stop,
            self.producer,
            client_id="rollout-versions",
        )


async def _first_failure(done: asyncio.Event, runners: list[asyncio.Task]) -> BaseException | None:
    """Wait until `done` is set or a runner ends; the exception of a runner that raised, else None."""
    waiting = asyncio.create_task(done.wait())
    finished, _ = await asyncio.wait([waiting, *runners], return_when=asyncio.FIRST_COMPLETED)
    waiting.cancel()
    failed = [t for t in finished if t is not waiting and not t.cancelled() and t.exception() is not None]
    return failed[0].exception() if failed else None


async def _cancel_all(tasks: list[asyncio.Task]) -> None:
    """Cancel until every task has ended. Once is not always enough on Python 3.11: `asyncio.wait_for`
    may swallow a cancellation that races with its inner task finishing (fixed in 3.12), and the
    worker would then wait for its next job forever (seen under heavy CPU load)."""
    pending = set(tasks)
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=5)


class _OffsetTracker:
    """Commit only the contiguous prefix of finished offsets per partition (groups end out of order)."""

    def __init__(self):
        self.pending: dict[tuple[str, int], set[int]] = defaultdict(set)
        self.finished: dict[tuple[str, int], set[int]] = defaultdict(set)
        self.next: dict[tuple[str, int], int] = {}
        self.committable = False

    def started(self, topic: str, partition: int, offset: int) -> None:
        self.pending[(topic, partition)].add(offset)

    def done(self, topic: str, partition: int, offset: int) -> None:
        self.finished[(topic, partition)].add(offset)
        self.committable = True

    def take(self) -> dict[tuple[str, int], int]:
        out = {}
        for tp, fin in self.finished.items():
            pend = self.pending[tp]
            for o in sorted(fin):
                if not pend or o != min(pend):
                    break
                pend.discard(o), fin.discard(o)
                out[tp] = o + 1
        self.committable = False
        return out
