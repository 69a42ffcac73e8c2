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
