"""Held-out evaluation: the Wilson interval by hand, and the oracle solving held-out Easy tasks."""

from __future__ import annotations

import pytest

from rollout.evaluate import evaluate, wilson_interval


def test_wilson_interval_hand_computed():
    # 8/10, z = 1.96: centre (0.8 + 3.8416/20) / 1.38416 = 0.71676,
    # half 1.96 * sqrt(0.016 + 3.8416/400) / 1.38416 = 0.22658 -> (0.4902, 0.9433)
    lo, hi = wilson_interval(8, 10)
    assert (lo, hi) == pytest.approx((0.4902, 0.9433), abs=1e-4)
    assert wilson_interval(0, 100)[0] == 0.0 and wilson_interval(0, 100)[1] == pytest.approx(0.0370, abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_oracle_solves_held_out_easy_tasks(settings):
    result = evaluate(settings, policy="oracle", episodes=4, workers=2, show_progress=False)
    assert result.episodes == 4 and result.successes == 4
    assert str(result).startswith("success 1.000 (95% CI 0.5")
