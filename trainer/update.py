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
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from model.inputs import forward_log_softmax, inputs_from_ids
from model.tiny_vlm import load_tiny_vlm
from trainer.batch import TrainGroup
from trainer.config import TrainConfig
from trainer.losses import decoupled_ppo_objective, grpo_loss, kl_to_reference, raft_advantages, token_weights


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


def flatten(batch: list[TrainGroup]) -> tuple[list[StepSample], int]:
    """Steps with tokens, in batch order, and B (trajectories in the batch, the loss's 1/B)."""
    samples, trajectories = [], 0
    for g in batch:
        for steps, advantage, reward in zip(g.trajectories, g.advantages, g.completed.rewards):
            trajectories += 1
            samples += [StepSample(s.prompt_token_ids, s.response_token_ids, s.prompt_screenshot_sha256,
                                   s.behave_logprobs, s.token_policy_versions, advantage, len(steps), reward > 0)
                        for s in steps if s.response_token_ids]
    return samples, trajectories


def shard(samples: list[StepSample], rank: int, world_size: int) -> list[StepSample]:
    """This rank's samples: longest first, dealt round-robin, so ranks get similar token counts."""
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i].prompt_token_ids + samples[i].response_token_ids))
    return [samples[i] for i in order[rank::world_size]]


def prefetch(samples: list[StepSample], fetch: Callable[[str], bytes], ahead: int = 4
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


@dataclass
class _Token:
    """Per-token detached values of a shard, kept for the update's statistics."""

    logprobs: list[torch.Tensor]
    proximal: list[torch.Tensor]
    behave: list[torch.Tensor]
    advantages: list[torch.Tensor]
    mask: list[torch.Tensor]
    weights: list[torch.Tensor]
    success: list[torch.Tensor]
    entropy: list[torch.Tensor]
    reference: list[torch.Tensor]
    lag: list[torch.Tensor]


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
            inputs = inputs_from_ids(self.tokenizer, s.prompt_token_ids + s.response_token_ids, images,
                                     self.image_processor)
            yield s, {k: v.to(device) for k, v in inputs.items()}

    def frozen(self, model_dir: Path) -> Scorer:
        """The same input builders over a frozen model loaded from `model_dir` (the KL reference)."""
        model = load_tiny_vlm(model_dir)[0].to(next(self.model.parameters()).device).eval().requires_grad_(False)
        return replace(self, model=model)


@torch.no_grad()
def response_logprobs(scorer: Scorer, samples: list[StepSample], temperature: float) -> list[torch.Tensor]:
    """Log-probs of every sample's response tokens under the scorer's model, with no gradient: pi_prox
    (the weights at the start of the batch) or pi_ref (`Scorer.frozen`)."""
    return [score(scorer.model, inputs, len(s.response_token_ids), scorer.suppress, temperature)[0]
            for s, inputs in scorer.samples(samples)]


def accumulate_gradients(scorer: Scorer, samples: list[StepSample], num_trajectories: int, version: int,
                         config: TrainConfig, proximal: list[torch.Tensor] | None = None,
                         reference: list[torch.Tensor] | None = None) -> tuple[float, dict[str, torch.Tensor]]:
    """Backward over this rank's samples (gradients accumulate in `.grad`); the shard's loss and
    its detached per-token tensors (concatenated) for `update_stats`. `proximal`: per-sample
    log pi_prox when the weights have moved since the batch started (else this forward's own);
    `reference`: per-sample log pi_ref, needed when `config.kl_coef` > 0."""
    if config.kl_coef and reference is None:
        raise ValueError("kl_coef > 0 needs the reference policy's log-probs (`Scorer.frozen`)")
    acc = _Token([], [], [], [], [], [], [], [], [], [])
    total = 0.0
    for i, (s, inputs) in enumerate(scorer.samples(samples)):
        n = len(s.response_token_ids)
        logprobs, entropy = score(scorer.model, inputs, n, scorer.suppress, config.temperature)  # [n], [n]
        prox = logprobs.detach() if proximal is None else proximal[i]  # [n]
        dev = logprobs.device
        behave = torch.tensor(s.behave_logprobs, dtype=logprobs.dtype, device=dev)  # [n]
        success = torch.full((n,), s.success, device=dev)  # [n]
        mask = torch.ones(n, dtype=torch.bool, device=dev)  # [n]
        advantages = torch.full((n,), s.advantage, dtype=logprobs.dtype, device=dev)  # [n]
        step_tokens = torch.full((n,), n, device=dev)  # [n] |o_{i,t}|
        trajectory_steps = torch.full((n,), s.trajectory_steps, device=dev)  # [n] |tau_i|
        if config.loss == "raft":
            advantages, mask = raft_advantages(success, mask)
        objective, _ = decoupled_ppo_objective(logprobs, prox, behave, advantages, mask, config.ppo)
        loss, _ = grpo_loss(objective, step_tokens, trajectory_steps, success, num_trajectories, config.grpo)
        w = token_weights(step_tokens, trajectory_steps, num_trajectories, config.grpo, logprobs.dtype)  # [n]
        if config.entropy_coef:
            loss = loss - config.entropy_coef * (w * entropy * mask).sum()
        ref = reference[i] if reference is not None else torch.zeros(0)  # [n] or [0]
        if config.kl_coef:
            loss = loss + config.kl_coef * (w * kl_to_reference(logprobs, ref) * mask).sum()
        loss.backward()
        total += loss.item()
        for name, value in (("logprobs", logprobs), ("proximal", prox), ("behave", behave), ("advantages", advantages), ("mask", mask),
                            ("weights", w), ("success", success), ("entropy", entropy), ("reference", ref),
                            ("lag", torch.tensor([version - v for v in s.token_policy_versions]))):
            getattr(acc, name).append(value.detach().cpu())
    return total, {k: torch.cat(v) if v else torch.zeros(0) for k, v in vars(acc).items()}


@dataclass
class StepResult:
    lr: float
    loss: float
    """Sum of the shards' losses (this process's share of the batch loss)."""
    tokens: list[dict[str, torch.Tensor]]
    """Per shard: its detached per-token tensors, for `update_stats`."""
    grad_norm: float
    """Global gradient norm before clipping."""


def optimizer_step(scorer: Scorer, optimizer: torch.optim.Optimizer, config: TrainConfig, update_step: int,
                   shards: list[list[StepSample]], num_trajectories: int, version: int,
                   proximal: list[list[torch.Tensor]] | None, reduce_gradients: Callable[[torch.nn.Module], None],
                   reference: list[list[torch.Tensor]] | None = None) -> StepResult:
    """One optimizer step, the trainer's and replay's alike: learning rate, gradients, their reduction
    over ranks, clipping, AdamW.

    `shards`: the trainer passes its own rank's samples and `reduce_gradients` sums them over the
    ranks; replay passes every recorded rank's shard, each accumulated from zero and summed here in rank
    order (the all-reduce's arithmetic, so a 2-rank update replays bit for bit in one process)."""
    params = list(scorer.model.parameters())
    optimizer.zero_grad(set_to_none=False)
    lr = set_lr(optimizer, config, update_step)
    loss, tokens, grads = 0.0, [], []
    for i, samples in enumerate(shards):
        if len(shards) > 1:
            for p in params:
                p.grad = torch.zeros_like(p)
        shard_loss, shard_tokens = accumulate_gradients(scorer, samples, num_trajectories, version, config,
                                                        proximal[i] if proximal else None,
                                                        reference[i] if reference else None)
        loss, tokens = loss + shard_loss, tokens + [shard_tokens]
        grads.append([p.grad for p in params])
    if len(shards) > 1:
        for j, p in enumerate(params):
            p.grad = sum((g[j] for g in grads[1:]), grads[0][j])
    reduce_gradients(scorer.model)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm).item()
    optimizer.step()
    return StepResult(lr, loss, tokens, grad_norm)


