"""The trainer without a broker: group assembly and commit positions, the update maths on real
samples from the tiny VLM (log-probs equal the sampler's, proximal pass), and the FSDP2 trainer under
torchrun (1 and 2 gloo ranks, uneven shards) against the 1-process update and replay's emulation."""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model.hf_io import save_policy
from model.inputs import suppressed_token_ids
from model.prompt import render_prompt
from pipeline.hashing import sha256_hex, weights_sha256
from rollout.policy.local import LocalPolicy
from schemas import GroupCompleted
from schemas.observation import Mark, Observation
from trainer.batch import GroupAssembler, TrainGroup
from trainer.config import TrainConfig
from trainer.emulated_fsdp import EmulatedFSDP
from trainer.update import (
    Scorer,
    accumulate_gradients,
    combine,
    flatten,
    interleave,
    optimizer_step,
    response_logprobs,
    shard,
    update_stats,
)

from samples import render_page, sample_group, sample_step

SHA = "ab" * 32


# --- group assembly -------------------------------------------------------------------------------


def test_assembler_groups_steps_and_holds_commits_until_released():
    asm = GroupAssembler("run")
    events = list(sample_group("run", "g0", [SHA], group_size=3, steps=4, seed=2))
    other = list(sample_group("other-run", "g9", [SHA], group_size=2, steps=2, seed=3))
    got = []
    for offset, e in enumerate(other + events):
        got += [g for g in [asm.add(e, ("rollout", 0), offset)] if g is not None]
    assert len(got) == 1  # the other run's group is not ours
    g = got[0]
    done: GroupCompleted = events[-1]
    assert [len(t) for t in g.trajectories] == done.num_steps
    assert all([s.step for s in t] == list(range(len(t))) for t in g.trajectories)
    # the group's first event sits right after the other run's events: commits stop there until released
    assert asm.committable() == {("rollout", 0): len(other)}
    asm.release("g0")
    assert asm.committable() == {("rollout", 0): len(other) + len(events)}


def test_a_rerun_group_keeps_only_the_trajectories_it_completed():
    asm = GroupAssembler("run")
    crashed = [
        e for e in sample_group("run", "g0", [SHA], group_size=2, steps=3, seed=5) if e.event_type == "StepRecorded"
    ]  # a pool died before completing the group
    rerun = list(sample_group("run", "g0", [SHA], group_size=2, steps=3, seed=6))
    rerun = [
        e.model_copy(update={"trajectory_id": "re-" + e.trajectory_id}) if hasattr(e, "trajectory_id") else e
        for e in rerun[:-1]
    ] + [rerun[-1].model_copy(update={"trajectory_ids": ["re-" + t for t in rerun[-1].trajectory_ids]})]
    group = [asm.add(e, ("rollout", 1), i) for i, e in enumerate(crashed + rerun)][-1]
    assert all(s.trajectory_id.startswith("re-") for t in group.trajectories for s in t)
    assert [len(t) for t in group.trajectories] == group.completed.num_steps


# --- the update maths on real samples ---------------------------------------------------------------


@functools.cache
def _policy() -> LocalPolicy:
    return LocalPolicy(max_new_tokens=12, seed=1)


def _obs(seed: int) -> Observation:
    png = render_page(f"page {seed}", seed=seed, size=(320, 240))
    marks = [Mark(1, "button", "Add to cart", 20, 20, 80, 20)]
    return Observation(
        instruction=f"task {seed}",
        screenshots=[png],
        screenshot_sha256=[sha256_hex(png)],
        url="http://127.0.0.1/",
        feedback="",
        history=[],
        memory={},
        marks=marks,
        som=True,
        step=0,
        horizon=10,
        viewport=(320, 240),
    )


