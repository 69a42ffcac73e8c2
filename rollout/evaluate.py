"""Success rate of a policy on held-out tasks, with a 95% confidence interval; and paired evaluations.

Episodes are sampled at the policy's temperature (1 by default, the distribution RL trains), so
repeated episodes of the same task are independent draws and the binomial interval is honest; a
greedy policy on deterministic pages would repeat itself and overstate the sample size.

`evaluate` runs independent single-episode groups. Two policies measured that way see different
instances, and the spread of instance difficulty swamps a difference of +0.05. A *paired* evaluation
(`evaluate_paired`) runs every policy on the same instances (task ids: the first `instances` of a
fixed seeded order of the split), `samples` episodes each (one group per instance), reads the
per-instance outcomes back from the ledger (`InstanceCounts`), and puts an interval on the difference
of two policies by resampling instances (`paired_difference`, a bootstrap clustered by instance).
"""

from __future__ import annotations

import math
import random
import re
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.ledger import LedgerWriter, read_events
from pipeline.settings import StackSettings
from rollout.episode import EpisodeConfig
from rollout.pool import PoolStats
from rollout.run import RolloutRequest, make_suite, run_rollout
from schemas.observation import Difficulty, PolicyName, Split, SuiteName


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (better than the normal one near 0 and 1)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def two_proportion_z(a_successes: int, a_n: int, b_successes: int, b_n: int) -> tuple[float, float]:
    """The difference b - a of two success rates and its pooled two-proportion z statistic."""
    pa, pb = a_successes / max(a_n, 1), b_successes / max(b_n, 1)
    pooled = (a_successes + b_successes) / max(a_n + b_n, 1)
    se = math.sqrt(max(pooled * (1 - pooled) * (1 / max(a_n, 1) + 1 / max(b_n, 1)), 1e-12))
    return pb - pa, (pb - pa) / se


@dataclass(frozen=True)
class EvalResult:
    run_id: str
    episodes: int
    successes: int

    @property
    def rate(self) -> float:
        return self.successes / max(self.episodes, 1)

    @property
    def ci95(self) -> tuple[float, float]:
        return wilson_interval(self.successes, self.episodes)

    def __str__(self) -> str:
        lo, hi = self.ci95
        return f"success {self.rate:.3f} (95% CI {lo:.3f}-{hi:.3f}, {self.successes}/{self.episodes})"


@dataclass(frozen=True)
class EvalConfig:
    """`awrl eval`: one policy's held-out success in independent episodes (`evaluate`) or, with `models`,
    several model directories on the same instances (`evaluate_paired`). The defaults are those of both
    functions (tests/test_cli.py checks that they agree)."""

    policy: PolicyName = "local"
    """Policy backend (see `awrl rollout --help`); `models` are always run with the local policy."""
    model_dir: Path | None = None
    """HF model directory of the local policy; None: the untrained tiny VLM."""
    suite: SuiteName = "sites"
    """Task suite: sites, miniwob or boxes."""
    split: Split = "heldout"
    """Task split to evaluate on."""
    difficulty: Difficulty | None = "easy"
    """Only tasks of this difficulty; None: all."""
    templates: tuple[str, ...] | None = None
    """Only tasks of these templates; None: all."""
    episodes: int = 100
    """Independent episodes (without `models`)."""
    workers: int = 2
    """Browsers kept alive."""
    som: bool = True
    """Set-of-Mark observations instead of pure pixels."""
    temperature: float = 1.0
    """Sampling temperature (independent episodes need > 0); also each of `models` without its own."""
    models: tuple[Path, ...] = ()
    """Paired evaluation: model directories (local policy), every one run on the same instances."""
    labels: tuple[str, ...] = ()
    """Name of each of `models`, in order (default: its folder)."""
    model_temperatures: tuple[float, ...] = ()
    """Temperature of each of `models`, in order (default: `temperature`)."""
    samples: int = 4
    """`models`: episodes per instance."""
    instances: int | None = None
    """`models`: the first N instances of a fixed seeded order of the split; None: all."""
    run_id: str = ""
    """Evaluation run id (default: a new one); each of `models` runs as `<run_id>-<label>`."""

    def __post_init__(self) -> None:
        for name in ("episodes", "workers", "samples", "instances"):
            if (value := getattr(self, name)) is not None and value < 1:
                raise ValueError(f"{name.replace('_', '-')}: must be at least 1, got {value}")