def all_reduce_gradients(model: torch.nn.Module, world: int) -> None:
    """Sum gradients over ranks in one flat buffer (parameters a rank did not use count as zero)."""
    if world == 1:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for p, g in zip(model.parameters(), grads):
        p.grad = flat[offset:offset + g.numel()].view_as(g).clone()
        offset += g.numel()


def set_lr(optimizer: torch.optim.Optimizer, config: TrainConfig, update_step: int) -> float:
    """Set the schedule's rate (`TrainConfig.lr_at`) for optimizer step `update_step`; the trainer and replay
    both call this, so a replayed step uses the recorded rate. Returns it."""
    lr = config.lr_at(update_step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def update_stats(tokens: dict[str, torch.Tensor], config: TrainConfig) -> dict[str, float]:
    """Batch statistics from all ranks' per-token values (the issue's list, plus staleness)."""
    if tokens["logprobs"].numel() == 0:
        return {"tokens": 0.0}
    lp, mask = tokens["logprobs"], tokens["mask"]
    _, ppo = decoupled_ppo_objective(lp, tokens["proximal"], tokens["behave"], tokens["advantages"], mask, config.ppo)
    success = tokens["success"]
    lag = tokens["lag"].float()
    kl = {"kl_ref": kl_to_reference(lp, tokens["reference"])[mask].mean().item()} if tokens["reference"].numel() else {}
    return {
        **ppo,
        **kl,
        "tokens": float(lp.numel()),
        "entropy": tokens["entropy"].mean().item(),
        "weight_mass_failure": tokens["weights"][~success].sum().item(),
        "weight_mass_success": tokens["weights"][success].sum().item(),
        "staleness_mean": lag.mean().item(),
        "staleness_max": lag.max().item(),
    }
