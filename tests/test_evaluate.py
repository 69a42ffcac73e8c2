"""Held-out evaluation: the Wilson interval and the paired bootstrap by hand, the oracle solving held-out
Easy tasks, and a paired evaluation on the real stack (both policies on the same instances)."""

from __future__ import annotations

import pytest

from rollout.evaluate import EvalPolicy, evaluate, evaluate_paired, paired_difference, wilson_interval


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


def test_paired_difference_by_hand():
    # identical policies: every resample's difference is 0
    assert paired_difference([1, 0, 2], [2, 2, 2], [1, 0, 2], [2, 2, 2]) == (0.0, 0.0, 0.0)
    # b wins every instance: 1 - 0 in every resample
    assert paired_difference([0, 0, 0], [4, 4, 4], [4, 4, 4], [4, 4, 4]) == (1.0, 1.0, 1.0)
    # per-instance differences (1, 0): a resample draws {1,1}, {1,0}, {0,1} or {0,0} (1/4 each), mean
    # 1, 0.5, 0.5 or 0: the 2.5% quantile is 0 and the 97.5% one 1
    assert paired_difference([0, 0], [1, 1], [1, 0], [1, 1]) == (0.5, 0.0, 1.0)
    # differences (1, 1, 1, 0): the resampled mean is Binomial(4, 3/4) / 4, P(0) = 1/256 = 0.004 and
    # P(<= 1/4) = 13/256 = 0.051 straddle 0.025, P(1) = 81/256 > 0.025: the interval is (0.25, 1)
    assert paired_difference([0, 0, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]) == (0.75, 0.25, 1.0)
    # rates are ratios of sums, so one greedy episode an instance pairs with four sampled ones: instance
    # rates (1, 0) under both, every resample's difference is 0
    assert paired_difference([1, 0], [1, 1], [4, 0], [4, 4]) == (0.0, 0.0, 0.0)
    # the seed is fixed: the same counts, the same interval
    args = ([0, 1, 2, 1], [3, 3, 3, 3], [2, 1, 3, 0], [3, 3, 3, 3])
    assert paired_difference(*args) == paired_difference(*args)
    with pytest.raises(ValueError, match="one entry per instance"):
        paired_difference([1], [1], [1, 0], [1, 1])


def test_paired_evaluation_runs_every_policy_on_the_same_instances(settings):
    """The untrained model (whose output is never an action) against the oracle, on 4 boxes instances
    (no browser) x 2 episodes: the same instances for both, in the counts and in the ledger."""
    from model.hf_io import ensure_policy
    from pipeline.ledger import read_events

    policies = [EvalPolicy("untrained", ensure_policy(), 1.0), EvalPolicy("oracle", policy="oracle")]
    paired = evaluate_paired(
        settings,
        policies,
        suite="boxes",
        split="test",
        difficulty=None,
        instances=4,
        samples=2,
        workers=4,
        show_progress=False,
    )
    assert len(paired.task_ids) == len(set(paired.task_ids)) == 4
    for p in paired.policies:
        assert p.task_ids == paired.task_ids and p.episodes == (2, 2, 2, 2), p
        ran = read_events(settings, p.run_id, "EpisodeFinished", ["task_id"]).column("task_id").to_pylist()
        assert sorted(ran) == sorted(paired.task_ids * 2)  # the ledger's instances, each twice
        assert sum(p.successes) <= sum(p.episodes) == p.total.episodes == 8
    untrained, oracle = paired.policies
    # a boxes episode is one step (an env error, e.g. a step timeout on a loaded machine, has none)
    assert 0 < untrained.steps <= 8 and untrained.invalid_share == 1.0 and untrained.successes == (0, 0, 0, 0)
    assert oracle.steps == 8 and oracle.invalid_share == 0.0 and oracle.successes == (2, 2, 2, 2)
    assert oracle.env_errors == 0
    (d,) = paired.differences()
    assert (d.minuend, d.subtrahend, d.diff, d.ci95, d.instances) == ("oracle", "untrained", 1.0, (1.0, 1.0), 4)


def test_the_learning_loop_pairs_its_points_and_beats_the_best_sharpening_baseline():
    from app.evaluation import eval_design, rl_gains
    from app.learning import LearningConfig
    from rollout.evaluate import InstanceCounts

    # sites heldout Easy has 18 tasks: 100 episodes at 4 an instance would need 25, so every task runs
    # ceil(100 / 18) = 6 times; MiniWoB++'s test split has 136: 64 / 4 = 16 instances of 4
    ids, samples = eval_design(LearningConfig())
    assert (len(ids), samples) == (18, 6) and len(set(ids)) == 18
    ids, samples = eval_design(LearningConfig(suite="miniwob", eval_episodes=64))
    assert (len(ids), samples) == (16, 4) and eval_design(LearningConfig(suite="miniwob", eval_episodes=64))[0] == ids

    def stage(label, successes, samples=2, temperature=1.0):
        return InstanceCounts(label, f"r-eval-{label}", temperature, ("a", "b"), successes, (samples, samples), 10, 0)

    rl, sft = stage("rl", (2, 1)), stage("sft", (1, 0))
    assert [str(d) for d in rl_gains({"rl": rl, "sft": sft}, ())] == [
        "rl - sft: +0.500 (95% CI +0.500 to +0.500, paired bootstrap over 2 instances)"
    ]
    # greedy SFT solves instance a (1 of 1), so it beats SFT at T=1: RL is compared with it too
    greedy, tepid = stage("sft-t0", (1, 0), 1, 0.0), stage("sft-t0.5", (0, 0), 2, 0.5)
    gains = rl_gains({"rl": rl, "sft": sft, "sft-t0": greedy, "sft-t0.5": tepid}, (0.0, 0.5))
    assert [(d.minuend, d.subtrahend, d.diff) for d in gains] == [("rl", "sft", 0.5), ("rl", "sft-t0", 0.25)]
    assert rl_gains({"sft": sft}, (0.0,)) == [] and rl_gains({"rl": rl, "sft": sft, "sft-t0": sft}, (0.0,)) == [
        rl.minus(sft)
    ]
