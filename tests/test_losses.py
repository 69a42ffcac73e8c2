"""Losses on tiny hand-picked tensors (arithmetic in comments) and against a plain Python loop."""

from __future__ import annotations

import math
import random

import pytest
import torch

from trainer.losses import (
    GRPOConfig,
    PPOConfig,
    decoupled_ppo_objective,
    grpo_loss,
    kl_to_reference,
    raft_advantages,
    token_weights,
)

L = math.log


def test_staleness_weight_scales_and_caps():
    # ratio 1 everywhere (theta == prox); pi_prox = 0.5 on every token
    # behave 0.5 -> weight 1; behave 0.25 -> weight 2; behave 0.05 -> weight 10 > cap 5: dropped
    prox = torch.tensor([L(0.5)] * 3)
    behave = torch.tensor([L(0.5), L(0.25), L(0.05)])
    adv = torch.tensor([1.0, -1.0, 1.0])
    obj, stats = decoupled_ppo_objective(prox.clone(), prox, behave, adv, torch.ones(3, dtype=torch.bool))
    assert obj.tolist() == pytest.approx([1.0, -2.0, 0.0])  # [1*1, 2*(-1), dropped]
    assert stats["dropped_tokens"] == 1 and stats["behave_weight_max"] == pytest.approx(10.0)
    assert stats["clip_frac"] == 0.0


def test_asymmetric_clip_centred_on_proximal_and_dual_clip():
    prox = torch.tensor([L(0.5)] * 3)
    # r = 1.5 with A = +1: min(1.5, clip(1.5, 0.8, 1.28) = 1.28) = 1.28
    # r = 0.5 with A = -1: min(-0.5, 0.8 * -1 = -0.8) = -0.8; dual clip max(-0.8, 3 * -1) = -0.8
    # r = 4.0 with A = -1: min(-4, -1.28) = -4; dual clip max(-4, -3) = -3
    theta = torch.tensor([L(0.75), L(0.25), L(2.0)], requires_grad=True)
    adv = torch.tensor([1.0, -1.0, -1.0])
    obj, stats = decoupled_ppo_objective(theta, prox, prox, adv, torch.ones(3, dtype=torch.bool))
    assert obj.tolist() == pytest.approx([1.28, -0.8, -3.0])
    # clipped where the clipped branch is the smaller one: tokens 0 and 1 (token 2 is dual-clipped)
    assert stats["clip_frac"] == pytest.approx(2 / 3)
    obj.sum().backward()
    assert theta.grad.tolist() == [0.0, 0.0, 0.0]  # every token sits on a clip: no gradient


def test_gradient_is_ratio_times_advantage_inside_the_clip():
    prox = torch.tensor([L(0.5)])
    theta = torch.tensor([L(0.5)], requires_grad=True)
    behave = torch.tensor([L(0.25)])  # staleness weight 2, no gradient through it
    obj, _ = decoupled_ppo_objective(theta, prox, behave, torch.tensor([0.5]), torch.ones(1, dtype=torch.bool))
    obj.sum().backward()
    assert theta.grad.item() == pytest.approx(2 * 1.0 * 0.5)  # d/dlogp (w * r * A) = w * r * A


def batch_two_trajectories():
    # success: 2 steps of 3 and 5 tokens; failure: 4 steps of 4 tokens; B = 2
    step_tokens = torch.tensor([3] * 3 + [5] * 5 + [4] * 16)
    traj_steps = torch.tensor([2] * 8 + [4] * 16)
    success = torch.tensor([True] * 8 + [False] * 16)
    return step_tokens, traj_steps, success