@functools.cache
def _batch() -> tuple[list[TrainGroup], dict[str, bytes]]:
    """Two groups of two trajectories (rewards 1, 0) of 1-2 sampled steps each, and their screenshots."""
    policy, images, groups = _policy(), {}, []
    for gi in range(2):
        trajectories = []
        for ti in range(2):
            steps = []
            for si in range(1 + ti):
                obs = _obs(10 * gi + 3 * ti + si)
                images[obs.screenshot_sha256[0]] = obs.screenshots[0]
                out = policy.generate(*render_prompt(obs))
                steps.append(
                    sample_step("run", f"g{gi}", f"g{gi}t{ti}", si, obs.screenshot_sha256[0]).model_copy(
                        update={
                            "prompt_token_ids": out.prompt_token_ids,
                            "response_token_ids": out.response_token_ids,
                            "behave_logprobs": out.logprobs,
                            "token_policy_versions": out.token_policy_versions,
                        }
                    )
                )
            trajectories.append(steps)
        done = GroupCompleted(
            run_id="run",
            group_id=f"g{gi}",
            task_id="t",
            trajectory_ids=[f"g{gi}t0", f"g{gi}t1"],
            rewards=[1.0, 0.0],
            num_steps=[1, 2],
            outcomes=["success", "failure"],
            min_policy_version=0,
            max_policy_version=0,
        )
        groups.append(TrainGroup(done, trajectories, [1.0, -1.0], {}))
    return groups, images


def _scorer(model) -> Scorer:
    p = _policy()
    _, images = _batch()
    return Scorer(model, p.tokenizer, p.image_processor, suppressed_token_ids(p.tokenizer), images.__getitem__)


def _fresh_model():
    import copy

    return copy.deepcopy(_policy().model).train()


def test_trainer_log_probs_equal_the_samplers_and_the_proximal_pass():
    batch, _ = _batch()
    samples, trajectories = flatten(batch)
    assert trajectories == 4 and len(samples) == 6
    scorer = _scorer(_fresh_model())
    config = TrainConfig(run_id="run")
    _, tokens = combine(accumulate_gradients(scorer, samples, trajectories, 0, config))
    # rebuilt from recorded ids and screenshot hashes: the sampler's log-probs to float rounding
    assert (tokens["logprobs"] - tokens["behave"]).abs().max() < 1e-4
    stats = update_stats(tokens, config)
    assert stats["behave_weight_mean"] == pytest.approx(1.0, abs=1e-4) and stats["dropped_tokens"] == 0
    # every token fresh (sampled by version 0, scored at 0): the sampler-vs-trainer mismatch is rounding
    assert stats["mismatch_tokens"] == tokens["logprobs"].numel() and stats["mismatch_stale_tokens"] == 0
    assert stats["mismatch_nonfinite"] == 0 and 0 <= stats["mismatch_k3"] < 1e-8 and stats["mismatch_ratio_tail"] == 0
    assert 1 - 1e-4 < stats["mismatch_ratio_min"] <= stats["mismatch_ratio_max"] < 1 + 1e-4
    # the proximal log-probs of a separate no-grad pass equal this forward's detached values, bit for bit
    assert torch.equal(torch.cat(response_logprobs(scorer, samples, 1.0)), tokens["logprobs"])