def evaluate(
    settings: StackSettings,
    policy: str = "local",
    model_dir: Path | None = None,
    suite: str = "sites",
    split: str = "heldout",
    difficulty: str | None = "easy",
    episodes: int = 100,
    workers: int = 2,
    som: bool = True,
    temperature: float = 1.0,
    run_id: str = "",
    show_progress: bool = True,
    templates: tuple[str, ...] | None = None,
) -> EvalResult:
    """Run `episodes` single-episode groups of the split's tasks; the run is in the event log like any other."""
    run_id = run_id or f"eval-{uuid.uuid4().hex[:8]}"
    req = RolloutRequest(
        suite=suite,
        policy=policy,
        workers=workers,
        group_size=1,
        episodes=episodes,
        split=split,
        difficulty=difficulty,
        run_id=run_id,
        model_dir=model_dir,
        temperature=temperature,
        episode=EpisodeConfig(som=som),
        templates=templates,
    )
    stats = run_rollout(settings, req, show_progress)
    return EvalResult(run_id, stats.episodes, stats.successes)


# -- paired evaluation ----------------------------------------------------------------------------------

INSTANCE_SEED = 0
"""Seed of the instance order: fixed, so that every policy, every point of a learning run and every run
of the same configuration is measured on the same held-out instances."""


def paired_difference(
    a_successes: Sequence[int],
    a_episodes: Sequence[int],
    b_successes: Sequence[int],
    b_episodes: Sequence[int],
    resamples: int = 2000,
    seed: int = 0,
    level: float = 0.95,
) -> tuple[float, float, float]:
    """(b - a, low, high): the difference of two success rates measured on the same instances, with a
    percentile bootstrap interval (Efron & Tibshirani 1993) clustered by instance: the unit resampled is
    the instance, not the episode (paired differences and clustered errors, as Miller 2024, "Adding
    Error Bars to Evals", recommends for model evaluations).

    Element i of each sequence is instance i: its successes and episodes under policy a and under b.
    A rate is successes over episodes of the instances drawn (a ratio of sums, so policies with
    different samples per instance compare), and each of `resamples` replicates draws the instances
    with replacement, the same draw for both policies: what is common to an instance (its difficulty)
    cancels, which is what makes the interval narrow where independent samples' would not be."""
    a_k, a_n, b_k, b_n = (np.asarray(x, dtype=np.float64) for x in (a_successes, a_episodes, b_successes, b_episodes))
    if not (len(a_k) == len(a_n) == len(b_k) == len(b_n)):
        raise ValueError("every sequence needs one entry per instance")
    if len(a_k) == 0:
        raise ValueError("no instances to compare")
    diff = b_k.sum() / max(b_n.sum(), 1) - a_k.sum() / max(a_n.sum(), 1)
    draws = np.random.default_rng(seed).integers(0, len(a_k), size=(resamples, len(a_k)))  # [resamples, instances]
    replicates = b_k[draws].sum(1) / np.maximum(b_n[draws].sum(1), 1) - a_k[draws].sum(1) / np.maximum(
        a_n[draws].sum(1), 1
    )  # [resamples]
    low, high = np.quantile(replicates, [(1 - level) / 2, (1 + level) / 2])
    return float(diff), float(low), float(high)


@dataclass(frozen=True)
class EvalPolicy:
    """One policy of a paired evaluation."""

    label: str
    """Its name in reports; also names its evaluation run (`<run_id>-<label>`)."""
    model_dir: Path | None = None
    """HF model directory (`local` policy); None: the untrained tiny VLM."""
    temperature: float = 1.0
    """Sampling temperature (0: greedy; one episode per instance says all it can, see `samples`)."""
    policy: PolicyName = "local"
    samples: int | None = None
    """Episodes per instance; None: the evaluation's."""


