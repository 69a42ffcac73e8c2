"""The everlasting pool against real browsers, our own sites and the real local stack."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path

import pytest

from pipeline.bus import EventProducer
from pipeline.consumer import EventConsumer
from pipeline.ledger import LedgerWriter
from pipeline.store import ScreenshotStore
from pipeline.topics import ROLLOUT
from rollout.dispatcher import dispatch, task_stream
from rollout.episode import EpisodeConfig, PolicyLoadError
from rollout.policy.scripted import OraclePolicy
from rollout.pool import PoolConfig, RolloutPool
from schemas import EpisodeFinished, EpisodeStarted, GroupCompleted, PolicyVersionPublished, StepRecorded
from schemas.observation import PolicyOutput

from faults import account, log_ids


def run_pool(
    settings,
    suite,
    policy,
    groups: int,
    workers: int,
    group_size: int = 4,
    som: bool = False,
    tasks=None,
    episode: EpisodeConfig | None = None,
):
    run_id = f"test-{uuid.uuid4().hex[:6]}"
    producer = EventProducer(settings)
    stream = task_stream(tasks or suite.tasks("train"), seed=1)
    dispatch(producer, run_id, stream, groups, group_size)
    producer.close()
    pool = RolloutPool(
        settings, {suite.name: suite}, policy, PoolConfig(workers=workers, episode=episode or EpisodeConfig(som=som))
    )
    stats = asyncio.run(pool.run(max_groups=groups))
    return run_id, stats, read_back(settings, groups)


def read_back(settings, groups: int):
    producer = EventProducer(settings)
    consumer = EventConsumer(settings, f"check-{uuid.uuid4().hex[:6]}", [ROLLOUT], producer)
    events, deadline = [], time.monotonic() + 60
    while sum(isinstance(d.event, GroupCompleted) for d in events) < groups and time.monotonic() < deadline:
        events += consumer.poll(timeout_ms=500)
    consumer.close(), producer.close()
    return events


def by_trajectory(delivered):
    out = defaultdict(list)
    for d in sorted(delivered, key=lambda d: (d.partition, d.offset)):
        if hasattr(d.event, "trajectory_id"):
            out[d.event.trajectory_id].append(d.event)
    return out


def test_oracle_pool_on_our_sites(settings, sites):
    easy = [t for t in sites.tasks("train") if t.difficulty != "hard"]
    run_id, stats, delivered = run_pool(
        settings, sites, OraclePolicy({"sites": sites}), groups=4, workers=4, tasks=easy
    )
    assert stats.episodes == 16 and stats.env_errors == 0
    assert stats.successes / stats.episodes >= 0.95

    trajectories = by_trajectory(delivered)
    assert len(trajectories) == 16
    hashes = []
    for events in trajectories.values():
        assert isinstance(events[0], EpisodeStarted) and isinstance(events[-1], EpisodeFinished)
        steps = [e for e in events if isinstance(e, StepRecorded)]
        assert [s.step for s in steps] == list(range(len(steps))) == list(range(events[-1].num_steps))
        hashes += [s.screenshot_sha256 for s in steps]
    # a group's steps all precede its GroupCompleted on the partition
    for d in delivered:
        if isinstance(d.event, GroupCompleted):
            assert d.event.outcomes.count("success") == sum(r == 1.0 for r in d.event.rewards)
            earlier = {
                x.event.trajectory_id
                for x in delivered
                if x.partition == d.partition and x.offset < d.offset and isinstance(x.event, EpisodeFinished)
            }
            assert set(d.event.trajectory_ids) <= earlier
    store = ScreenshotStore.from_settings(settings)
    assert all(store.exists(h) for h in set(hashes))
    assert len(set(hashes)) < len(hashes), "identical pages (same task in a group) are stored once"


class KillBrowserOnce:
    """The oracle, but on its 3rd call it SIGKILLs one running browser of the pool."""

    name = "oracle"

    def __init__(self, oracle):
        self.oracle, self.version, self.calls, self.killed = oracle, 0, 0, None

    async def act(self, obs):
        self.calls += 1
        if self.calls == 3:
            self.killed = _kill_one_browser()
        return await self.oracle.act(obs)

    async def refresh(self, version, uri, checkpoint_sha256=None):
        self.version = version


def _ours(pid: int) -> bool:
    """Whether `pid` descends from this test process (other runs' browsers may be alive too)."""
    while pid > 1:
        if pid == os.getpid():
            return True
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return False
    return False


def _kill_one_browser() -> int:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            any(a.startswith(b"--awrl-browser=") for a in args)
            and not any(a.startswith(b"--type=") for a in args)
            and _ours(int(pid))
        ):
            os.kill(int(pid), signal.SIGKILL)
            return int(pid)
    raise AssertionError("no browser to kill")


