"""The loss options of issue 40, on hand-made inputs: where a response's decision is (`model.response`),
which tokens carry the policy gradient and the KL (`trainer.losses.tokens`), Dr. GRPO's advantages, and
the update with the gradient on the action's tokens only, against the same gradient written by hand."""

from __future__ import annotations

import functools

import pytest
import torch

from model.inputs import suppressed_token_ids
from model.prompt import render_prompt
from model.response import decision_spans, decision_token_mask
from pipeline.hashing import sha256_hex
from rollout.policy.local import LocalPolicy
from schemas.observation import Mark, Observation
from trainer.advantages import group_advantages
from trainer.config import TrainConfig
from trainer.losses import TokenSelection, select_tokens
from trainer.update import Scorer, StepSample, accumulate_gradients, combine, score, update_stats

from samples import render_page

RESPONSE = '{"thought": "click the red box", "memory": {"box": "red"}, "action": {"kind": "click", "mark": 2}}'


@functools.cache
def _policy() -> LocalPolicy:
    return LocalPolicy(max_new_tokens=4, seed=3)


def _ids(text: str) -> list[int]:
    tok = _policy().tokenizer
    return tok(text + "<|im_end|>", add_special_tokens=False)["input_ids"]


def test_decision_spans_are_the_action_values_or_where_the_response_broke():
    spans = decision_spans(RESPONSE)
    assert [RESPONSE[a:b] for a, b in spans] == ['"click"', "2"]
    # a value named "action" in the memory is not the action; an escaped quote stays inside its value
    text = '{"memory": {"note": "action"}, "action": {"kind": "type", "text": "a \\"b\\"", "mark": 7}}'
    assert [text[a:b] for a, b in decision_spans(text)] == ['"type"', '"a \\"b\\""', "7"]
    # broken: the character JSON stopped at, not the well-formed prefix before it
    broken = '{"thought": "t", "memory": {"plan step": "0"}, "action": {"kind": "click", "mark": 0"}, "x"}}'
    ((a, b),) = decision_spans(broken)
    assert broken[:a].endswith('"mark": 0') and broken[a:b] == '"'
    no_action = '{"thought": "t", "memory": {}}'
    assert decision_spans(no_action) == [(len(no_action) - 1, len(no_action))]  # closed without an action
    assert decision_spans("not json at all") == [(0, 1)]


def test_the_arguments_leave_the_kind_to_the_scaffold():
    """`tokens.pg="arguments"`: the action's values but its kind (a `colour` run at lr 1e-3 with the kind
    in the gradient wrote the colour word into it); an action with no argument keeps its kind."""
    assert [RESPONSE[a:b] for a, b in decision_spans(RESPONSE, kind=False)] == ["2"]
    text = '{"action": {"kind": "type", "text": "hi", "mark": 7}}'
    assert [text[a:b] for a, b in decision_spans(text, kind=False)] == ['"hi"', "7"]
    bare = '{"action": {"kind": "scroll"}}'
    assert [bare[a:b] for a, b in decision_spans(bare, kind=False)] == ['"scroll"']
    broken = '{"action": {"kind": "click", "mark": 0"}}'
    assert decision_spans(broken, kind=False) == decision_spans(broken)  # where it broke, either way
    tok, ids = _policy().tokenizer, _ids(RESPONSE)
    chosen = "".join(tok.decode([i]) for i, m in zip(ids, decision_token_mask(tok, ids, kind=False)) if m)
    assert chosen.strip() == "2", chosen
    assert TokenSelection(pg="action").kind_decides and not TokenSelection(pg="arguments").kind_decides
    entropy = torch.zeros(3)
    pg, kl = select_tokens(TokenSelection(pg="arguments", kl="scaffold"), entropy, lambda: [False, False, True])
    assert pg.tolist() == [False, False, True] and kl.tolist() == [True, True, False]


def test_decision_token_mask_marks_the_digit_and_the_kind():
    tok, ids = _policy().tokenizer, _ids(RESPONSE)
    mask = decision_token_mask(tok, ids)
    chosen = "".join(tok.decode([i]) for i, m in zip(ids, mask) if m)
    # the decision, with the punctuation its tokens carry (`",` ends the kind); thought and memory are scaffold
    assert chosen.replace(" ", "") == '"click",2', chosen
    assert sum(mask) < len(ids) / 4
    broken = _ids('{"thought": "t", "memory": {}, "action": {"kind": "click", "mark": 0"}}')
    chosen = [tok.decode([i]) for i, m in zip(broken, decision_token_mask(tok, broken)) if m]
    assert len(chosen) == 1 and chosen[0].startswith('"'), chosen  # the token that broke the JSON


def test_select_tokens_hand_made():
    entropy = torch.tensor([0.1, 0.9, 0.5, 0.2, 0.8])
    action = [False, False, True, False, False]
    pg, kl = select_tokens(TokenSelection(), entropy, lambda: pytest.fail("not needed for pg=all"))
    assert pg.all() and kl.all()
    pg, kl = select_tokens(TokenSelection(pg="action", kl="scaffold"), entropy, lambda: action)
    assert pg.tolist() == action and kl.tolist() == [not a for a in action]
    pg, kl = select_tokens(TokenSelection(pg="action", kl="action"), entropy, lambda: action)
    assert pg.tolist() == action and kl.tolist() == action
    # top 40% of 5 tokens by entropy = ceil(2.0) = 2: the tokens of entropy 0.9 and 0.8
    pg, _ = select_tokens(TokenSelection(pg="entropy", entropy_share=0.4), entropy, lambda: action)
    assert pg.tolist() == [False, True, False, False, True]
    with pytest.raises(ValueError, match="scaffold"):
        TokenSelection(kl="scaffold")
    with pytest.raises(ValueError, match="entropy_share"):
        TokenSelection(pg="entropy", entropy_share=0.0)


