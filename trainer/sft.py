"""SFT warm start: behaviour cloning of the policy on demonstration trajectories from the ledger.

Demonstrations are ordinary rollout events: `awrl rollout --policy demo` records the oracle's actions
as the model's own token ids (prompt and response) with screenshots by hash (OpenWebRL warm-started
from 412 such trajectories). Only successful trajectories are cloned. The loss is the mean negative
log-likelihood of the response tokens under the distribution the sampler draws from
(`trainer.update.score`), so SFT raises exactly what rollouts will sample. One process: a few hundred
trajectories of a CPU-sized model do not need torchrun.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field

from model.hf_io import ensure_policy, load_policy, save_policy
from model.inputs import suppressed_token_ids
from pipeline.ledger import read_events
from pipeline.settings import StackSettings
from pipeline.store import ScreenshotStore
from trainer.update import Scorer, StepSample, score


class SFTConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    run_ids: list[str]
    """Runs whose successful trajectories are the demonstrations (read from the ledger)."""
    out_dir: Path
    """Where the warm-started HF model directory is written."""
    model_dir: Path | None = None
    """Initial model; None builds the project's tiny Qwen3-VL."""
    epochs: int = Field(default=3, ge=1)
    """Passes over the demonstrations."""
    lr: float = Field(default=1e-3, gt=0)
    """AdamW learning rate (behaviour cloning tolerates more than RL: the targets do not move)."""
    batch_steps: int = Field(default=16, ge=1)
    """Demonstration steps per optimizer step."""
    max_grad_norm: float = Field(default=1.0, gt=0)
    """Gradients are clipped to this global norm."""
    temperature: float = 1.0
    """The sampler's temperature: the cloned distribution is the one rollouts draw from."""
    seed: int = 0
    """Seed of the demonstrations' order and the initial model."""


def demonstrations(settings: StackSettings, run_ids: list[str]) -> list[StepSample]:
    """Steps with model tokens of every successful trajectory of `run_ids`, in trajectory order
    (trajectories of completed groups only, as the trainer sees them)."""
    samples = []
    for run_id in run_ids:
        groups = read_events(settings, run_id, "GroupCompleted", ["trajectory_ids", "outcomes"]).to_pylist()
        won = {t for g in groups for t, o in zip(g["trajectory_ids"], g["outcomes"]) if o == "success"}
        steps = read_events(
            settings,
            run_id,
            "StepRecorded",
            [
                "trajectory_id",
                "step",
                "prompt_token_ids",
                "response_token_ids",
                "prompt_screenshot_sha256",
                "behave_logprobs",
                "token_policy_versions",
            ],
        ).to_pylist()
        steps = sorted(
            (s for s in steps if s["trajectory_id"] in won and s["response_token_ids"]),
            key=lambda s: (s["trajectory_id"], s["step"]),
        )
        lengths = {t: sum(s["trajectory_id"] == t for s in steps) for t in won}
        samples += [
            StepSample(
                s["prompt_token_ids"],
                s["response_token_ids"],
                s["prompt_screenshot_sha256"],
                s["behave_logprobs"],
                s["token_policy_versions"],
                1.0,
                lengths[s["trajectory_id"]],
                True,
            )
            for s in steps
        ]
    return samples


@dataclass
class SFTResult:
    out_dir: Path
    demonstrations: int
    """Steps cloned per epoch."""
    losses: list[float] = field(default_factory=list)
    """Mean token NLL of each optimizer step."""


def train_sft(
    settings: StackSettings, config: SFTConfig, on_step: Callable[[int, int, float], None] | None = None
) -> SFTResult:
    """Clone the demonstrations; `on_step(step, total, loss)` reports progress."""
    torch.manual_seed(config.seed)
    samples = demonstrations(settings, config.run_ids)
    if not samples:
        raise ValueError(
            f"no successful demonstration steps with tokens in runs {config.run_ids} (is the ledger synced?)"
        )
    model, tokenizer, processor = load_policy(ensure_policy(config.model_dir))
    model.train()
    scorer = Scorer(
        model,
        tokenizer,
        processor,
        suppressed_token_ids(tokenizer),
        ScreenshotStore.from_settings(settings).cached_get(),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    rng = random.Random(config.seed)
    result = SFTResult(config.out_dir, len(samples))
    total = config.epochs * -(-len(samples) // config.batch_steps)
    for _ in range(config.epochs):
        order = rng.sample(samples, len(samples))
        for i in range(0, len(order), config.batch_steps):
            batch = order[i : i + config.batch_steps]
            tokens = sum(len(s.response_token_ids) for s in batch)
            optimizer.zero_grad()
            nll = 0.0
            for s, inputs in scorer.samples(batch):
                logprobs, _ = score(model, inputs, len(s.response_token_ids), scorer.suppress, config.temperature)
                loss = -logprobs.sum() / tokens  # mean over the batch's tokens, accumulated per step
                loss.backward()
                nll += loss.item()
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
            optimizer.step()
            result.losses.append(nll)
            if on_step:
                on_step(len(result.losses), total, nll)
    save_policy(model, tokenizer, config.out_dir, image_processor=processor)
    return result
