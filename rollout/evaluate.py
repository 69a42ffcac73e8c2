"""Success rate of a policy on held-out tasks, with a 95% confidence interval.

Episodes are sampled at the policy's temperature (1 by default, the distribution RL trains), so
repeated episodes of the same task are independent draws and the binomial interval is honest; a
greedy policy on deterministic pages would repeat itself and overstate the sample size.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from pathlib import Path

from pipeline.settings import StackSettings
from rollout.episode import EpisodeConfig
from rollout.run import RolloutRequest, run_rollout


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


def evaluate(settings: StackSettings, policy: str = "local", model_dir: Path | None = None, suite: str = "sites",
             split: str = "heldout", difficulty: str | None = "easy", episodes: int = 100, workers: int = 2,
             som: bool = True, temperature: float = 1.0, run_id: str = "", show_progress: bool = True,
             templates: tuple[str, ...] | None = None) -> EvalResult:
    """Run `episodes` single-episode groups of the split's tasks; the run is in the event log like any other."""
    run_id = run_id or f"eval-{uuid.uuid4().hex[:8]}"
    req = RolloutRequest(suite=suite, policy=policy, workers=workers, group_size=1, episodes=episodes, split=split,
                         difficulty=difficulty, run_id=run_id, model_dir=model_dir, temperature=temperature,
                         episode=EpisodeConfig(som=som), templates=templates)
    stats = run_rollout(settings, req, show_progress)
    return EvalResult(run_id, stats.episodes, stats.successes)
