"""One update's maths: re-score the recorded responses, weight the tokens, backpropagate.

A batch of groups is flattened into `StepSample`s (one model call each: a recorded prompt plus its
response). Model inputs are rebuilt from the recorded prompt token ids and screenshot hashes, exactly
as the sampler saw them (`model.inputs.inputs_from_ids`), so at an unchanged version the
trainer's log-probs equal the sampler's to float rounding. Each rank scores its shard and calls
backward per sample (gradient accumulation: the loss is a sum over tokens), so memory holds one
sample's graph at a time.

pi_prox is the policy at the start of the update (the batch). With one optimizer step per batch those
are the weights being differentiated, so the proximal log-probs are the detached values of the same
forward pass, which is what a separate no-grad pass computes (bit for bit; tested) at half the cost.
With several minibatches (optimizer steps) per batch, `response_logprobs` scores every sample first.

With `config.anchor` (PPO-ptx, `trainer.losses.anchor`), each optimizer step also backpropagates
`anchor.coef` x the mean NLL of demonstration steps drawn for it (`draw_anchor`), sharded like the
samples and after them, so any number of ranks sums the one-process gradient (to rounding; replay's
emulation of the same ranks, bit for bit).
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

import torch

from model.hf_io import load_policy
from model.inputs import forward_log_softmax, inputs_from_ids
from model.response import decision_token_mask
from trainer.batch import TrainGroup
from trainer.config import TrainConfig
from trainer.losses import PolicyBatch, anchor_loss, anchor_mask, policy_loss, step_batch
from trainer.mismatch import mismatch_stats


@dataclass(frozen=True)
class StepSample:
    """One recorded step with everything its tokens need for the loss."""

    prompt_token_ids: list[int]
    response_token_ids: list[int]
    screenshot_sha256: list[str]
    behave_logprobs: list[float]
    token_policy_versions: list[int]
    advantage: float
    trajectory_steps: int
    """|tau_i|: steps of this step's trajectory (the per-trajectory normaliser)."""
    success: bool
    live: bool = True
    """False for a padding sample (`shard`): it runs forward and backward, so every rank makes the same
    collective calls, with its loss multiplied by 0 and nothing recorded."""


def flatten(batch: list[TrainGroup]) -> tuple[list[StepSample], int]:
    """Steps with tokens, in batch order, and B (trajectories in the batch, the loss's 1/B)."""
    samples, trajectories = [], 0
    for g in batch:
        for steps, advantage, reward in zip(g.trajectories, g.advantages, g.completed.rewards):
            trajectories += 1
            samples += [
                StepSample(
                    s.prompt_token_ids,
                    s.response_token_ids,
                    s.prompt_screenshot_sha256,
                    s.behave_logprobs,
                    s.token_policy_versions,
                    advantage,
                    len(steps),
                    reward > 0,
                )
                for s in steps
                if s.response_token_ids
            ]
    return samples, trajectories