def test_killed_browser_ends_episode_as_env_error_and_worker_goes_on(settings, sites, tmp_path):
    easy = [t for t in sites.tasks("train") if t.difficulty == "easy"]
    policy = KillBrowserOnce(OraclePolicy({"sites": sites}))
    run_id, stats, delivered = run_pool(settings, sites, policy, groups=2, workers=1, group_size=2, tasks=easy)
    finished = [d.event for d in delivered if isinstance(d.event, EpisodeFinished)]
    assert policy.killed and stats.episodes == 4
    errors = [f for f in finished if f.outcome == "env_error"]
    assert len(errors) == 1 and errors[0].reason
    assert sum(f.outcome == "success" for f in finished) == 3, "the same worker ran the later episodes"
    ledger = settings.model_copy(update={"ledger_uri": str(tmp_path / "ledger")})
    LedgerWriter(ledger).sync(idle_exit_s=2)
    row = account(
        "browser SIGKILLed mid-episode",
        log_ids(settings, run_id),
        ledger,
        run_id,
        note="that episode ended as env_error; the worker relaunched its browser and went on",
    )
    assert row.lost == 0 and row.duplicated == 0


class Garbage:
    name, version = "garbage", 0

    async def act(self, obs):
        return PolicyOutput("I think I should click somewhere nice {", [], [], [], [])

    async def refresh(self, version, uri, checkpoint_sha256=None):
        pass


@pytest.mark.parametrize("streak", [None, 3])
def test_garbage_output_becomes_invalid_action_steps(settings, sites, streak):
    easy = [t for t in sites.tasks("train") if t.difficulty == "easy" and t.horizon > 3][:1]
    _, stats, delivered = run_pool(
        settings,
        sites,
        Garbage(),
        groups=1,
        workers=1,
        group_size=1,
        tasks=easy,
        episode=EpisodeConfig(max_invalid_streak=streak),
    )
    steps = [d.event for d in delivered if isinstance(d.event, StepRecorded)]
    assert len(steps) == (streak or easy[0].horizon) and stats.env_errors == 0
    assert all(s.action.kind == "invalid" and s.env_feedback.startswith("invalid action") for s in steps)
    assert all(s.error_class == "invalid_action" for s in steps)
    (finished,) = [d.event for d in delivered if isinstance(d.event, EpisodeFinished)]
    assert finished.outcome == "failure" and finished.num_steps == len(steps)
    assert finished.reason == (
        "3 invalid actions in a row" if streak else f"horizon of {easy[0].horizon} steps reached"
    )


@contextlib.contextmanager
def version_1_after_the_first_step(settings):
    """Publishes policy version 1 as soon as the first step is in the log (the trainer's first update)."""
    publisher = EventProducer(settings)
    consumer = EventConsumer(settings, f"watch-{uuid.uuid4().hex[:6]}", [ROLLOUT], publisher)

    def publish_after_first_step():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if any(isinstance(d.event, StepRecorded) for d in consumer.poll(timeout_ms=200)):
                publisher.publish_all(
                    [
                        PolicyVersionPublished(
                            run_id="r", version=1, checkpoint_uri="mem://1", checkpoint_sha256="0" * 64
                        )
                    ]
                )
                return

    t = threading.Thread(target=publish_after_first_step)
    t.start()
    try:
        yield
    finally:
        t.join(), consumer.close(), publisher.close()


