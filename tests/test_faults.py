"""The fault matrix against the real local stack: each test breaks one thing mid-run and ends with the
accounting (`faults.account`): events producers had acknowledged vs rows in the ledger.

Faults elsewhere: the ledger writer's SIGKILL (test_ledger.py), a killed browser (test_rollout.py),
the trainer's SIGKILL (test_train_resume.py), a corrupted screenshot (test_faults_trainer.py).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter

import pytest

from pipeline.bus import EventProducer, create_topics
from pipeline.consumer import read_log
from pipeline.ledger import LedgerWriter, read_events
from pipeline.s3 import StoreUnavailable, patiently
from pipeline.store import ScreenshotStore
from pipeline.topics import ROLLOUT
from rollout.dispatcher import dispatch, task_stream
from rollout.episode import EpisodeConfig
from rollout.policy.scripted import OraclePolicy
from rollout.pool import PoolConfig, RolloutPool
from schemas import EpisodeFinished, GroupCompleted, StepRecorded

from faults import Publisher, account, ledger_ids, log_ids


def _publish_through_a_restart(settings, run_id: str, restart):
    """Publish and write the ledger while `restart()` takes the broker down and up again; returns the
    publisher, the writer and the times the broker went down and came back."""
    writer, stop_writer = LedgerWriter(settings), threading.Event()
    writing = threading.Thread(target=writer.sync, kwargs={"follow": True, "stop": stop_writer})
    publisher = Publisher(settings, run_id)
    try:
        writing.start(), publisher.thread.start()
        time.sleep(4)
        down_at = time.monotonic()
        restart()
        back_at = time.monotonic()
        time.sleep(4)
        publisher.finish()
        after = {i for i, t in publisher.acked.items() if t > back_at}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not after <= set(ledger_ids(settings, run_id)):
            time.sleep(0.5)
    finally:
        stop_writer.set()
        writing.join(timeout=30)
    assert not publisher.failed & set(publisher.acked)
    assert after, "producers did not recover after the restart"
    return publisher, writer, down_at


@pytest.mark.skipif(
    not os.environ.get("AWRL_COMPOSE_KAFKA"),
    reason="set AWRL_COMPOSE_KAFKA=1 with `docker compose up` running to test Apache Kafka",
)
def test_compose_kafka_restart_loses_nothing(settings, tmp_path):
    """The same fault against docker compose's Apache Kafka, whose log is on a volume: nothing may be lost."""
    settings = settings.model_copy(update={"kafka_bootstrap": "127.0.0.1:9092", "ledger_uri": str(tmp_path / "l")})
    create_topics(settings)
    run_id = f"restart-{uuid.uuid4().hex[:6]}"
    publisher, _, _ = _publish_through_a_restart(
        settings, run_id, lambda: subprocess.run(["docker", "compose", "restart", "kafka"], check=True, timeout=300)
    )
    row = account("broker (Apache Kafka, compose) restarted mid-run", publisher.acked, settings, run_id)
    assert row.lost == 0 and row.duplicated == 0


def run_pool(settings, suite, groups: int, during=None, workers: int = 2, group_size: int = 2):
    """Dispatch `groups` easy groups, run an oracle pool until they complete; `during(pool)` runs in a
    thread once the first step is recorded."""
    run_id = f"fault-{uuid.uuid4().hex[:6]}"
    producer = EventProducer(settings)
    easy = [t for t in suite.tasks("train") if t.difficulty == "easy"]
    dispatch(producer, run_id, task_stream(easy, seed=2), groups, group_size)
    producer.close()
    pool = RolloutPool(
        settings,
        {suite.name: suite},
        OraclePolicy({suite.name: suite}),
        PoolConfig(workers=workers, run_id=run_id, consumer_group=f"rollout-{run_id}", episode=EpisodeConfig()),
    )
    if during is not None:

        def watch():
            while pool.store.stats.puts + pool.store.stats.dedup_hits == 0:
                time.sleep(0.1)
            during(pool)

        threading.Thread(target=watch, daemon=True).start()
    stats = asyncio.run(pool.run(max_groups=groups))
    return run_id, stats


def run_events(settings, run_id):
    return [e for e in read_log(settings, ROLLOUT) if e.run_id == run_id]


def sync_ledger(settings, tmp_path):
    settings = settings.model_copy(update={"ledger_uri": str(tmp_path / "ledger")})
    LedgerWriter(settings).sync(idle_exit_s=2)
    return settings