def test_kl_penalty_to_an_identical_reference_changes_nothing_and_to_another_pulls_back(tmp_path):
    batch, _ = _batch()
    samples, trajectories = flatten(batch)
    grads = {}
    for name, kl_coef in (("plain", 0.0), ("same", 1.0)):
        model = _fresh_model()
        scorer = _scorer(model)
        config = TrainConfig(run_id="run", kl_coef=kl_coef)
        reference = response_logprobs(scorer, samples, 1.0)  # pi_ref == pi_theta: k3 and its gradient are 0
        _, tokens = combine(accumulate_gradients(scorer, samples, trajectories, 0, config, reference=reference))
        grads[name] = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        assert update_stats(tokens, config)["kl_ref"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(grads["plain"], grads["same"]))
    with pytest.raises(ValueError, match="kl_coef > 0 needs"):
        accumulate_gradients(_scorer(_fresh_model()), samples, trajectories, 0, TrainConfig(run_id="r", kl_coef=1.0))
    # a reference loaded from another model's directory (`Scorer.frozen`): KL > 0, frozen weights
    other = _fresh_model()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.01 * torch.randn_like(p))
    save_policy(other, _policy().tokenizer, tmp_path / "ref", image_processor=_policy().image_processor)
    scorer = _scorer(_fresh_model())
    frozen = scorer.frozen(tmp_path / "ref")
    assert not any(p.requires_grad for p in frozen.model.parameters())
    config = TrainConfig(run_id="run", kl_coef=1.0)
    _, tokens = combine(
        accumulate_gradients(
            scorer, samples, trajectories, 0, config, reference=response_logprobs(frozen, samples, 1.0)
        )
    )
    assert update_stats(tokens, config)["kl_ref"] > 0


def test_shards_are_padded_to_equal_counts_and_interleave_back_to_the_one_process_order():
    batch, _ = _batch()
    samples, _ = flatten(batch)
    five = samples[:5]
    ranks = [shard(five, r, 2) for r in range(2)]
    assert [len(s) for s in ranks] == [3, 3] and [sum(x.live for x in s) for s in ranks] == [3, 2]
    pad = ranks[1][-1]
    assert not pad.live and pad in [x.__class__(**{**vars(x), "live": False}) for x in five]
    assert len(pad.prompt_token_ids + pad.response_token_ids) == min(
        len(x.prompt_token_ids + x.response_token_ids) for x in five
    )  # the batch's shortest
    whole = shard(five, 0, 1)
    assert [x for x in interleave(ranks) if x.live] == whole  # rank r's k-th sample is k * world + r
    assert [len(s) for s in (shard(samples[:1], r, 2) for r in range(2))] == [1, 1]  # fewer samples than ranks


def _torchrun_steps(
    tmp_path, samples, trajectories, config, nproc: int, steps: int = 2, device: str = "cpu", demonstrations=()
) -> list[dict]:
    _, images = _batch()
    name = f"{nproc}-{len(samples)}-{config.activation_checkpointing}-{device}-{len(demonstrations)}"
    (tmp_path / f"{name}.pkl").write_bytes(
        pickle.dumps((samples, trajectories, images, _policy().model.state_dict(), config, steps, list(demonstrations)))
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(Path(__file__).with_name("torchrun_step.py")),
        str(tmp_path / f"{name}.pkl"),
        str(tmp_path / f"{name}.pt"),
    ]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "AWRL_TEST_DEVICE": device},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(tmp_path / f"{name}.pt", weights_only=False)


def _emulated_steps(samples, trajectories, config, world: int, steps: int = 2) -> list[tuple[float, float, str]]:
    model = _fresh_model()
    emulated, scorer, out = EmulatedFSDP(model, world, config.lr, config.weight_decay), _scorer(model), []
    with _threads(1):
        for s in range(steps):
            step = optimizer_step(
                scorer, emulated, config, s, [shard(samples, r, world) for r in range(world)], trajectories, 0, None
            )
            out.append((combine(step.scored)[0], step.grad_norm, weights_sha256(model.state_dict()), emulated.sha256()))
    return out