@dataclass(frozen=True)
class InstanceCounts:
    """One policy's outcomes per instance, read back from its evaluation run in the ledger."""

    label: str
    run_id: str
    temperature: float
    task_ids: tuple[str, ...]
    successes: tuple[int, ...]
    """Successful episodes of each instance (in `task_ids` order)."""
    episodes: tuple[int, ...]
    """Episodes of each instance (its samples; env errors count as episodes that did not succeed)."""
    steps: int
    invalid_steps: int
    """Steps whose model output was not an action (`error_class` `invalid_action`)."""
    env_errors: int = 0
    """Episodes the environment failed (counted as not successful; many mean a broken stack, not a policy)."""

    @property
    def total(self) -> EvalResult:
        return EvalResult(self.run_id, sum(self.episodes), sum(self.successes))

    @property
    def invalid_share(self) -> float:
        return self.invalid_steps / max(self.steps, 1)

    def minus(self, other: InstanceCounts, resamples: int = 2000, seed: int = 0) -> Difference:
        """This policy's success rate minus `other`'s, on the instances both ran (`paired_difference`)."""
        if set(self.task_ids) != set(other.task_ids):
            raise ValueError(f"{self.label} and {other.label} ran different instances: not a paired comparison")
        theirs = dict(zip(other.task_ids, zip(other.successes, other.episodes)))
        a = [theirs[t] for t in self.task_ids]
        diff, low, high = paired_difference(
            [k for k, _ in a], [n for _, n in a], self.successes, self.episodes, resamples, seed
        )
        return Difference(self.label, other.label, diff, (low, high), len(self.task_ids))

    def __str__(self) -> str:
        return f"{self.total}, invalid actions {self.invalid_share:.3f}" + (
            f", {self.env_errors} env errors" if self.env_errors else ""
        )


@dataclass(frozen=True)
class Difference:
    """`minuend` - `subtrahend` in success rate, paired by instance, with its bootstrap 95% interval."""

    minuend: str
    subtrahend: str
    diff: float
    ci95: tuple[float, float]
    instances: int

    def __str__(self) -> str:
        lo, hi = self.ci95
        return (
            f"{self.minuend} - {self.subtrahend}: {self.diff:+.3f} (95% CI {lo:+.3f} to {hi:+.3f}, "
            f"paired bootstrap over {self.instances} instances)"
        )


@dataclass(frozen=True)
class PairedEvaluation:
    run_id: str
    task_ids: tuple[str, ...]
    policies: tuple[InstanceCounts, ...]

    def differences(self) -> list[Difference]:
        """Each policy after the first minus the first."""
        return [p.minus(self.policies[0]) for p in self.policies[1:]]


def instance_ids(
    suite: SuiteName,
    split: Split,
    difficulty: Difficulty | None = None,
    templates: tuple[str, ...] | None = None,
    instances: int | None = None,
    seed: int = INSTANCE_SEED,
) -> tuple[str, ...]:
    """The evaluated instances: the first `instances` (None: all) of a seeded shuffle of the split's
    tasks of `difficulty` and `templates`. The same arguments give the same ids."""
    tasks = [
        t.task_id
        for t in make_suite(suite).tasks(split)
        if difficulty in (None, t.difficulty) and (templates is None or t.template in templates)
    ]
    if not tasks:
        raise ValueError(
            f"no {suite} tasks in split {split!r}"
            + (f" of difficulty {difficulty}" if difficulty else "")
            + (f" and templates {', '.join(templates)}" if templates else "")
        )
    random.Random(seed).shuffle(tasks)
    return tuple(tasks[:instances])


def run_instances(
    settings: StackSettings,
    policy: EvalPolicy,
    task_ids: Sequence[str],
    samples: int,
    suite: SuiteName,
    split: Split,
    run_id: str,
    workers: int = 2,
    som: bool = True,
    show_progress: bool = True,
) -> PoolStats:
    """Run each instance once as a group of `samples` episodes (`policy.samples` if set) under `run_id`."""
    samples = policy.samples or samples
    return run_rollout(
        settings,
        RolloutRequest(
            suite=suite,
            policy=policy.policy,
            workers=workers,
            group_size=samples,
            episodes=len(task_ids) * samples,
            split=split,
            task_ids=tuple(task_ids),
            run_id=run_id,
            model_dir=policy.model_dir,
            temperature=policy.temperature,
            episode=EpisodeConfig(som=som),
        ),
        show_progress,
    )