def test_normalisers_hand_computed_weight_mass():
    step_tokens, traj_steps, success = batch_two_trajectories()
    objective = torch.ones(24)
    # per_trajectory: success 3*(1/2)/(3*2) + 5*(1/2)/(5*2) = 1/4 + 1/4 = 1/2; failure 16*(1/4)/(4*2) = 1/2
    _, s = grpo_loss(objective, step_tokens, traj_steps, success, 2, GRPOConfig(normalizer="per_trajectory"))
    assert (s["weight_mass_success"], s["weight_mass_failure"]) == pytest.approx((0.5, 0.5))
    # constant k=10: success 2 steps * (1/10)/2 = 0.1; failure 4 steps * (1/10)/2 = 0.2 (= |tau_f|/|tau_s| x)
    _, s = grpo_loss(objective, step_tokens, traj_steps, success, 2, GRPOConfig(normalizer="constant"))
    assert (s["weight_mass_success"], s["weight_mass_failure"]) == pytest.approx((0.1, 0.2))
    # token: 8 and 16 tokens of 1/(2*1280)
    _, s = grpo_loss(objective, step_tokens, traj_steps, success, 2, GRPOConfig(normalizer="token"))
    assert (s["weight_mass_success"], s["weight_mass_failure"]) == pytest.approx((8 / 2560, 16 / 2560))


@pytest.mark.parametrize("normalizer", ["per_trajectory", "constant", "token"])
def test_grpo_loss_equals_the_paper_formula_as_a_plain_loop(normalizer):
    rng = random.Random(1)
    cfg = GRPOConfig(normalizer=normalizer)
    trajectories = [[rng.randint(1, 6) for _ in range(rng.randint(1, 5))] for _ in range(6)]  # tokens per step
    values = [[[rng.uniform(-2, 2) for _ in range(n)] for n in steps] for steps in trajectories]
    B = len(trajectories)
    expected = 0.0
    for steps, vals in zip(trajectories, values):
        n_i = {"per_trajectory": 1 / len(steps), "constant": 1 / cfg.k, "token": None}[normalizer]
        for n_tokens, v in zip(steps, vals):
            for x in v:
                expected += x / (B * cfg.token_norm) if n_i is None else n_i * x / n_tokens / B
    objective = torch.tensor([x for vals in values for v in vals for x in v], dtype=torch.float64)
    step_tokens = torch.tensor([n for steps in trajectories for n in steps for _ in range(n)])
    traj_steps = torch.tensor([len(steps) for steps in trajectories for n in steps for _ in range(n)])
    success = torch.zeros(len(objective), dtype=torch.bool)
    loss, _ = grpo_loss(objective, step_tokens, traj_steps, success, B, cfg)
    assert loss.item() == pytest.approx(-expected, rel=1e-9)


def test_raft_learns_only_from_successes():
    step_tokens, traj_steps, success = batch_two_trajectories()
    adv, mask = raft_advantages(success, torch.ones(24, dtype=torch.bool))
    lp = torch.full((24,), L(0.5))
    obj, _ = decoupled_ppo_objective(lp.clone(), lp, lp, adv, mask)
    assert obj[:8].tolist() == [1.0] * 8 and obj[8:].tolist() == [0.0] * 16
    w = token_weights(step_tokens, traj_steps, 2, GRPOConfig(normalizer="per_trajectory"))
    assert w.shape == (24,)


def test_per_trajectory_normaliser_down_weights_a_long_failure_by_its_length_ratio():
    # PAPERS.md: a 5-step success and a 12-step failure, 10 tokens per step, B = 2.
    # 1/|tau|: success tokens weigh (1/5)/(10*2) = 0.01, failure tokens (1/12)/(10*2) = 0.004167
    #   -> each failure token is down-weighted 12/5 = 2.4x relative to a success token.
    # 1/k:     both weigh (1/10)/(10*2) = 0.005 -> ratio 1.
    step_tokens = torch.tensor([10] * 50 + [10] * 120)
    traj_steps = torch.tensor([5] * 50 + [12] * 120)
    per_traj = token_weights(step_tokens, traj_steps, 2, GRPOConfig(normalizer="per_trajectory"))
    constant = token_weights(step_tokens, traj_steps, 2, GRPOConfig(normalizer="constant", k=10))
    assert per_traj[0].item() == pytest.approx(0.01) and per_traj[-1].item() == pytest.approx(1 / 240)
    assert (per_traj[0] / per_traj[-1]).item() == pytest.approx(2.4)
    assert (constant[0] / constant[-1]).item() == pytest.approx(1.0)


