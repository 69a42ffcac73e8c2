"""Does a policy read the instruction? A teacher-forced probe of the boxes `colour` decision.

For held-out layouts and every colour, the prompt of "Click the <colour> box." exactly as the pool
renders it, and the response teacher-forced up to the mark, in the format of the warm start's
demonstrations (`{"thought": "click the <colour> box", "memory": {"plan step": "0"}, "action":
{"kind": "click", "mark": `). The next token's distribution over the four marks' digits, renormalised
over them, gives:

- `correct`: the mean probability of the named colour's mark (1/4 at chance, 1 when solved);
- `tv`: the mean total variation distance between the mark distributions that two different colour
  words give on the same screen (0: the colour word changes nothing the policy does);
- `valid_mass`: the mean probability of any of the four digits at all (the format holding).

A warm start at chance with `tv` near 0 has not tied the mark to the word; RL that solves `colour` must
raise both `tv` and `correct`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from model.hf_io import load_policy
from model.inputs import build_inputs, forward_log_softmax, inputs_from_ids, suppressed_token_ids
from model.prompt import render_prompt
from pipeline.hashing import sha256_hex
from rollout.suites.boxes import make_task
from rollout.suites.boxes.suite import COLOURS, TEST_SEED, BoxesSuite, thought
from schemas.observation import Observation


@dataclass(frozen=True)
class ProbeResult:
    layouts: int
    correct: float
    """Mean probability of the named colour's mark, over layouts and colours (chance: 0.25)."""
    tv: float
    """Mean total variation between two colour words' mark distributions on one screen."""
    valid_mass: float
    """Mean probability that the next token is one of the four marks at all."""

    def __str__(self) -> str:
        return (
            f"p(correct mark) {self.correct:.3f} (chance 0.25), TV across colours {self.tv:.3f}, "
            f"mass on the marks {self.valid_mass:.3f} ({self.layouts} layouts x {len(COLOURS)} colours)"
        )


@torch.no_grad()
def colour_probe(model_dir: str | Path, layouts: int = 32, temperature: float = 1.0) -> ProbeResult:
    """The probe over the first `layouts` held-out layouts of the boxes suite (test seeds)."""
    model, tokenizer, processor = load_policy(model_dir)
    model.eval()
    suppress = suppressed_token_ids(tokenizer)
    digits = [_single_token(tokenizer, str(COLOURS.index(c))) for c in COLOURS]
    suite = BoxesSuite()
    correct, valid, tv = [], [], []
    for seed in range(TEST_SEED, TEST_SEED + layouts):
        marks_p = []
        for colour in COLOURS:
            task = colour_task(seed, colour, "test")
            p = _mark_distribution(model, tokenizer, processor, suppress, suite, task, digits, temperature)
            valid.append(float(p.sum()))
            p = p / p.sum()
            correct.append(float(p[COLOURS.index(colour)]))
            marks_p.append(p)
        tv += [0.5 * float((a - b).abs().sum()) for a, b in itertools.combinations(marks_p, 2)]
    return ProbeResult(layouts, _mean(correct), _mean(tv), _mean(valid))


def colour_task(seed: int, colour: str, split: str):
    """The `colour` task on `seed`'s layout, naming `colour` whatever the seed draws."""
    return make_task("colour", seed, split).model_copy(
        update={"instruction": f"Click the {colour} box.", "judge": {"target": colour, "named": colour}}
    )


def prompt_ids(tokenizer, processor, suite: BoxesSuite, task) -> tuple[list[int], list[bytes]]:
    """The first step's prompt token ids and screenshots, exactly as the pool renders them."""
    screen = suite.new_screen()
    instruction = asyncio.run(suite.reset(screen, task))
    png, marks = asyncio.run(screen.observe(True))
    obs = Observation(
        instruction=instruction,
        screenshots=[png],
        screenshot_sha256=[sha256_hex(png)],
        url=screen.url,
        feedback="",
        history=[],
        memory={},
        marks=marks,
        som=True,
        step=0,
        horizon=task.horizon,
        viewport=screen.viewport,
    )
    text, images = render_prompt(obs)
    return build_inputs(tokenizer, text, images, processor)["input_ids"][0].tolist(), images


def response_text(task, mark: int) -> str:
    """The warm start's response format, clicking `mark`."""
    return json.dumps(
        {"thought": thought(task), "memory": {"plan step": "0"}, "action": {"kind": "click", "mark": mark}}
    )


def _mark_distribution(
    model, tokenizer, processor, suppress, suite: BoxesSuite, task, digits: list[int], temperature: float
) -> torch.Tensor:
    """p(next token = each mark's digit) after the prompt and the response forced up to the mark ([4])."""
    prompt, images = prompt_ids(tokenizer, processor, suite, task)
    response = response_text(task, 0)
    forced = tokenizer(response[: response.rindex("0")] + "0", add_special_tokens=False)["input_ids"]
    if forced[-1] != digits[0]:
        raise ValueError("the mark's digit is not a token of its own in this tokenizer")
    inputs = inputs_from_ids(tokenizer, prompt + forced, images, processor)
    logp = forward_log_softmax(model, inputs, 1, suppress, temperature)[0]  # [V]: the mark's position
    return logp[digits].exp()


def _single_token(tokenizer, text: str) -> int:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise ValueError(f"{text!r} is {len(ids)} tokens")
    return ids[0]


def _mean(values: list[float]) -> float:
    return sum(values) / max(len(values), 1)
