"""The dispatcher's loop outlives a dispatch the broker never acknowledged (as after a broker restart,
`UnknownProducerIdError`): with an outbox the group is on its way and counts as dispatched; without one
it is lost and another is dispatched. The loop had died on it, leaving a live pool with nothing to do
(a chaos soak stalled that way). The failure is injected; the broker and outbox are the real ones."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from kafka.errors import UnknownProducerIdError

import rollout.dispatcher as dispatcher
from pipeline.bus import create_topics
from rollout.dispatcher import task_stream
from rollout.pool import PoolStats
from rollout.run import RolloutRequest
from rollout.suites.boxes.suite import BoxesSuite


def _failing_once(monkeypatch):
    calls = []
    real = dispatcher.dispatch

    def dispatch(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise UnknownProducerIdError("the broker restarted")
        return real(*args, **kwargs)

    monkeypatch.setattr(dispatcher, "dispatch", dispatch)
    return calls


def _loop(settings, groups: int) -> PoolStats:
    stats = PoolStats()
    pool = SimpleNamespace(stats=stats, policy=SimpleNamespace(version=0), request_stop=lambda: None)
    req = RolloutRequest(suite="boxes", workers=2, group_size=2, episodes=2 * groups)
    tasks = task_stream(BoxesSuite().tasks("train"), seed=0)
    finished = threading.Event()
    stats.groups = 10**6  # the pool keeps up: the backlog never holds the loop back
    dispatcher.dispatch_loop(settings, pool, "dispatch-loop", tasks, req, groups, finished, None)
    return stats


def test_with_an_outbox_an_unacknowledged_group_counts_and_the_loop_goes_on(settings, monkeypatch):
    assert settings.outbox_dir is not None
    create_topics(settings)
    calls = _failing_once(monkeypatch)
    stats = _loop(settings, groups=3)
    assert stats.groups_dispatched == 3 and len(calls) == 3  # the failed one is in the outbox


def test_without_an_outbox_an_unacknowledged_group_is_dispatched_again(settings, monkeypatch):
    settings = settings.model_copy(update={"outbox_dir": None})
    create_topics(settings)
    calls = _failing_once(monkeypatch)
    stats = _loop(settings, groups=3)
    assert stats.groups_dispatched == 3 and len(calls) == 4  # one lost, one more sent


def test_an_unexpected_error_stops_the_pool_instead_of_leaving_it_idle(settings, monkeypatch):
    create_topics(settings)
    stopped = []
    monkeypatch.setattr(dispatcher, "dispatch", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("a bug")))
    pool = SimpleNamespace(stats=PoolStats(), policy=SimpleNamespace(version=0), request_stop=lambda: stopped.append(1))
    req = RolloutRequest(suite="boxes", workers=2, group_size=2, episodes=4)
    try:
        dispatcher.dispatch_loop(settings, pool, "dispatch-loop", iter([]), req, 2, threading.Event(), None)
    except RuntimeError:
        pass
    assert stopped == [1]