def shard(samples: list[StepSample], rank: int, world_size: int) -> list[StepSample]:
    """This rank's samples: longest first, dealt round-robin, so ranks get similar token counts; then
    padded to the same count on every rank with the batch's shortest sample, not `live`.

    Under FSDP2 every forward and backward gathers and reduces weights across ranks, so a rank with
    one sample fewer would leave the others waiting in a collective forever. Rank r's k-th sample is
    sample k * world_size + r of the 1-process order (`interleave` restores it)."""
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i].prompt_token_ids + samples[i].response_token_ids))
    mine = [samples[i] for i in order[rank::world_size]]
    per_rank = -(-len(samples) // world_size)
    return mine + [replace(samples[order[-1]], live=False)] * (per_rank - len(mine))


def interleave(per_rank: list[list]) -> list:
    """Ranks' lists merged in the 1-process order: every rank's k-th item, in rank order, for each k."""
    return [items[k] for k in range(max(map(len, per_rank), default=0)) for items in per_rank if k < len(items)]


def prefetch(
    samples: list[StepSample], fetch: Callable[[str], bytes], ahead: int = 4
) -> Iterator[tuple[StepSample, list[bytes]]]:
    """Samples with their screenshots, fetched by hash `ahead` samples in advance on a thread pool.
    Nothing else keeps the bytes: once the caller moves on, a sample's pixels are freed."""
    with ThreadPoolExecutor(max_workers=ahead) as pool:
        futures = [pool.submit(lambda s=s: [fetch(h) for h in s.screenshot_sha256]) for s in samples[:ahead]]
        for i, s in enumerate(samples):
            if i + ahead < len(samples):
                nxt = samples[i + ahead]
                futures.append(pool.submit(lambda s=nxt: [fetch(h) for h in s.screenshot_sha256]))
            images, futures[i] = futures[i].result(), None
            yield s, images


def score(model, inputs: dict, n: int, suppress: list[int], temperature: float):
    """(log-probs [n], entropies [n]) of the last `n` tokens of `inputs` under the behaviour distribution."""
    logp = forward_log_softmax(model, inputs, n, suppress, temperature)  # [n, V]
    tokens = inputs["input_ids"][0, -n:]  # [n]
    logprobs = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [n]
    p = logp.exp()
    entropy = -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(-1)  # [n]
    return logprobs, entropy


@dataclass(frozen=True)
class Scored:
    """A live sample's loss and its detached per-token values (for `update_stats`)."""

    loss: float
    tokens: dict[str, torch.Tensor]


def combine(scored: list[Scored]) -> tuple[float, dict[str, torch.Tensor]]:
    """The samples' loss (summed in order) and their per-token values, concatenated."""
    keys = scored[0].tokens if scored else {}
    return sum(s.loss for s in scored), {k: torch.cat([s.tokens[k] for s in scored]) for k in keys}


@dataclass(frozen=True)
class Scorer:
    """What turns a sample into model inputs and log-probs: the model and its input builders."""

    model: torch.nn.Module
    tokenizer: object
    image_processor: object
    suppress: list[int]
    """Token ids masked out of the behaviour distribution (`local.suppressed_token_ids`)."""
    fetch: Callable[[str], bytes]
    """Screenshot bytes by sha256 (the object store)."""

    def samples(self, samples: list[StepSample]) -> Iterator[tuple[StepSample, dict]]:
        device = next(self.model.parameters()).device
        for s, images in prefetch(samples, self.fetch):
            inputs = inputs_from_ids(
                self.tokenizer, s.prompt_token_ids + s.response_token_ids, images, self.image_processor
            )
            yield s, {k: v.to(device) for k, v in inputs.items()}

    def frozen(self, model_dir: Path) -> Scorer:
        """The same input builders over a frozen model loaded from `model_dir` (the KL reference)."""
        model = load_policy(model_dir)[0].to(next(self.model.parameters()).device).eval().requires_grad_(False)
        return replace(self, model=model)


@torch.no_grad()
def response_logprobs(scorer: Scorer, samples: list[StepSample], temperature: float) -> list[torch.Tensor]:
    """Log-probs of every sample's response tokens under the scorer's model, with no gradient: pi_prox
    (the weights at the start of the batch) or pi_ref (`Scorer.frozen`)."""
    return [
        score(scorer.model, inputs, len(s.response_token_ids), scorer.suppress, temperature)[0]
        for s, inputs in scorer.samples(samples)
    ]


def accumulate_gradients(
    scorer: Scorer,
    samples: list[StepSample],
    num_trajectories: int,
    version: int,
    config: TrainConfig,
    proximal: list[torch.Tensor] | None = None,
    reference: list[torch.Tensor] | None = None,
    after_backward: Callable[[], None] | None = None,
) -> list[Scored]:
    """One backward per sample (gradients accumulate in `.grad`, or in FSDP2's shards); the live
    samples' losses and per-token values. `proximal`: per-sample log pi_prox when the weights have
    moved since the batch started (else this forward's own); `reference`: per-sample log pi_ref,
    needed when `config.kl_coef` > 0; `after_backward`: called after each sample's backward."""
    if config.kl_coef and reference is None:
        raise ValueError("kl_coef > 0 needs the reference policy's log-probs (`Scorer.frozen`)")
    live = []
    for i, (s, inputs) in enumerate(scorer.samples(samples)):
        n = len(s.response_token_ids)
        logprobs, entropy = score(scorer.model, inputs, n, scorer.suppress, config.temperature)  # [n], [n]
        prox = logprobs.detach() if proximal is None else proximal[i]  # [n]
        ref = reference[i] if reference is not None else torch.zeros(0)  # [n] or [0]
        b = step_batch(
            config,
            logprobs,
            entropy,
            prox,
            s.behave_logprobs,
            ref,
            s.advantage,
            s.success,
            s.trajectory_steps,
            num_trajectories,
            lambda s=s: decision_token_mask(scorer.tokenizer, s.response_token_ids, config.tokens.kind_decides),
        )
        loss, _ = policy_loss(config, b)  # the batch's statistics come from `update_stats`, over every rank
        (loss if s.live else loss * 0.0).backward()
        if after_backward is not None:
            after_backward()
        if s.live:
            lag = torch.tensor([version - v for v in s.token_policy_versions], device=logprobs.device)
            live.append((loss.detach(), {**b.recorded(), "lag": lag}))
    return to_host(live)


def to_host(live: list[tuple[torch.Tensor, dict[str, torch.Tensor]]]) -> list[Scored]:
    """The samples' losses and per-token values moved to the host in one copy (one sync a step, not
    one per sample and value): packed as float64, which holds float32, bool and small ints exactly."""
    if not live:
        return []
    keys = list(live[0][1])
    parts = [torch.stack([loss for loss, _ in live])] + [tokens[k] for _, tokens in live for k in keys]
    flat = torch.cat([p.reshape(-1).double() for p in parts]).cpu()  # the one device-to-host copy
    pieces = iter(flat.split([p.numel() for p in parts]))
    losses = next(pieces).tolist()
    out = []
    for loss, (_, tokens) in zip(losses, live):
        out.append(Scored(loss, {k: next(pieces).to(tokens[k].dtype).reshape(tokens[k].shape) for k in keys}))
    return out


@dataclass(frozen=True)
class AnchorDraw:
    """One optimizer step's demonstrations for the SFT anchor (`TrainConfig.anchor`)."""

    shards: list[list[StepSample]]
    """Per rank this process runs (the trainer: its own; replay: every recorded rank's), padded (`shard`)."""
    drawn: int
    """Demonstration steps drawn over all ranks: the anchor is `coef` x the mean of their NLLs."""


def draw_anchor(
    demonstrations: list[StepSample], config: TrainConfig, update_step: int, ranks: Iterable[int], world: int
) -> AnchorDraw | None:
    """The `anchor.steps` demonstration steps of optimizer step `update_step`, drawn from (seed,
    update_step) alone, so a restarted trainer and replay draw the same ones; None with the anchor off."""
    if not config.anchor.coef:
        return None
    if not demonstrations:
        raise ValueError(
            f"anchor.coef > 0 but runs {list(config.anchor.run_ids)} hold no successful "
            "demonstration steps with tokens (is the ledger synced?)"
        )
    rng = random.Random(f"anchor {config.seed} {update_step}")  # a str seed is hashed with sha512: stable
    drawn = rng.sample(demonstrations, min(config.anchor.steps, len(demonstrations)))
    return AnchorDraw([shard(drawn, r, world) for r in ranks], len(drawn))


def anchor_gradients(
    scorer: Scorer,
    demonstrations: list[StepSample],
    drawn: int,
    config: TrainConfig,
    after_backward: Callable[[], None] | None = None,
) -> list[float]:
    """One backward per demonstration step of `coef / drawn` x its mean NLL (`trainer.losses.anchor`)
    under the sampler's distribution, as the policy gradient scores; the live steps' NLLs."""
    nlls = []
    for s, inputs in scorer.samples(demonstrations):
        n = len(s.response_token_ids)
        logprobs, _ = score(scorer.model, inputs, n, scorer.suppress, config.temperature)  # [n]
        decision = functools.partial(
            decision_token_mask, scorer.tokenizer, s.response_token_ids, config.tokens.kind_decides
        )
        mask = anchor_mask(config.anchor.tokens, n, decision, logprobs.device)  # [n]
        nll = anchor_loss(logprobs, mask)  # 0-d
        loss = config.anchor.coef / drawn * nll
        (loss if s.live else loss * 0.0).backward()  # a padding step: the same collectives, no gradient
        if after_backward is not None:
            after_backward()
        if s.live:
            nlls.append(nll.detach())
    return torch.stack(nlls).cpu().tolist() if nlls else []  # one device-to-host copy


def anchor_stats(nlls: list[float]) -> dict[str, float]:
    """`anchor_nll`: the mean over the drawn demonstration steps of each one's mean NLL; fsum, so the
    order ranks' values arrive in does not matter. Empty with the anchor off."""
    return {"anchor_nll": math.fsum(nlls) / len(nlls)} if nlls else {}


@dataclass
class StepResult:
    lr: float
    scored: list[Scored]
    """The live samples this process scored, in its iteration order."""
    grad_norm: float
    """Global gradient norm before clipping."""
    anchor_nll: list[float] = field(default_factory=list)
    """The live demonstration steps' mean NLLs (`anchor_gradients`), in this process's order."""


class ShardedOptimizer(Protocol):
    """The gradient reduction, clip and AdamW of FSDP2 ranks: real (`trainer.sharding.FSDPOptimizer`)
    or emulated in one process for replay (`trainer.emulated_fsdp.EmulatedFSDP`)."""

    param_groups: list[dict]

    def zero_grad(self) -> None: ...

    def after_backward(self) -> None: ...

    def clip_and_step(self, max_norm: float) -> float: ...


def optimizer_step(
    scorer: Scorer,
    optimizer: ShardedOptimizer,
    config: TrainConfig,
    update_step: int,
    shards: list[list[StepSample]],
    num_trajectories: int,
    version: int,
    proximal: list[list[torch.Tensor]] | None,
    reference: list[list[torch.Tensor]] | None = None,
    anchor: AnchorDraw | None = None,
) -> StepResult:
    """One optimizer step, the trainer's and replay's alike: learning rate, gradients, clip, AdamW.

    `shards`: per rank, its padded samples (`shard`); `proximal`/`reference` likewise; `anchor`: the
    step's demonstrations (`draw_anchor`), for the same ranks. The trainer passes its own rank's;
    replay passes every recorded rank's, run micro-batch by micro-batch in rank order (`interleave`),
    which is the order `EmulatedFSDP` sums them in."""
    optimizer.zero_grad()
    lr = set_lr(optimizer, config, update_step)
    scored = accumulate_gradients(
        scorer,
        interleave(shards),
        num_trajectories,
        version,
        config,
        interleave(proximal) if proximal else None,
        interleave(reference) if reference else None,
        optimizer.after_backward,
    )
    nlls = (
        anchor_gradients(scorer, interleave(anchor.shards), anchor.drawn, config, optimizer.after_backward)
        if anchor
        else []
    )
    return StepResult(lr, scored, optimizer.clip_and_step(config.max_grad_norm), nlls)


def set_lr(optimizer, config: TrainConfig, update_step: int) -> float:
    """Set the schedule's rate (`TrainConfig.lr_at`) for optimizer step `update_step`; the trainer and replay
    both call this, so a replayed step uses the recorded rate. Returns it."""
    lr = config.lr_at(update_step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def update_stats(tokens: dict[str, torch.Tensor], config: TrainConfig) -> dict[str, float]:
    """Batch statistics from all ranks' per-token values (the issue's list, plus staleness and the
    sampler-vs-trainer mismatch, `trainer.mismatch`), computed as tensors and read in one `tolist`."""
    if tokens["logprobs"].numel() == 0:
        return {"tokens": 0.0}
    _, stats = policy_loss(config, PolicyBatch.concatenated(tokens))  # the loss's statistics, then these
    lag = tokens["lag"].double()
    stats.update(
        staleness_mean=lag.mean(),
        staleness_max=lag.max(),
        **mismatch_stats(tokens["proximal"], tokens["behave"], tokens["lag"]),
    )
    values = torch.stack([v.double() for v in stats.values()]).tolist()
    return dict(zip(stats, values))