def read_instances(
    settings: StackSettings, run_id: str, task_ids: Sequence[str], label: str = "", temperature: float = 1.0
) -> InstanceCounts:
    """`run_id`'s episodes and steps as the ledger holds them, counted per instance of `task_ids`."""
    finished = read_events(settings, run_id, "EpisodeFinished", ["task_id", "outcome"]).to_pylist()
    episodes = Counter(e["task_id"] for e in finished)
    successes = Counter(e["task_id"] for e in finished if e["outcome"] == "success")
    errors = read_events(settings, run_id, "StepRecorded", ["error_class"]).column("error_class").to_pylist()
    return InstanceCounts(
        label or run_id,
        run_id,
        temperature,
        tuple(task_ids),
        tuple(successes[t] for t in task_ids),
        tuple(episodes[t] for t in task_ids),
        len(errors),
        sum(e == "invalid_action" for e in errors),
        sum(e["outcome"] == "env_error" for e in finished),
    )


def read_back(
    settings: StackSettings,
    runs: Sequence[tuple[EvalPolicy, str, int]],
    task_ids: Sequence[str],
    timeout_s: float = 120.0,
) -> list[InstanceCounts]:
    """Write the log to the ledger, then count each (policy, run id, episodes it ran) as
    `read_instances` does; waits (up to `timeout_s`) for episodes another ledger writer still holds."""
    LedgerWriter(settings).sync(idle_exit_s=3.0)
    deadline = time.monotonic() + timeout_s
    while True:
        counts = [read_instances(settings, run, task_ids, p.label, p.temperature) for p, run, _ in runs]
        short = [(c, n) for c, (_, _, n) in zip(counts, runs) if sum(c.episodes) < n]
        if not short:
            return counts
        if time.monotonic() > deadline:
            c, n = short[0]
            raise RuntimeError(
                f"evaluation run {c.run_id}: {sum(c.episodes)} of its {n} episodes reached the "
                f"ledger in {timeout_s:g} s (is a ledger writer running? `awrl ledger sync`)"
            )
        time.sleep(2.0)


def run_label(label: str) -> str:
    """A label as it may appear in a run id."""
    return re.sub(r"[^A-Za-z0-9._+-]", "-", label) or "policy"


def evaluate_paired(
    settings: StackSettings,
    policies: Sequence[EvalPolicy],
    suite: SuiteName = "sites",
    split: Split = "heldout",
    difficulty: Difficulty | None = "easy",
    templates: tuple[str, ...] | None = None,
    instances: int | None = None,
    samples: int = 4,
    workers: int = 2,
    som: bool = True,
    run_id: str = "",
    show_progress: bool = True,
) -> PairedEvaluation:
    """Every policy on the same instances (`instance_ids`), `samples` episodes each; each policy's
    episodes are the run `<run_id>-<label>` in the event log, counted back from the ledger."""
    if not policies:
        raise ValueError("no policy to evaluate")
    labels = [run_label(p.label) for p in policies]
    if len(set(labels)) < len(labels):
        raise ValueError(f"policy labels must differ: {[p.label for p in policies]}")
    run_id = run_id or f"eval-{uuid.uuid4().hex[:8]}"
    task_ids = instance_ids(suite, split, difficulty, templates, instances)
    runs = []
    for policy, label in zip(policies, labels):
        run_instances(
            settings, policy, task_ids, samples, suite, split, f"{run_id}-{label}", workers, som, show_progress
        )
        runs.append((policy, f"{run_id}-{label}", len(task_ids) * (policy.samples or samples)))
    return PairedEvaluation(run_id, task_ids, tuple(read_back(settings, runs, task_ids)))
