"""`awrl train` against a live rollout on the real stack: torchrun with 2 gloo processes trains 5
updates, publishes versions (checkpoints in S3) that the running pool loads, and every update reaches
the ledger. Then a forced slow trainer, side by side: without dispatch admission the staleness filter
drops groups; with it the dispatcher pauses instead."""

from __future__ import annotations

import faulthandler
import os
import threading
import uuid

import pytest

from pipeline.bus import EventProducer, create_topics
from pipeline.checkpoints import CheckpointStore
from pipeline.consumer import EventConsumer, read_log
from pipeline.stack.process import free_port
from pipeline.topics import ROLLOUT, TRAINER
from rollout.episode import EpisodeConfig
from rollout.run import RolloutRequest, run_rollout
from schemas import GroupDropped, PolicyVersionPublished, StepRecorded, UpdateApplied
from trainer.config import TrainConfig
from trainer.launch import launch
from trainer.staleness import StalenessBudget

from samples import stored_sha256

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def _train_beside_a_live_rollout(settings, config: TrainConfig, eta: int | None, nproc: int = 1, noise: float = 0.5):
    """Run the demo-policy pool (noisy oracle: groups with mixed rewards) while the trainer trains."""
    request = RolloutRequest(
        suite="sites",
        policy="demo",
        noise=noise,
        workers=2,
        group_size=2,
        episodes=None,
        difficulty="easy",
        run_id=config.run_id,
        seed=3,
        episode=EpisodeConfig(som=True),
        push_address=config.push_address,
    )
    budget = None if eta is None else StalenessBudget(eta, config.groups_per_update)
    stop, result = threading.Event(), {}
    pool = threading.Thread(
        target=lambda: result.update(stats=run_rollout(settings, request, False, stop, admission=budget))
    )
    pool.start()
    try:
        code = launch(config, nproc=nproc, env={**os.environ, **settings.environ()})
    finally:
        stop.set()
        pool.join(timeout=120)
        if pool.is_alive():  # say where it hangs
            faulthandler.dump_traceback(all_threads=True)
    assert code == 0 and not pool.is_alive()
    events = [e for e in read_log(settings, TRAINER) if e.run_id == config.run_id]
    return result["stats"], events


def test_torchrun_trains_a_live_run_and_the_pool_picks_up_versions(settings, tmp_path):
    run_id = f"train-{uuid.uuid4().hex[:6]}"
    config = TrainConfig(
        run_id=run_id,
        groups_per_update=1,
        eta=2,
        max_updates=3,
        batch_timeout_s=600,
        push_address=f"127.0.0.1:{free_port()}",
    )
    stats, events = _train_beside_a_live_rollout(settings, config, eta=2, nproc=2)

    updates = [e for e in events if isinstance(e, UpdateApplied)]
    versions = sorted((e for e in events if isinstance(e, PolicyVersionPublished)), key=lambda e: e.version)
    assert [u.update_step for u in updates] == list(range(3))
    assert all(u.world_size == 2 and len(u.group_ids) == 1 and u.stats["tokens"] > 0 for u in updates)
    assert [v.version for v in versions] == list(range(4))
    # lineage: each version names its parent and the update that produced it, with the same weights hash
    for v, u in zip(versions[1:], updates):
        assert v.parent_version == v.version - 1 and v.update_ids == [u.event_id]
        assert v.checkpoint_sha256 == stored_sha256(settings, v)
    store = CheckpointStore.from_settings(settings)
    assert all(store.exists(run_id, v.version) for v in versions)
    # a group is trained at most once, and only groups with mixed rewards are trained
    trained = [g for u in updates for g in u.group_ids]
    assert len(trained) == len(set(trained))
    assert all(e.reason == "uninformative" for e in events if isinstance(e, GroupDropped))

    # the running pool loaded new versions between steps
    producer = EventProducer(settings)
    consumer = EventConsumer(settings, f"check-{uuid.uuid4().hex[:6]}", [ROLLOUT], producer)
    seen = []
    for _ in range(20):
        seen += [
            d.event.policy_version
            for d in consumer.poll(timeout_ms=500)
            if isinstance(d.event, StepRecorded) and d.event.run_id == run_id
        ]
    consumer.close(), producer.close()
    assert max(seen) >= 1 and stats.episodes > 0

    # every update and version is in the ledger, queryable with SQL
    from analysis.views import connect
    from pipeline.ledger import LedgerWriter

    ledger = settings.model_copy(update={"ledger_uri": str(tmp_path / "ledger")})
    LedgerWriter(ledger).sync(idle_exit_s=3)
    con = connect(ledger.ledger_uri)
    assert con.sql(f"select count(*) from updates where run_id = '{run_id}'").fetchall()[0][0] == 3
    assert con.sql(f"select max(version) from policy_versions where run_id = '{run_id}'").fetchall()[0][0] == 3
    # the pool loaded versions pushed straight from the trainer, each the digest its event named
    loaded = con.sql(
        "select l.version, l.delivery, l.checkpoint_sha256 = p.checkpoint_sha256 "
        "from policy_version_loaded l "
        f"join policy_version_published p using (run_id, version) where run_id = '{run_id}'"
    ).fetchall()
    assert all(same for *_, same in loaded) and [d for _, d, _ in loaded].count("push") >= 2, loaded
    assert all(v.push_s is not None for v in versions[1:])


def test_a_slow_trainer_drops_stale_groups_unless_the_dispatcher_pauses(settings):
    def run(eta_dispatch: int | None):
        # topics of its own: the first run's undone task groups must not be served by the second's pool
        own = settings.model_copy(update={"topic_prefix": f"{settings.topic_prefix}-{uuid.uuid4().hex[:4]}"})
        create_topics(own)
        config = TrainConfig(
            run_id=f"slow-{uuid.uuid4().hex[:6]}",
            groups_per_update=1,
            eta=0,
            max_updates=2,
            slow_s=6.0,
            batch_timeout_s=600,
            dynamic_sampling=False,
        )
        stats, events = _train_beside_a_live_rollout(own, config, eta=eta_dispatch, noise=0.3)
        stale = sum(isinstance(e, GroupDropped) and e.reason == "stale" for e in events)
        return stats, stale

    free_stats, free_stale = run(None)
    held_stats, held_stale = run(0)
    print(
        f"\nno admission: {free_stale} stale groups dropped, dispatch paused {free_stats.dispatch_paused_s:.0f}s"
        f"\nadmission eta=0: {held_stale} stale groups dropped, dispatch paused {held_stats.dispatch_paused_s:.0f}s"
    )
    assert free_stale > 0 and free_stats.dispatch_paused_s == 0
    assert held_stats.dispatch_paused_s > 0 and held_stale == 0