@pytest.mark.slow
def test_object_store_down_30s_pauses_rollout_and_no_event_names_a_missing_screenshot(stack, settings, sites, tmp_path):
    outage = {}

    def take_s3_down(pool):
        outage["at"] = time.monotonic()
        stack.restart("s3", downtime_s=30)
        outage["s"] = time.monotonic() - outage["at"]

    run_id, stats = run_pool(settings, sites, groups=2, during=take_s3_down)
    events = run_events(settings, run_id)
    steps = [e for e in events if isinstance(e, StepRecorded)]
    store = ScreenshotStore.from_settings(settings)
    missing = {e.screenshot_sha256 for e in steps if not store.exists(e.screenshot_sha256)}
    finished = [e for e in events if isinstance(e, EpisodeFinished)]
    ledger = sync_ledger(settings, tmp_path)
    row = account(
        "object store down 30 s mid-run",
        log_ids(settings, run_id),
        ledger,
        run_id,
        note=f"pool paused {stats.store_waited_s:.0f} s and resumed; {stats.env_errors} episodes "
        f"failed; {len(steps)} steps, 0 name a missing screenshot",
    )
    assert outage["s"] >= 30 and stats.store_waited_s > 10
    assert not missing
    assert stats.groups == 2 and sum(isinstance(e, GroupCompleted) for e in events) == 2
    assert all(f.outcome != "env_error" for f in finished), "a 30 s outage is waited out, not failed"
    assert row.lost == 0 and row.duplicated == 0


def test_store_gives_up_after_its_patience_with_the_cause(settings):
    """Past its patience a writer fails cleanly, naming the cause (here: nothing listens on the port)."""
    from pipeline.stack.process import free_port

    dead = settings.model_copy(update={"s3_endpoint": f"127.0.0.1:{free_port()}"})
    store = ScreenshotStore.from_settings(dead, patience_s=2)
    with pytest.raises(StoreUnavailable, match="object store unreachable for .* while checking a screenshot"):
        store.put(b"\x89PNG not really")


def _quota(stack, bucket: str, *args: str) -> None:
    conf = stack.data_dir / "ceph" / "ceph.conf"
    subprocess.run(
        ["radosgw-admin", "-c", str(conf), "quota", *args, "--quota-scope=bucket", f"--bucket={bucket}"],
        check=True,
        capture_output=True,
        timeout=60,
    )


@pytest.mark.slow
def test_object_store_full_pauses_with_a_clear_error_then_resumes(stack, settings, sites, tmp_path, caplog):
    """A bucket quota stands in for a full disk: radosgw refuses writes with QuotaExceeded. A bucket of
    its own, so that every screenshot is new (a stored one is never written twice)."""
    bucket = f"full-{uuid.uuid4().hex[:8]}"
    settings = settings.model_copy(update={"s3_bucket": bucket})
    ScreenshotStore.from_settings(settings).ensure_bucket()
    state = {}

    def fill_up(pool):
        _quota(stack, bucket, "set", "--max-size=1")
        _quota(stack, bucket, "enable")
        deadline = time.monotonic() + 120
        while not _said_full(caplog) and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(5)  # paused, not failing: no episode may end meanwhile
        state["episodes"] = pool.stats.episodes
        time.sleep(4)
        state["episodes_later"] = pool.stats.episodes
        _quota(stack, bucket, "disable")  # space freed: the pool must resume by itself

    try:
        with caplog.at_level("WARNING", logger="awrl.store"):
            run_id, stats = run_pool(settings, sites, groups=2, during=fill_up)
    finally:
        _quota(stack, bucket, "disable")
    events = run_events(settings, run_id)
    ledger = sync_ledger(settings, tmp_path)
    row = account(
        "object store full (bucket quota)",
        log_ids(settings, run_id),
        ledger,
        run_id,
        note=f"pool paused {stats.store_waited_s:.0f} s with `object store full` and resumed; "
        f"{stats.env_errors} episodes failed",
    )
    assert _said_full(caplog)
    assert state["episodes"] == state["episodes_later"] and stats.store_waited_s >= 9
    assert stats.groups == 2 and stats.env_errors == 0
    assert sum(isinstance(e, GroupCompleted) for e in events) == 2
    assert row.lost == 0 and row.duplicated == 0


def _said_full(caplog) -> bool:
    return any("object store full" in r.getMessage() and "QuotaExceeded" in r.getMessage() for r in caplog.records)


def test_patiently_passes_real_errors_through(settings):
    store = ScreenshotStore.from_settings(settings.model_copy(update={"s3_bucket": "no-such-bucket-here"}))
    with pytest.raises(Exception) as err:
        patiently(lambda: store.client.put_object(store.bucket, "k", __import__("io").BytesIO(b"x"), 1), "a put", 60)
    assert not isinstance(err.value, StoreUnavailable) and err.value.code == "NoSuchBucket"


