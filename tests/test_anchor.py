"""The SFT anchor (PPO-ptx, `trainer.losses.anchor`): its loss on hand-made tensors, the tokens it
clones, the per-step draw of demonstrations, its gradient against one written by hand, coef 0 changing
no bit, the config's validation, and FSDP2 ranks sharding the demonstrations like the one-process
update (replay's emulation, bit for bit)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pydantic
import pytest
import torch

from model.inputs import suppressed_token_ids
from model.response import decision_token_mask
from pipeline.hashing import weights_sha256
from trainer.config import AnchorConfig, TrainConfig
from trainer.emulated_fsdp import EmulatedFSDP
from trainer.losses import anchor_loss, anchor_mask
from trainer.update import (
    Scorer,
    StepSample,
    anchor_gradients,
    anchor_stats,
    combine,
    draw_anchor,
    flatten,
    interleave,
    optimizer_step,
    score,
    shard,
)

from test_token_selection import _policy as _selection_policy
from test_token_selection import _sample
from test_trainer import _batch, _fresh_model, _scorer, _threads, _torchrun_steps

ANCHORED = AnchorConfig(coef=0.5, run_ids=("warm-demos",), steps=3)


# --- the loss and its tokens ---------------------------------------------------------------------


def test_anchor_loss_is_the_mean_nll_of_the_selected_tokens_by_hand():
    logprobs = torch.tensor([-0.5, -1.0, -2.0, -0.1], requires_grad=True)
    decision = [False, False, True, False]  # the mark: `"mark": 2`'s digit
    scaffold = anchor_mask("scaffold", 4, lambda: decision)
    assert scaffold.tolist() == [True, True, False, True]
    loss = anchor_loss(logprobs, scaffold)
    assert loss.item() == pytest.approx((0.5 + 1.0 + 0.1) / 3)  # the mark's -2.0 left out
    loss.backward()
    assert logprobs.grad.tolist() == pytest.approx([-1 / 3, -1 / 3, 0.0, -1 / 3])  # no push on the mark
    every = anchor_mask("all", 4, lambda: pytest.fail("`all` needs no decision mask"))
    assert anchor_loss(logprobs, every).item() == pytest.approx((0.5 + 1.0 + 2.0 + 0.1) / 4)
    assert anchor_loss(logprobs, torch.zeros(4, dtype=torch.bool)).item() == 0.0  # nothing selected: no NaN


def test_scaffold_is_every_token_but_the_action_values_of_a_real_response():
    sample, _ = _sample(advantage=0.0)
    tok, ids = _selection_policy().tokenizer, sample.response_token_ids
    scaffold = anchor_mask("scaffold", len(ids), lambda: decision_token_mask(tok, ids))
    left_out = "".join(tok.decode([i]) for i, m in zip(ids, scaffold) if not m)
    assert left_out.replace(" ", "") == '"click",2'  # the kind and the mark: what `tokens.pg=action` trains
    assert int(scaffold.sum()) == len(ids) - len([m for m in decision_token_mask(tok, ids) if m])


# --- the draw ------------------------------------------------------------------------------------


def _stand_ins(n: int = 20) -> list[StepSample]:
    """Demonstration steps told apart by their prompt's length (no model needed to draw them)."""
    return [StepSample([1] * (10 + i), [2], [], [0.0], [0], 1.0, 1, True) for i in range(n)]


def _drawn(demos, config, update_step: int) -> list[int]:
    (mine,) = draw_anchor(demos, config, update_step, [0], 1).shards
    return [len(s.prompt_token_ids) for s in mine]


DRAW_SCRIPT = """
from trainer.config import AnchorConfig, TrainConfig
from trainer.update import StepSample, draw_anchor
demos = [StepSample([1] * (10 + i), [2], [], [0.0], [0], 1.0, 1, True) for i in range(20)]
config = TrainConfig(run_id="r", anchor=AnchorConfig(coef=0.5, run_ids=("warm-demos",), steps=3))
print([len(s.prompt_token_ids) for s in draw_anchor(demos, config, 7, [0], 1).shards[0]])
"""