def test_dr_grpo_advantages_are_not_divided_by_the_std():
    # R = [1, 0, 0, 0]: mean 0.25 -> Dr. GRPO A = [0.75, -0.25, -0.25, -0.25]; GRPO divides by std 0.4330
    assert group_advantages([1.0, 0.0, 0.0, 0.0], scale_by_std=False) == [0.75, -0.25, -0.25, -0.25]
    assert group_advantages([1.0, 0.0, 0.0, 0.0])[0] == pytest.approx(0.75 / 0.4330127, abs=1e-5)
    assert group_advantages([1.0, 1.0], scale_by_std=False) == [0.0, 0.0]


def _sample(advantage: float) -> tuple[StepSample, dict[str, bytes]]:
    png = render_page("boxes", seed=4, size=(320, 240))
    obs = Observation(
        instruction="Click the red box.",
        screenshots=[png],
        screenshot_sha256=[sha256_hex(png)],
        url="http://127.0.0.1/",
        feedback="",
        history=[],
        memory={},
        marks=[Mark(2, "button", "box", 20, 20, 40, 40)],
        som=True,
        step=0,
        horizon=1,
        viewport=(320, 240),
    )
    policy = _policy()
    prompt = policy.generate(*render_prompt(obs)).prompt_token_ids
    response = _ids(RESPONSE)
    behave = policy.teacher_forced_logprobs(prompt, obs.screenshots, response)
    return (
        StepSample(prompt, response, obs.screenshot_sha256, behave, [0] * len(response), advantage, 1, True),
        {obs.screenshot_sha256[0]: png},
    )


def _fresh_model():
    import copy

    return copy.deepcopy(_policy().model).train()


def test_the_gradient_reaches_only_the_action_tokens():
    """With `tokens.pg=action` at the batch's start (ratio 1, inside the clip), the loss's gradient is
    -A / (k * |selected| * B) * sum over the selected tokens of d log pi: written here by hand."""
    sample, images = _sample(advantage=1.5)
    p = _policy()
    config = TrainConfig(run_id="r", tokens=TokenSelection(pg="action"))
    model = _fresh_model()
    scorer = Scorer(model, p.tokenizer, p.image_processor, suppressed_token_ids(p.tokenizer), images.__getitem__)
    _, tokens = combine(accumulate_gradients(scorer, [sample], 1, 0, config))
    got = [q.grad.clone() for q in model.parameters()]

    selected = torch.tensor(decision_token_mask(p.tokenizer, sample.response_token_ids))
    assert 0 < int(selected.sum()) < len(selected) and torch.equal(tokens["mask"], selected)
    hand = _fresh_model()
    ((_, inputs),) = Scorer(hand, p.tokenizer, p.image_processor, scorer.suppress, images.__getitem__).samples([sample])
    logprobs, _ = score(hand, inputs, len(sample.response_token_ids), scorer.suppress, 1.0)
    k, n_selected, trajectories = config.grpo.k, int(selected.sum()), 1
    (-(1.5 / (k * n_selected * trajectories)) * logprobs[selected].sum()).backward()
    for a, b in zip(got, (q.grad for q in hand.parameters())):
        assert torch.allclose(a, b, atol=1e-7, rtol=1e-4)
    assert update_stats(tokens, config)["tokens"] == len(selected)


def test_scaffold_kl_leaves_the_action_tokens_free():
    """KL to a reference only on the scaffold: with the advantage 0, the only gradient is the KL's, and
    a reference that differs on the action tokens alone pulls nothing back; the KL on the action's
    tokens only (or on all) pulls them."""
    sample, images = _sample(advantage=0.0)
    p = _policy()
    selected = torch.tensor(decision_token_mask(p.tokenizer, sample.response_token_ids))
    model = _fresh_model()
    scorer = Scorer(model, p.tokenizer, p.image_processor, suppressed_token_ids(p.tokenizer), images.__getitem__)
    with torch.no_grad():
        ((_, inputs),) = scorer.samples([sample])
        own, _ = score(model, inputs, len(sample.response_token_ids), scorer.suppress, 1.0)
    reference = [torch.where(selected, own - 1.0, own)]  # differs from pi_theta on the action tokens only
    scaffold_only = [torch.where(selected, own, own - 1.0)]  # differs on the scaffold only
    for kl, ref, moved in (
        ("scaffold", reference, False),
        ("all", reference, True),
        ("action", reference, True),
        ("action", scaffold_only, False),
        ("scaffold", scaffold_only, True),
    ):
        model.zero_grad()
        config = TrainConfig(run_id="r", kl_coef=1.0, tokens=TokenSelection(pg="action", kl=kl))
        accumulate_gradients(scorer, [sample], 1, 0, config, reference=ref)
        norm = sum(float(q.grad.abs().sum()) for q in model.parameters() if q.grad is not None)
        assert (norm > 0) == moved, (kl, norm)