def _pool_process(settings, run_id: str, journal, groups: int):
    """`awrl rollout` serving the run's dispatched groups (a pool process as deployed)."""
    env = {**os.environ, **settings.environ(), "AWRL_ROLLOUT_JOURNAL": str(journal)}
    argv = [
        sys.executable,
        "-m",
        "app.cli",
        "rollout",
        "--no-dispatch",
        "--run-id",
        run_id,
        "--workers",
        "1",
        "--group-size",
        "2",
        "--episodes",
        str(2 * groups),
    ]
    return subprocess.Popen(argv, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _open_in_journal(journal) -> dict[str, int]:
    """Trajectories a journal shows started and not ended, with their recorded steps."""
    from rollout.episode_journal import orphans

    return {
        e.trajectory_id: e.num_steps
        for p in journal.rglob("*.jsonl")
        for e in orphans(p)
        if isinstance(e, EpisodeFinished) and "died mid-episode" in e.reason
    }


@pytest.mark.slow
def test_killed_pool_process_its_episodes_end_as_env_error_and_its_group_is_rerun(settings, sites, tmp_path):
    run_id, journal, groups = f"pool-kill-{uuid.uuid4().hex[:6]}", tmp_path / "journal", 3
    producer = EventProducer(settings)
    easy = [t for t in sites.tasks("train") if t.difficulty == "easy" and len(t.oracle) >= 3]
    dispatched = {e.group_id for e in dispatch(producer, run_id, task_stream(easy, seed=3), groups, 2)}
    producer.close()
    first = _pool_process(settings, run_id, journal, groups)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not any(n >= 1 for n in _open_in_journal(journal).values()):
        time.sleep(0.2)
    os.killpg(first.pid, signal.SIGKILL)  # the pool process and its browsers, mid-episode
    first.wait()
    open_at_kill = _open_in_journal(journal)
    assert open_at_kill, "the pool was not mid-episode"

    replacement = _pool_process(settings, run_id, journal, groups)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not dispatched <= _completed(settings, run_id):
        time.sleep(1)
    os.killpg(replacement.pid, signal.SIGKILL)
    replacement.wait()

    events = run_events(settings, run_id)
    closed = {e.trajectory_id: e for e in events if isinstance(e, EpisodeFinished) and e.outcome == "env_error"}
    ledger = sync_ledger(settings, tmp_path)
    row = account(
        "rollout pool process SIGKILLed mid-episode",
        log_ids(settings, run_id),
        ledger,
        run_id,
        note=f"{len(open_at_kill)} open episode(s) ended as env_error by the replacement; "
        f"all {groups} groups completed",
    )
    assert dispatched <= _completed(settings, run_id)
    assert set(open_at_kill) <= set(closed)
    assert all("died mid-episode" in closed[t].reason and closed[t].num_steps == n for t, n in open_at_kill.items())
    assert row.lost == 0 and row.duplicated == 0


def test_a_pool_killed_between_its_journal_and_its_send_loses_no_step_and_duplicates_none(settings, tmp_path):
    """The interleaving the chaos soak met once: a pool killed after it journaled a step and before the
    broker had it (here, stopped there by hand), then two pools reaping its journal (one claims it, a
    copy stands for a reaper that died after sending). Each episode reaches the ledger whole and once,
    its ending counting exactly the steps the ledger holds."""
    from rollout.episode_journal import EpisodeJournal, reap

    from samples import sample_episode

    run_id, directory = f"journal-{uuid.uuid4().hex[:6]}", tmp_path / "journal"
    producer, journal = EventProducer(settings), EpisodeJournal(directory)
    sha = ScreenshotStore.from_settings(settings).put(b"a screenshot the steps name")
    episodes = [sample_episode(run_id, f"{run_id}-g", f"{run_id}-t{i}", 3, sha) for i in range(3)]
    sent = episodes[0] + episodes[1][:2] + episodes[2][:-1]  # t1 stopped before its 2nd step's send, t2 its ending's
    for e in sent:
        journal.record(e), producer.publish(e), journal.sent(e)
    for e in (episodes[1][2], episodes[2][-1]):
        journal.record(e)  # journaled, and the process killed before the send
    producer.publish_all([])
    journal._file.close()
    dead = journal.path.rename(directory / "1-0.00.jsonl")  # pid 1 never started at time 0: not alive
    (directory / "2-0.00.jsonl").write_bytes(dead.read_bytes())  # the journal of a reaper that died after sending
    assert reap(directory, producer.publish_all) == 2 + 2 and not list(directory.iterdir())
    producer.close()

    ledger = sync_ledger(settings, tmp_path)
    finished = {r["trajectory_id"]: r for r in read_events(ledger, run_id, "EpisodeFinished").to_pylist()}
    steps = Counter(r["trajectory_id"] for r in read_events(ledger, run_id, "StepRecorded").to_pylist())
    expected = {e[0].trajectory_id: n for e, n in zip(episodes, (3, 2, 3))}
    assert {t: f["num_steps"] for t, f in finished.items()} == dict(steps) == expected
    assert finished[episodes[1][0].trajectory_id]["outcome"] == "env_error"  # the unsent step ended it
    assert finished[episodes[2][0].trajectory_id]["event_id"] == episodes[2][-1].event_id  # its own ending
    row = account("pool killed between its journal and its send", log_ids(settings, run_id), ledger, run_id)
    assert row.lost == 0 and row.duplicated == 0


def _completed(settings, run_id) -> set[str]:
    return {e.group_id for e in run_events(settings, run_id) if isinstance(e, GroupCompleted)}