def test_the_draw_is_a_function_of_seed_and_update_step():
    demos, config = _stand_ins(), TrainConfig(run_id="r", anchor=ANCHORED)
    first = _drawn(demos, config, 3)
    assert first == _drawn(demos, config, 3) and len(first) == len(set(first)) == 3  # a restart, replay: the same
    assert first != _drawn(demos, config, 4)  # another optimizer step, other demonstrations
    assert first != _drawn(demos, config.model_copy(update={"seed": 1}), 3)
    # 2 ranks: 3 steps as 2 + 2 with one padding step, which interleave back to the one-process order
    two = draw_anchor(demos, config, 3, range(2), 2)
    assert two.drawn == 3 and [len(r) for r in two.shards] == [2, 2] and sum(s.live for r in two.shards for s in r) == 3
    assert [s for s in interleave(two.shards) if s.live] == draw_anchor(demos, config, 3, [0], 1).shards[0]
    assert draw_anchor(demos, TrainConfig(run_id="r"), 3, [0], 1) is None  # coef 0: nothing drawn
    assert draw_anchor(demos[:2], config, 3, [0], 1).drawn == 2  # fewer demonstrations than steps: all of them
    with pytest.raises(ValueError, match="no successful demonstration"):
        draw_anchor([], config, 0, [0], 1)
    # a str seed is hashed with sha512, not hash(): another interpreter, with another hash seed, draws the same
    other = subprocess.run(
        [sys.executable, "-c", DRAW_SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parents[1],
        env={**os.environ, "PYTHONHASHSEED": "12345"},
    )
    assert other.returncode == 0, other.stderr[-2000:]
    assert other.stdout.strip() == str(_drawn(demos, config, 7))


# --- the gradient --------------------------------------------------------------------------------


def _own_scorer(model, images) -> Scorer:
    p = _selection_policy()
    return Scorer(model, p.tokenizer, p.image_processor, suppressed_token_ids(p.tokenizer), images.__getitem__)


def test_the_anchor_gradient_is_coef_over_drawn_times_the_scaffold_nll_gradient_by_hand():
    demo, images = _sample(advantage=1.0)
    config = TrainConfig(run_id="r", anchor=ANCHORED)
    model = _fresh_model_of(_selection_policy())
    (nll,) = anchor_gradients(_own_scorer(model, images), [demo], 2, config)
    got = [q.grad.clone() for q in model.parameters()]

    hand = _fresh_model_of(_selection_policy())
    scorer = _own_scorer(hand, images)
    ((_, inputs),) = scorer.samples([demo])
    logprobs, _ = score(hand, inputs, len(demo.response_token_ids), scorer.suppress, 1.0)
    scaffold = ~torch.tensor(decision_token_mask(scorer.tokenizer, demo.response_token_ids))
    by_hand = -logprobs[scaffold].mean()
    (0.5 / 2 * by_hand).backward()  # coef 0.5, 2 demonstrations drawn in all
    assert nll == pytest.approx(by_hand.item(), rel=1e-6)
    for a, b in zip(got, (q.grad for q in hand.parameters())):
        assert torch.allclose(a, b, atol=1e-8, rtol=1e-5)
    assert anchor_stats([nll, 3.0]) == {"anchor_nll": pytest.approx((nll + 3.0) / 2)} and anchor_stats([]) == {}


def _fresh_model_of(policy):
    import copy

    return copy.deepcopy(policy.model).train()


def test_coef_zero_changes_no_bit_of_the_update():
    """A config with the anchor off (coef 0, even with runs named) draws nothing, and its optimizer step
    is bit for bit the one without the anchor: loss, gradient, norm and weights."""
    samples, trajectories = flatten(_batch()[0])
    results, grads = {}, {}
    for name, anchor in (("plain", AnchorConfig()), ("off", AnchorConfig(coef=0.0, run_ids=("warm-demos",)))):
        config = TrainConfig(run_id="run", lr=1e-3, anchor=anchor)
        model = _fresh_model()
        with _threads(1):
            step = optimizer_step(
                _scorer(model),
                EmulatedFSDP(model, 1, config.lr, config.weight_decay),
                config,
                0,
                [shard(samples, 0, 1)],
                trajectories,
                0,
                None,
                anchor=draw_anchor(samples[:2], config, 0, [0], 1),
            )
        results[name] = (combine(step.scored)[0], step.grad_norm, weights_sha256(model.state_dict()), step.anchor_nll)
        grads[name] = [q.grad for q in model.parameters()]
    assert results["plain"] == results["off"] and results["off"][3] == []
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(grads["plain"], grads["off"]))


