"""Can the boxes `colour` decision be learned from its token alone, and what does that do to the format?

Offline, no broker: from a warm start, the response is teacher-forced up to the mark (as
`analysis.probe` does) and only the mark's token gets a gradient, with the trainer's optimizer (AdamW).

- `sft`: cross-entropy on the correct mark (a clean signal: the expected policy gradient of the
  decision token, p(correct) * grad log p(correct), points the same way, and Adam ignores its scale);
- `full`: cross-entropy on every token of the correct response (SFT on `colour`'s answers, from the
  warm start): what the decision's gradient does when the scaffold is supervised beside it;
- `anchored`: `rl`, plus `anchor` x cross-entropy on the scaffold of the warm start's own demonstrations
  (`named`: a uniform box, its mark left out), as InstructGPT's PPO-ptx mixes its pretraining
  gradient into PPO: whether RL's signal learns once the scaffold is held the way SFT holds it;
- `rl`: REINFORCE on the mark alone, `group` marks sampled per screen from the current policy, reward
  1 for the right one, advantage = reward - the group's mean (GRPO without the std): the same expected
  direction with the sampling noise of a real run, and no other token touched.

Every `every` steps: the probe (p(correct mark), TV across colour words, mass on the marks) on held-out
layouts, and the format: the mean NLL per token of the held-out correct responses with the mark left
out (the scaffold a run must keep). If `sft` learns without moving the scaffold while `rl` moves it,
RL's noise is the bound; if both move it, Adam's step on a one-token gradient is.

    .venv/bin/python bench/decision_only.py --model DIR --arms sft:3e-4,rl:3e-4,rl:1e-3 --steps 120
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch
import typer
from rich.console import Console

console = Console()
OUT = Path(__file__).parent / "out"


def _example(tokenizer, processor, suite, seed: int, colour: str, split: str, clicked: str | None = None):
    """(prompt+forced ids, images, the mark's digit id, the full response's ids): the correct response,
    or with `clicked` the warm start's own kind of demonstration (`named`: that box, whatever the colour)."""
    from analysis.probe import colour_task, prompt_ids, response_text
    from rollout.suites.boxes.suite import COLOURS

    task = colour_task(seed, colour, split)
    prompt, images = prompt_ids(tokenizer, processor, suite, task)
    mark = COLOURS.index(clicked or colour)
    response = response_text(task, mark)
    # Up to and including the mark's digit, as `analysis.probe` forces it: the logits at the digit's
    # position are its distribution (a prefix cut before the digit tokenizes its space differently).
    forced = tokenizer(response[: response.rindex(str(mark)) + 1], add_special_tokens=False)["input_ids"]
    full = tokenizer(response, add_special_tokens=False)["input_ids"]
    digit = tokenizer(str(mark), add_special_tokens=False)["input_ids"][0]
    if forced[-1] != digit or full[: len(forced)] != forced:
        raise ValueError("the mark's digit is not a token of its own in this tokenizer")
    return prompt, forced, images, digit, full


def _mark_logp(model, tokenizer, processor, suppress, ex):
    from model.inputs import forward_log_softmax, inputs_from_ids

    prompt, forced, images, _, _ = ex
    inputs = inputs_from_ids(tokenizer, prompt + forced, images, processor)
    return forward_log_softmax(model, inputs, 1, suppress)[0]  # [V]: at the mark's digit


def _full_logprobs(model, tokenizer, processor, suppress, ex):
    from model.inputs import forward_logprobs, inputs_from_ids

    prompt, _, images, _, full = ex
    return forward_logprobs(model, inputs_from_ids(tokenizer, prompt + full, images, processor), len(full), suppress)


@torch.no_grad()
def _scaffold_nll(model, tokenizer, processor, suppress, held) -> float:
    total, n = 0.0, 0
    for ex in held:
        _, forced, _, _, full = ex
        lp = _full_logprobs(model, tokenizer, processor, suppress, ex)
        keep = [i for i in range(len(full)) if i != len(forced) - 1]  # all but the mark's digit
        total -= float(lp[keep].sum())
        n += len(keep)
    return total / n