@contextlib.contextmanager
def _threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_fsdp2_ranks_equal_one_process_and_replay_emulates_them_bit_for_bit(tmp_path):
    """Two AdamW steps (lr 1e-3) of the FSDP2 trainer under torchrun, 1 and 2 gloo ranks, even (6
    samples) and uneven (5: one rank runs a padding sample), against the 1-process emulation."""
    batch, _ = _batch()
    samples, trajectories = flatten(batch)
    config = TrainConfig(run_id="run", lr=1e-3)
    one = _torchrun_steps(tmp_path, samples, trajectories, config, 1)
    two = _torchrun_steps(tmp_path, samples, trajectories, config, 2)
    assert one[0]["loss"] == two[0]["loss"]  # same weights: per-sample losses, summed in the same order
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)  # after a step the weights differ in the last bits
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-6)  # the gradient sum is associated differently
        assert max((a["weights"][k] - b["weights"][k]).abs().max().item() for k in a["weights"]) < 1e-5
        assert a["scored"] == b["scored"] == 6
    # sharding: each rank holds half of every parameter, gradient and AdamW moment
    (m1,), (r0, r1) = one[-1]["memory"], two[-1]["memory"]
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
        assert abs(r0[key] - m1[key] / 2) <= 0.01 * m1[key] and abs(r1[key] - m1[key] / 2) <= 0.01 * m1[key]

    uneven = _torchrun_steps(tmp_path, samples[:5], trajectories, config, 2)
    assert [u["scored"] for u in uneven] == [5, 5]
    for world, recorded, subset in ((1, one, samples), (2, two, samples), (2, uneven, samples[:5])):
        replayed = _emulated_steps(subset, trajectories, config, world)
        # the weights, and the digest the ranks computed from their own shards without gathering them
        assert replayed == [(r["loss"], r["grad_norm"], weights_sha256(r["weights"]), r["digest"]) for r in recorded], (
            world
        )
    assert one[-1]["digest"] == weights_sha256(one[-1]["weights"])  # one rank's digest is the whole model's hash


def test_activation_checkpointing_changes_no_bit(tmp_path):
    batch, _ = _batch()
    samples, trajectories = flatten(batch)
    plain = _torchrun_steps(tmp_path, samples, trajectories, TrainConfig(run_id="run", lr=1e-3), 2, steps=1)
    checkpointed = _torchrun_steps(
        tmp_path, samples, trajectories, TrainConfig(run_id="run", lr=1e-3, activation_checkpointing=True), 2, steps=1
    )
    assert weights_sha256(plain[0]["weights"]) == weights_sha256(checkpointed[0]["weights"])
    assert (plain[0]["loss"], plain[0]["grad_norm"]) == (checkpointed[0]["loss"], checkpointed[0]["grad_norm"])


def test_learning_rate_warms_up_then_decays_linearly():
    config = TrainConfig(run_id="r", lr=1e-3, warmup_updates=4, decay_updates=10, min_lr_ratio=0.1)
    # warm-up: (step + 1) / 4 of the rate; decay: from step 4 to step 10, down to 0.1 of it
    expected = [2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 8.5e-4, 7e-4, 5.5e-4, 4e-4, 2.5e-4, 1e-4, 1e-4]
    assert [round(config.lr_at(s), 12) for s in range(12)] == pytest.approx(expected)
    assert TrainConfig(run_id="r", lr=3e-4).lr_at(0) == TrainConfig(run_id="r", lr=3e-4).lr_at(99) == 3e-4


def test_shuffled_rewards_are_a_seeded_permutation_of_the_group_rewards():
    from trainer.batch import control_rewards

    group = GroupCompleted(
        run_id="r",
        group_id="g1",
        task_id="t",
        trajectory_ids=list("abcdefgh"),
        rewards=[1, 0, 0, 1, 0, 0, 0, 1],
        num_steps=[1] * 8,
        outcomes=["success"] * 8,
        min_policy_version=0,
        max_policy_version=0,
    )
    assert control_rewards(group) == group.rewards
    shuffled = control_rewards(group, "shuffled_rewards")
    assert sorted(shuffled) == sorted(group.rewards) and shuffled == control_rewards(group, "shuffled_rewards")
    other = group.model_copy(update={"group_id": "g2"})
    assert control_rewards(other, "shuffled_rewards") != shuffled  # a different group, a different draw
    with pytest.raises(ValueError, match="unknown control"):
        control_rewards(group, "negated")