def test_new_policy_version_is_picked_up_between_steps(settings, sites):
    multi = [t for t in sites.tasks("train") if len(t.oracle) >= 4]
    with version_1_after_the_first_step(settings):
        _, stats, delivered = run_pool(
            settings, sites, OraclePolicy({"sites": sites}), groups=2, workers=2, group_size=2, tasks=multi
        )
    versions = {
        tid: [e.policy_version for e in evs if isinstance(e, StepRecorded)]
        for tid, evs in by_trajectory(delivered).items()
    }
    assert any(v[0] == 0 and v[-1] == 1 for v in versions.values()), versions
    assert all(v == sorted(v) for v in versions.values())
    completed = [d.event for d in delivered if isinstance(d.event, GroupCompleted)]
    assert max(c.max_policy_version for c in completed) == 1


class _UnwritableCache(OraclePolicy):
    """Loading a version fails as it did in the compose image, whose checkpoint cache the pool's user
    could not write."""

    async def refresh(self, version: int, checkpoint_uri: str, checkpoint_sha256: str | None = None) -> None:
        raise PermissionError(13, "Permission denied", "/cache/awrl")


@pytest.mark.timeout(300)  # the fault was a pool that never returned
def test_a_worker_that_fails_fails_the_pool(settings, sites):
    """A version the pool cannot load ends its run with that error (a service crash, which a restart
    policy answers): not an episode's `env_error` that kills a healthy browser, nor a pool whose workers
    are gone while its heartbeat says it is alive."""
    multi = [t for t in sites.tasks("train") if len(t.oracle) >= 4]
    with version_1_after_the_first_step(settings), pytest.raises(PolicyLoadError, match="Permission denied"):
        run_pool(settings, sites, _UnwritableCache({"sites": sites}), groups=2, workers=2, group_size=2, tasks=multi)


def stack_env(settings) -> dict:
    return {**os.environ, **settings.environ()}


def test_rollout_cli_smoke(settings):
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "app.cli",
            "rollout",
            "--suite",
            "miniwob",
            "--policy",
            "oracle",
            "--workers",
            "2",
            "--group-size",
            "2",
            "--episodes",
            "4",
            "--episode.som",
            "--format",
            "json",
        ],
        env=stack_env(settings),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert json.loads(out.stdout)["episodes"] == 4


def test_local_tiny_vlm_runs_whole_episodes_with_logprobs(settings, sites, tmp_path):
    from model.hf_io import ensure_policy
    from rollout.policy.local import LocalPolicy

    policy = LocalPolicy(ensure_policy(tmp_path / "tiny-vlm"), max_new_tokens=24, num_threads=1)
    easy = [t for t in sites.tasks("train") if t.difficulty == "easy"][:1]
    _, stats, delivered = run_pool(settings, sites, policy, groups=1, workers=2, group_size=2, som=True, tasks=easy)
    steps = [d.event for d in delivered if isinstance(d.event, StepRecorded)]
    assert stats.episodes == 2 and stats.env_errors == 0 and steps
    for s in steps:
        assert s.prompt_token_ids and s.response_token_ids
        assert len(s.behave_logprobs) == len(s.response_token_ids) == len(s.token_policy_versions)
        assert all(lp <= 0.0 for lp in s.behave_logprobs)
        assert s.prompt_screenshot_sha256 == [s.screenshot_sha256]


def test_a_pool_that_stops_commits_its_last_group(settings):
    """Pools that follow one another in a consumer group (the sync schedule's, one per batch) each
    take new groups: the one a pool finished last is committed as it stops, not run again."""
    from rollout.suites.boxes import BoxesSuite

    suite = BoxesSuite()
    suite.start()
    run_id = f"test-{uuid.uuid4().hex[:6]}"
    producer = EventProducer(settings)
    dispatch(producer, run_id, task_stream(suite.tasks("train"), seed=1), 3, 2)
    producer.close()
    finished = 0
    while finished < 3:  # each pool completes one group, or two when both finish as it stops
        pool = RolloutPool(
            settings,
            {"boxes": suite},
            OraclePolicy({"boxes": suite}),
            PoolConfig(workers=2, run_id=run_id, consumer_group=f"rollout-{run_id}", journal_dir=None),
        )
        finished += asyncio.run(pool.run(max_groups=1)).groups
    suite.stop()
    completed = [d.event.group_id for d in read_back(settings, 3) if isinstance(d.event, GroupCompleted)]
    assert len(completed) == 3 == len(set(completed)), completed