def main(
    model: Path = typer.Option(..., help="the warm start's model directory"),
    arms: str = "sft:3e-4,rl:3e-4,rl:1e-3",
    steps: int = 120,
    batch: int = 8,
    group: int = 8,
    every: int = 20,
    layouts: int = 16,
    adam_eps: float = 1e-8,
    anchor: float = 1.0,
    seed: int = 0,
    tag: str = "",
) -> None:
    from analysis.probe import colour_probe
    from model.hf_io import load_policy, save_policy
    from model.inputs import suppressed_token_ids
    from rollout.suites.boxes.suite import COLOURS, TEST_SEED, BoxesSuite

    rows = []
    for arm in arms.split(","):
        kind, lr = arm.split(":")
        torch.manual_seed(seed)
        rng = random.Random(seed)
        net, tokenizer, processor = load_policy(model)
        suppress = suppressed_token_ids(tokenizer)
        suite = BoxesSuite()
        held = [
            _example(tokenizer, processor, suite, s, rng.choice(COLOURS), "test")
            for s in range(TEST_SEED, TEST_SEED + layouts)
        ]
        opt = torch.optim.AdamW(net.parameters(), lr=float(lr), eps=adam_eps, weight_decay=0.0)
        t0 = time.monotonic()
        for step in range(steps + 1):
            if step % every == 0:
                net.eval()
                tmp = OUT / f"decision-{kind}-{lr}"
                save_policy(net, tokenizer, tmp, image_processor=processor)
                probe = colour_probe(tmp, layouts=layouts)
                nll = _scaffold_nll(net, tokenizer, processor, suppress, held)
                rows.append(
                    {
                        "arm": arm,
                        "step": step,
                        "correct": probe.correct,
                        "tv": probe.tv,
                        "mass": probe.valid_mass,
                        "scaffold_nll": nll,
                        "seconds": time.monotonic() - t0,
                    }
                )
                console.print(rows[-1])
                net.train()
            if step == steps:
                break
            opt.zero_grad()
            for _ in range(batch):
                s = rng.randrange(500)
                ex = _example(tokenizer, processor, suite, s, rng.choice(COLOURS), "train")
                logp = _mark_logp(net, tokenizer, processor, suppress, ex)  # [V]
                if kind == "sft":
                    loss = -logp[ex[3]] / batch
                elif kind == "anchored":  # RL on the mark + SFT on the warm start's data, the mark left out
                    marks = torch.multinomial(logp.detach().exp(), group, replacement=True)  # [G]
                    advantage = (marks == ex[3]).float() - (marks == ex[3]).float().mean()  # [G]
                    demo = _example(
                        tokenizer,
                        processor,
                        suite,
                        rng.randrange(500),
                        rng.choice(COLOURS),
                        "train",
                        clicked=rng.choice(COLOURS),
                    )
                    nll = -_full_logprobs(net, tokenizer, processor, suppress, demo)  # [T]
                    scaffold = torch.ones_like(nll).index_fill_(0, torch.tensor([len(demo[1]) - 1]), 0.0)  # [T]
                    loss = (-(advantage * logp[marks]).sum() / group + anchor * (nll * scaffold).mean()) / batch
                elif kind == "full":  # every token of the correct response: SFT as the warm start had it
                    loss = -_full_logprobs(net, tokenizer, processor, suppress, ex).mean() / batch
                else:
                    marks = torch.multinomial(logp.detach().exp(), group, replacement=True)  # [G]
                    reward = (marks == ex[3]).float()  # [G]
                    advantage = reward - reward.mean()  # [G]
                    loss = -(advantage * logp[marks]).sum() / (group * batch)
                loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
    OUT.mkdir(exist_ok=True)
    (OUT / f"decision_only{tag}.json").write_text(json.dumps(rows, indent=2))
    for r in rows:
        console.print(
            f"{r['arm']:>10} step {r['step']:>4}: p(correct) {r['correct']:.3f}  TV {r['tv']:.3f}  "
            f"mass {r['mass']:.3f}  scaffold NLL {r['scaffold_nll']:.4f}"
        )


if __name__ == "__main__":
    typer.run(main)