def test_rl_evaluation_points_are_evenly_spaced_versions_ending_with_the_last():
    from app.learning import _spaced

    assert _spaced(list(range(18)), 3) == [6, 12, 17]
    assert _spaced([0, 1, 2, 3], 3) == [1, 2, 3]
    assert _spaced([0, 1], 3) == [1] and _spaced([0, 1, 2], 1) == [2]
    assert _spaced([0], 1) == [0]  # no update was published: the warm start itself


@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["advantages", "negated"])
def test_one_optimizer_step_moves_each_token_the_way_its_advantage_says(sign):
    """The learning path's direction in seconds: one AdamW step of the trainer's own `optimizer_step`
    raises the log-probs of positive-advantage tokens and lowers those of negative ones, and negating
    the advantages reverses both. A sign or alignment bug in the loss fails this before any RL run."""
    import dataclasses

    batch, _ = _batch()
    samples, trajectories = flatten(batch)
    samples = [dataclasses.replace(s, advantage=sign * s.advantage) for s in samples]
    model = _fresh_model()
    scorer, config = _scorer(model), TrainConfig(run_id="run", lr=1e-4)
    before = response_logprobs(scorer, samples, 1.0)
    with _threads(1):
        optimizer_step(
            scorer,
            EmulatedFSDP(model, 1, config.lr, config.weight_decay),
            config,
            0,
            [shard(samples, 0, 1)],
            trajectories,
            0,
            None,
        )
    after = response_logprobs(scorer, samples, 1.0)
    moved = {+1: [], -1: []}
    for s, b, a in zip(samples, before, after):
        moved[1 if s.advantage > 0 else -1].append((a - b).mean().item())
    assert len(moved[1]) and len(moved[-1])
    assert all(m > 0 for m in moved[1]) and all(m < 0 for m in moved[-1]), moved


def test_starvation_names_its_cause_from_the_dropped_groups():
    from schemas import GroupDropped
    from trainer.starvation import Starvation

    def dropped(reason="uninformative", mean_reward=0.0, invalid_share=0.0):
        return GroupDropped(
            run_id="r",
            group_id="g",
            task_id="t",
            reason=reason,
            trainer_version=0,
            min_policy_version=0,
            mean_reward=mean_reward,
            invalid_share=invalid_share,
        )

    s = Starvation()
    for _ in range(3):
        s.add(dropped(invalid_share=0.9))
    s.add(dropped(reason="stale"))  # only uninformative drops starve a run
    assert (s.groups, s.cause) == (3, "invalid output") and "90% of their actions invalid" in s.message()
    s.reset()
    s.add(dropped(invalid_share=0.1)), s.add(dropped(invalid_share=0.2))
    assert s.cause == "all failed"
    s.reset()
    s.add(dropped(mean_reward=1.0))
    assert s.cause == "all succeeded"
    s.add(dropped(mean_reward=0.0))
    assert s.cause == "mixed"


def test_adam_eps_makes_a_tiny_gradient_move_a_weight_in_proportion():
    """`TrainConfig.adam_eps`: AdamW's first step moves a weight by lr * g / (|g| + eps): by about lr
    at the default whatever |g| (1e-7 here), by about lr * |g| / eps at eps = 1e-5 (1/100 of lr)."""
    moved = {}
    for eps in (1e-8, 1e-5):
        layer = torch.nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            layer.weight.fill_(1.0)
        optimizer = EmulatedFSDP(layer, 1, lr=1e-3, weight_decay=0.0, eps=eps)
        layer.weight.grad = torch.full_like(layer.weight, 1e-7)
        optimizer.after_backward()
        optimizer.clip_and_step(1.0)
        moved[eps] = 1.0 - float(layer.weight.detach())
    assert moved[1e-8] == pytest.approx(1e-3 * 1e-7 / (1e-7 + 1e-8), rel=1e-3)
    assert moved[1e-5] == pytest.approx(1e-3 * 1e-7 / (1e-7 + 1e-5), rel=1e-2)
