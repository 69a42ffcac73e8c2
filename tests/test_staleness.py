import threading

import pytest

from trainer.staleness import StalenessBudget, admissible


def test_version_filter():
    # eta = 2 at trainer version 5: tokens from versions >= 3 are admissible
    assert admissible([3, 4, 5], current_version=5, eta=2)
    assert not admissible([2, 5], current_version=5, eta=2)
    assert admissible([5], current_version=5, eta=0) and not admissible([4], current_version=5, eta=0)


def test_capacity_formula_hand_computed():
    b = StalenessBudget(eta=2, groups_per_update=4)
    assert b.capacity() == (2 + 0 + 1) * 4 - 0 == 12
    assert b.try_dispatch(10) and b.capacity() == 2
    assert not b.try_dispatch(3) and b.capacity() == 2  # refused reservations change nothing
    b.version(1)  # (2 + 1 + 1) * 4 - 10 = 6
    assert b.capacity() == 6
    b.version(0)  # versions never go back
    assert b.capacity() == 6


def test_concurrent_reservations_never_exceed_the_budget():
    b = StalenessBudget(eta=1, groups_per_update=8)  # 16 groups
    granted = []

    def grab():
        for _ in range(10):
            if b.try_dispatch():
                granted.append(1)

    threads = [threading.Thread(target=grab) for _ in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert len(granted) == 16 and b.capacity() == 0


def test_bad_arguments():
    with pytest.raises(ValueError):
        StalenessBudget(eta=-1, groups_per_update=1)


def test_rejected_groups_return_their_budget():
    # eta = 0, 2 groups per update: capacity (0 + 0 + 1) * 2 = 2. Both dispatched groups turn out
    # uninformative and are dropped; without giving their budget back the run would stall at v0.
    b = StalenessBudget(eta=0, groups_per_update=2)
    assert b.try_dispatch(2) and not b.try_dispatch()
    b.rejected(2)
    assert b.capacity() == 2 and b.try_dispatch(2)


def test_groups_the_trainer_drops_return_their_budget_through_the_dispatchers_follower(settings):
    """The dispatcher keeps sampling until the trainer has its informative groups: its follower
    (`rollout.dispatcher.follow_trainer`) turns each `GroupDropped` on the broker into `rejected(1)`."""
    import time
    import uuid

    from pipeline.bus import EventProducer
    from rollout.dispatcher import follow_trainer
    from schemas import GroupDropped, PolicyVersionPublished

    run_id = f"budget-{uuid.uuid4().hex[:6]}"
    b = StalenessBudget(eta=0, groups_per_update=2)
    assert b.try_dispatch(2) and b.capacity() == 0  # both groups in flight: the dispatcher pauses
    producer = EventProducer(settings)
    producer.publish_all(
        [
            GroupDropped(
                run_id=run_id,
                group_id=f"g{i}",
                task_id="boxes-red-0",
                reason="uninformative",
                trainer_version=0,
                min_policy_version=0,
                mean_reward=1.0,
            )
            for i in range(2)
        ]
    )
    stop = threading.Event()
    follower = threading.Thread(target=follow_trainer, args=(settings, run_id, b, stop, producer), daemon=True)
    follower.start()
    try:
        deadline = time.monotonic() + 60
        while b.capacity() < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert b.capacity() == 2  # two all-equal groups dropped: two more may be sampled
        producer.publish(
            PolicyVersionPublished(
                run_id=run_id, version=1, checkpoint_uri="s3://x/v1", checkpoint_sha256="0" * 64, parent_version=0
            )
        ).get(timeout=60)
        while b.current_version < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert b.capacity() == (0 + 1 + 1) * 2 - 0
    finally:
        stop.set()
        follower.join(timeout=10)
        producer.close()
