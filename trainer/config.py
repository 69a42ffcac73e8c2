"""The trainer's one config object: every field documented, the whole thing logged at start and
recorded in each `UpdateApplied.config_json`, so replay rebuilds exactly the update that ran."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from trainer.losses import GRPOConfig, PPOConfig


class TrainConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    run_id: str
    """The training run: the trainer consumes this run's groups and publishes its versions."""
    model_dir: Path | None = None
    """Initial HF model directory (version 0); None builds the project's tiny Qwen3-VL."""
    loss: Literal["grpo", "raft"] = "grpo"
    """`grpo`: decoupled PPO with group advantages; `raft`: RAFT++, successes only."""
    ppo: PPOConfig = PPOConfig()
    grpo: GRPOConfig = GRPOConfig()
    groups_per_update: int = Field(default=4, ge=1)
    """Task groups in one optimizer step (the batch)."""
    eta: int = Field(default=2, ge=0)
    """Staleness bound: a group is trained only if every token's version >= current - eta."""
    minibatches: int = Field(default=1, ge=1)
    """Optimizer steps per batch (PPO minibatches, split by group). With more than one, pi_prox is
    scored in a no-grad pass first and the clip engages from the second minibatch on."""
    dynamic_sampling: bool = True
    """Drop groups whose rewards are all equal (zero advantage), OpenWebRL's trajectory-level filter."""
    lr: float = Field(default=1e-4, gt=0)
    """AdamW learning rate (a 1.6M-parameter model collapsed its output format at >= 3e-4)."""
    weight_decay: float = 0.0
    max_grad_norm: float = Field(default=1.0, gt=0)
    """Global gradient-norm clip."""
    entropy_coef: float = 0.0
    """Entropy bonus per token weight (a guard against format collapse); 0 disables it."""
    temperature: float = 1.0
    """Sampling temperature of the rollout policy; log-probs are computed at the same temperature."""
    max_updates: int | None = None
    """Stop after this many optimizer steps (counting from version 0); None runs forever."""
    batch_timeout_s: float | None = None
    """Give up if no full batch arrives for this long (tests, finite runs); None waits forever."""
    slow_s: float = 0.0
    """Extra seconds per update, to study a slow trainer (staleness drops, dispatcher pausing)."""
    seed: int = 0
    consumer_group: str = ""
    """Kafka consumer group of the batch builder; empty means `trainer-<run_id>`."""

    @property
    def group_id(self) -> str:
        return self.consumer_group or f"trainer-{self.run_id}"
