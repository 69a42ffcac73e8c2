import random

import pytest

from trainer.advantages import group_advantages, informative


def test_hand_computed_group():
    # R = [1, 0, 0, 1]: mean 0.5, population std 0.5 -> A = (+-0.5) / (0.5 + 1e-6) ~= +-1
    a = group_advantages([1.0, 0.0, 0.0, 1.0])
    assert a == pytest.approx([0.999998, -0.999998, -0.999998, 0.999998], abs=1e-6)
    # R = [1, 0, 0, 0]: mean 0.25, std sqrt(3/16) = 0.4330127 -> A_0 = 0.75/0.4330137 = 1.7320468
    assert group_advantages([1.0, 0.0, 0.0, 0.0])[0] == pytest.approx(1.7320468, abs=1e-6)


def test_all_equal_group_is_zero_and_flagged():
    assert group_advantages([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]
    assert not informative([0.0, 0.0]) and informative([0.0, 1.0])


def test_matches_a_plain_loop():
    rng = random.Random(0)
    for _ in range(100):
        rewards = [float(rng.random() < 0.4) for _ in range(rng.randint(1, 8))]
        mean = sum(rewards) / len(rewards)
        var = 0.0
        for r in rewards:
            var += (r - mean) ** 2
        std = (var / len(rewards)) ** 0.5
        expected = [(r - mean) / (std + 1e-6) for r in rewards]
        assert group_advantages(rewards) == pytest.approx(expected, abs=1e-12)
