"""The trainer's one config object: every field documented, the whole thing logged at start and
recorded in each `UpdateApplied.config_json`, so replay rebuilds exactly the update that ran."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trainer.losses import AnchorTokens, GRPOConfig, PPOConfig, TokenSelection

LossName = Literal["grpo", "raft"]


class AnchorConfig(BaseModel):
    """An SFT anchor on demonstrations beside the RL loss (InstructGPT's PPO-ptx, `trainer.losses.anchor`):
    each optimizer step adds `coef` x the mean NLL of `steps` demonstration steps drawn from `run_ids`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    coef: float = Field(default=0.0, ge=0)
    """gamma: the anchor's weight against the RL loss; 0 disables it (no demonstration is read)."""
    run_ids: tuple[str, ...] = ()  # a tuple, not a list: the config stays hashable
    """Runs whose successful trajectories are the demonstrations (`trainer.sft.demonstrations`): the
    warm start's own, e.g. `<run>-demos` of `app.learning`."""
    steps: int = Field(default=8, ge=1)
    """Demonstration steps per optimizer step, drawn from (seed, update step): replay draws the same."""
    tokens: AnchorTokens = "scaffold"
    """`scaffold`: every response token but the action's values (the decision is RL's to change);
    `all`: every response token."""

    @model_validator(mode="after")
    def _needs_demonstrations(self) -> AnchorConfig:
        if self.coef > 0 and not self.run_ids:
            raise ValueError(
                f"anchor.coef = {self.coef} > 0 needs anchor.run_ids: the runs whose successful "
                "trajectories are the demonstrations (e.g. the warm start's `<run>-demos`)"
            )
        return self


class TrainConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    run_id: str
    """The training run: the trainer consumes this run's groups and publishes its versions."""
    model_dir: Path | None = None
    """Initial HF model directory (version 0); None builds the project's tiny Qwen3-VL."""
    loss: LossName = "grpo"
    """`grpo`: decoupled PPO with group advantages; `raft`: RAFT++, successes only."""
    ppo: PPOConfig = PPOConfig()
    grpo: GRPOConfig = GRPOConfig()
    tokens: TokenSelection = TokenSelection()
    """Which response tokens carry the policy gradient and the KL penalty (`trainer.losses.tokens`):
    `tokens.pg=action` puts the gradient on the action's values only."""
    anchor: AnchorConfig = AnchorConfig()
    """An SFT anchor on the warm start's demonstrations (PPO-ptx): `anchor.coef` x their NLL is added to
    each optimizer step's loss, which holds the output format RL otherwise wears away."""
    groups_per_update: int = Field(default=4, ge=1)
    """Task groups in one optimizer step (the batch)."""
    eta: int = Field(default=2, ge=0)
    """Staleness bound: a group is trained only if every token's version >= current - eta."""
    minibatches: int = Field(default=1, ge=1)
    """Optimizer steps per batch (PPO minibatches, split by group). With more than one, pi_prox is
    scored in a no-grad pass first and the clip engages from the second minibatch on."""
    ppo_epochs: int = Field(default=1, ge=1)
    """Passes over the batch's minibatches (PPO epochs): `ppo_epochs * minibatches` optimizer steps per
    version. From the second step on pi_theta differs from pi_prox, so the clip and `approx_kl` act."""
    target_kl: float | None = Field(default=None, gt=0)
    """Skip a batch's remaining optimizer steps once a step's `approx_kl` exceeds this. A step measures
    the KL of the weights it starts from against pi_prox, so the stop follows the step that saw the
    drift (the update it made is kept). None never stops early."""
    dynamic_sampling: bool = True
    """Drop groups whose rewards are all equal (zero advantage), OpenWebRL's trajectory-level filter."""
    lr: float = Field(default=1e-4, gt=0)
    """AdamW learning rate (a 1.6M-parameter model collapsed its output format at >= 3e-4)."""
    warmup_updates: int = Field(default=0, ge=0)
    """Linear learning-rate warm-up over this many optimizer steps. Adam's first steps move every
    weight by about lr whatever the gradient's size; on small, noisy RL batches that alone can break
    a small model's output format, so the rate ramps up while Adam's moment estimates settle."""
    decay_updates: int | None = Field(default=None, ge=1)
    """Linear decay of the rate from `lr` (after warm-up) to `lr * min_lr_ratio` at this optimizer step;
    None keeps it constant."""
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    weight_decay: float = 0.0
    adam_eps: float = Field(default=1e-8, gt=0)
    """AdamW's epsilon. Adam moves a weight by about lr whatever its gradient's size; a weight whose
    gradient is far below `adam_eps` moves in proportion to it instead. RL's noisy, sparse gradients
    move every weight by lr at the default (torch's 1e-8); CleanRL's PPO uses 1e-5."""
    max_grad_norm: float = Field(default=1.0, gt=0)
    """Global gradient-norm clip."""
    entropy_coef: float = 0.0
    """Entropy bonus per token weight (a guard against format collapse); 0 disables it."""
    kl_coef: float = Field(default=0.0, ge=0)
    """beta of a KL penalty to the reference policy, the run's version 0 (`trainer.losses.kl`), weighted
    per token like the objective; 0 loads no reference model. It keeps a small model near the SFT
    policy whose output format it learned."""
    temperature: float = 1.0
    """Sampling temperature of the rollout policy; log-probs are computed at the same temperature."""
    max_updates: int | None = None
    """Stop after this many optimizer steps (counting from version 0); None runs forever."""
    batch_timeout_s: float | None = None
    """Give up if no full batch arrives for this long (tests, finite runs); None waits forever."""
    slow_s: float = 0.0
    """Extra seconds per update, to study a slow trainer (staleness drops, dispatcher pausing)."""
    control: Literal["none", "shuffled_rewards"] = "none"
    """A negative control: `shuffled_rewards` permutes each group's rewards (seeded by the group id)
    before its advantages are computed, so the advantages carry no information about the actions and
    nothing should be learned. A learning claim is only as good as its control."""
    activation_checkpointing: bool = False
    """Recompute each vision and decoder block's activations in backward instead of keeping them: less
    memory for long multi-step screenshot prompts, about a third more compute."""
    bf16: bool = True
    """On GPU: bf16 parameters in forward and backward, fp32 gradient reduction and master weights
    (FSDP2's mixed precision). CPU runs stay fp32, which is what replay reproduces bit for bit."""
    seed: int = 0
    push_address: str | None = None
    """"host:port" where rank 0 serves the direct weight push (`model.push`): a sampler started with
    the same address loads each version from it instead of the object store. None: the store only."""
    consumer_group: str = ""
    """Kafka consumer group of the batch builder; empty means `trainer-<run_id>`."""

    @property
    def group_id(self) -> str:
        return self.consumer_group or f"trainer-{self.run_id}"

    def lr_at(self, update_step: int) -> float:
        """The learning rate of optimizer step `update_step` (0-based, counted over the whole run)."""
        scale = min(1.0, (update_step + 1) / self.warmup_updates) if self.warmup_updates else 1.0
        if self.decay_updates is not None:
            done = min(
                1.0, max(0, update_step - self.warmup_updates) / max(1, self.decay_updates - self.warmup_updates)
            )
            scale *= 1.0 - (1.0 - self.min_lr_ratio) * done
        return self.lr * scale