# --- the config ----------------------------------------------------------------------------------


def test_config_validation_names_the_field_and_the_config_is_recorded_whole():
    with pytest.raises(pydantic.ValidationError, match=r"anchor\.coef = 1\.0 > 0 needs anchor\.run_ids"):
        TrainConfig(run_id="r", anchor={"coef": 1.0})
    with pytest.raises(pydantic.ValidationError, match="coef"):
        AnchorConfig(coef=-0.1)
    with pytest.raises(pydantic.ValidationError, match="steps"):
        AnchorConfig(coef=1.0, run_ids=("d",), steps=0)
    with pytest.raises(pydantic.ValidationError, match="tokens"):
        AnchorConfig(tokens="mark")
    assert AnchorConfig().coef == 0.0 and AnchorConfig().run_ids == ()  # off by default, reads nothing
    config = TrainConfig(run_id="r", anchor=ANCHORED)
    # `UpdateApplied.config_json` is the whole config: replay reads the anchor back from it
    assert TrainConfig.model_validate_json(config.model_dump_json()).anchor == ANCHORED
    assert hash(config) == hash(TrainConfig.model_validate_json(config.model_dump_json()))


def test_the_learning_stage_passes_the_warm_starts_demonstrations_only_when_asked(tmp_path):
    from app.learning import controlled, rl_train_config

    assert rl_train_config(controlled("c", tmp_path), "c").anchor == AnchorConfig()  # the default: no anchor
    built = rl_train_config(controlled("c", tmp_path, anchor_coef=0.5), "c")
    assert (built.anchor.coef, built.anchor.run_ids) == (0.5, ("c-demos",))  # its own warm start's
    shared = controlled("c", tmp_path, anchor_coef=0.5, warm_start=tmp_path, warm_start_run="warm")
    assert rl_train_config(shared, "c").anchor.run_ids == ("warm-demos",)
    with pytest.raises(ValueError, match="warm_start_run"):
        controlled("c", tmp_path, anchor_coef=0.5, warm_start=tmp_path)


# --- FSDP2 ranks ---------------------------------------------------------------------------------


def _emulated(samples, trajectories, demos, config, world: int):
    model = _fresh_model()
    emulated, scorer = EmulatedFSDP(model, world, config.lr, config.weight_decay), _scorer(model)
    with _threads(1):
        step = optimizer_step(
            scorer,
            emulated,
            config,
            0,
            [shard(samples, r, world) for r in range(world)],
            trajectories,
            0,
            None,
            anchor=draw_anchor(demos, config, 0, range(world), world),
        )
    return combine(step.scored)[0], step.grad_norm, emulated.sha256(), step.anchor_nll


def test_fsdp2_ranks_shard_the_demonstrations_and_replay_emulates_them_bit_for_bit(tmp_path):
    """One AdamW step with the anchor on 2 gloo ranks under torchrun (3 demonstration steps: one rank
    runs a padding one) equals replay's 2-rank emulation bit for bit, and the one-process update to
    rounding (the gradient sum is associated differently)."""
    samples, trajectories = flatten(_batch()[0])
    demos = samples[1:5]  # stand-ins: any recorded steps with screenshots
    config = TrainConfig(run_id="run", lr=1e-3, anchor=ANCHORED)
    (two,) = _torchrun_steps(tmp_path, samples, trajectories, config, 2, steps=1, demonstrations=demos)
    assert len(two["anchor_nll"]) == 3 and all(n > 0 for n in two["anchor_nll"])
    assert _emulated(samples, trajectories, demos, config, 2) == (
        two["loss"],
        two["grad_norm"],
        two["digest"],
        two["anchor_nll"],
    )
    one = _emulated(samples, trajectories, demos, config, 1)
    assert one[1] == pytest.approx(two["grad_norm"], rel=1e-6)
    assert sorted(one[3]) == pytest.approx(sorted(two["anchor_nll"]), rel=1e-6)
    without = _emulated(samples, trajectories, demos, TrainConfig(run_id="run", lr=1e-3), 1)
    assert without[1] != one[1]  # the anchor's gradient is in the step