def test_decoupled_ppo_is_standard_ppo_when_behave_equals_proximal():
    rng = torch.Generator().manual_seed(0)
    old = -torch.rand(64, generator=rng) * 3  # log pi_old = log pi_behave = log pi_prox
    theta = (old + torch.randn(64, generator=rng) * 0.3).requires_grad_()
    adv = torch.randn(64, generator=rng)
    mask = torch.ones(64, dtype=torch.bool)
    cfg = PPOConfig(eps_low=0.2, eps_high=0.28, dual_clip=3.0, behave_cap=5.0)
    obj, stats = decoupled_ppo_objective(theta, old, old, adv, mask, cfg)
    # standard (dual-clip) PPO with the same asymmetric clip, written out
    r = torch.exp(theta - old)
    ppo = torch.minimum(r * adv, torch.clamp(r, 0.8, 1.28) * adv)
    ppo = torch.where(adv < 0, torch.maximum(ppo, 3.0 * adv), ppo)
    assert torch.allclose(obj, ppo) and stats["behave_weight_mean"] == 1.0 and stats["dropped_tokens"] == 0
    g1 = torch.autograd.grad(obj.sum(), theta, retain_graph=True)[0]
    g2 = torch.autograd.grad(ppo.sum(), theta)[0]
    assert torch.allclose(g1, g2)


def test_kl_to_reference_hand_computed_value_and_gradient():
    # pi_theta = 0.5, pi_ref = 0.25: d = log(0.25 / 0.5) = -log 2; k3 = 0.5 + log 2 - 1 = 0.19315
    # pi_theta = 0.2, pi_ref = 0.4: d = log 2; k3 = 2 - log 2 - 1 = 0.30685
    # pi_theta = pi_ref: k3 = 0, gradient 0
    theta = torch.tensor([L(0.5), L(0.2), L(0.3)], requires_grad=True)
    ref = torch.tensor([L(0.25), L(0.4), L(0.3)])
    kl = kl_to_reference(theta, ref)
    assert kl.tolist() == pytest.approx([0.5 + L(2) - 1, 1 - L(2), 0.0], abs=1e-6)
    kl.sum().backward()
    # d k3 / d log pi_theta = 1 - pi_ref / pi_theta: a loss term pulls each log-prob toward pi_ref's
    assert theta.grad.tolist() == pytest.approx([0.5, -1.0, 0.0], abs=1e-6)


def test_kl_to_reference_is_non_negative_and_never_reaches_through_the_reference():
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(1000, generator=g).requires_grad_()
    ref = torch.randn(1000, generator=g).requires_grad_()
    kl = kl_to_reference(theta, ref)
    assert (kl >= 0).all()
    kl.sum().backward()
    assert ref.grad is None


def test_a_minus_inf_recorded_logprob_is_dropped_without_nan():
    # the sampler recorded -inf for the second token: its staleness weight is inf, so it is dropped;
    # neither the gradient nor the statistics may carry the inf (an event holds finite numbers only)
    logprobs = torch.tensor([L(0.5), L(0.5)], requires_grad=True)
    behave = torch.tensor([L(0.5), float("-inf")])
    obj, stats = decoupled_ppo_objective(
        logprobs, logprobs.detach(), behave, torch.tensor([1.0, 1.0]), torch.ones(2, dtype=torch.bool)
    )
    (-obj.sum()).backward()
    assert obj.tolist() == [1.0, 0.0] and logprobs.grad.tolist() == [-1.0, 0.0]
    assert stats["dropped_tokens"] == 1 and stats["behave_weight_max"] == 1.0 and stats["behave_weight_mean"] == 1.0
