"""The learning curve's held-out points: every stage measured on the same instances, and the paired
differences between them (RL - SFT, RL - the sharpest SFT), `rollout.evaluate` underneath."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors.torch import load_file

from pipeline.bus import EventProducer
from pipeline.hashing import weights_sha256
from pipeline.settings import StackSettings
from rollout.evaluate import (
    Difference,
    EvalPolicy,
    InstanceCounts,
    instance_ids,
    read_back,
    read_instances,
    run_instances,
)
from schemas import EvaluationCompleted

if TYPE_CHECKING:
    from app.learning import LearningConfig, LearningCurve


@dataclass
class CurvePoint:
    stage: str
    policy_version: int
    episodes: int
    successes: int
    ci95: tuple[float, float]
    train_s: float
    eval_run_id: str
    temperature: float = 1.0
    samples: int = 1
    """Episodes per instance (`episodes` / `samples` instances, the same at every point of a run)."""
    invalid_share: float = 0.0
    """Share of the evaluation's steps whose output was not a valid action."""

    @property
    def rate(self) -> float:
        return self.successes / max(self.episodes, 1)


def eval_split(config: LearningConfig) -> str:
    return config.eval_split or ("test" if config.suite == "miniwob" else "heldout")


def eval_design(config: LearningConfig) -> tuple[tuple[str, ...], int]:
    """(instances, episodes per instance) of every held-out evaluation: `eval_episodes / eval_samples`
    instances, or all the split has, each run at least `eval_samples` times and about `eval_episodes`
    episodes in all."""
    everything = instance_ids(config.suite, eval_split(config), config.difficulty, config.templates)
    n = min(len(everything), max(1, math.ceil(config.eval_episodes / config.eval_samples)))
    return everything[:n], max(config.eval_samples, math.ceil(config.eval_episodes / n))


def sharpening_stage(temperature: float) -> str:
    """The stage name of the SFT policy evaluated at `temperature` (`LearningConfig.sharpening`)."""
    return f"sft-t{temperature:g}"


class Evaluator:
    """Measures each point of the curve on the same held-out instances (`eval_design`) and keeps every
    point's per-instance counts, for the paired differences."""

    def __init__(
        self,
        settings: StackSettings,
        config: LearningConfig,
        run_id: str,
        producer: EventProducer,
        curve: LearningCurve,
        say: Callable[[str], None],
    ):
        self.settings, self.config, self.run_id, self.producer, self.curve, self.say = (
            settings,
            config,
            run_id,
            producer,
            curve,
            say,
        )
        self.task_ids, self.samples = eval_design(config)
        self.counts: dict[str, InstanceCounts] = {}
        """Stage -> its outcomes per instance (a stage measured by `sft_measured_by` too)."""

    def __call__(
        self,
        stage: str,
        model_dir: Path,
        version: int,
        train_s: float,
        temperature: float | None = None,
        samples: int | None = None,
    ) -> CurvePoint:
        c, split = self.config, eval_split(self.config)
        policy = EvalPolicy(
            stage, model_dir, c.temperature if temperature is None else temperature, samples=samples or self.samples
        )
        self.say(
            f"evaluating the {stage} policy: {len(self.task_ids)} instances x {policy.samples} "
            f"episode{'s' if policy.samples > 1 else ''}, "
            f"T={policy.temperature:g}, {c.suite} {split} {c.difficulty or ''}"
        )
        run = f"{self.run_id}-eval-{stage}"
        run_instances(
            self.settings,
            policy,
            self.task_ids,
            policy.samples,
            c.suite,
            split,
            run,
            workers=c.eval_workers or c.workers,
        )
        (counts,) = read_back(self.settings, [(policy, run, len(self.task_ids) * policy.samples)], self.task_ids)
        self.counts[stage] = counts
        result = counts.total
        point = CurvePoint(
            stage,
            version,
            result.episodes,
            result.successes,
            result.ci95,
            train_s,
            run,
            policy.temperature,
            policy.samples,
            counts.invalid_share,
        )
        self.curve.points.append(point)
        self.producer.publish(
            EvaluationCompleted(
                run_id=self.run_id,
                stage=stage,
                eval_run_id=run,
                policy_version=version,
                checkpoint_sha256=_weights_sha256(model_dir),
                suite=c.suite,
                split=split,
                difficulty=c.difficulty,
                episodes=result.episodes,
                successes=result.successes,
                ci95_low=result.ci95[0],
                ci95_high=result.ci95[1],
                train_s=train_s,
                temperature=policy.temperature,
                samples=policy.samples,
                invalid_share=counts.invalid_share,
            )
        ).get(timeout=60)
        self.say(f"  {stage}: {counts}")
        return point

    def recall(self, stage: str, measured_by: str) -> None:
        """`stage` as the run `measured_by` measured it (its evaluation run in the ledger), if it ran
        these instances: a run sharing another's warm start is paired with that run's SFT points."""
        counts = read_instances(self.settings, f"{measured_by}-eval-{stage}", self.task_ids, stage)
        if all(counts.episodes):
            self.counts[stage] = counts
        else:
            self.say(f"  {stage}: {measured_by} did not measure it on these instances (not paired)")

    def differences(self) -> list[Difference]:
        return rl_gains(self.counts, self.config.sharpening)


def rl_gains(counts: dict[str, InstanceCounts], sharpening: tuple[float, ...]) -> list[Difference]:
    """From each stage's per-instance outcomes: RL - SFT, then RL - the best SFT temperature (the highest
    success of `sft` and its `sharpening` stages) when that is not the SFT point itself; [] without
    both an `rl` and an `sft` stage."""
    rl, sft = counts.get("rl"), counts.get("sft")
    if rl is None or sft is None:
        return []
    baselines = [sft, *(counts[s] for s in map(sharpening_stage, sharpening) if s in counts)]
    best = max(baselines, key=lambda b: b.total.rate)
    return [rl.minus(sft)] + ([rl.minus(best)] if best is not sft else [])


def _weights_sha256(model_dir: Path) -> str:
    return weights_sha256(load_file(Path(model_dir) / "model.safetensors"))
