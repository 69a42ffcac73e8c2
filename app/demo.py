"""`awrl demo`: the main job on the embedded stack, end to end.

Stack up -> the untrained tiny VLM's held-out success -> oracle demonstrations in real browsers ->
SFT warm start -> async RL (everlasting pool, bounded staleness, torchrun trainer publishing versions)
-> held-out success after each stage -> everything folded into the Parquet ledger -> the RL run's drift
metrics from DuckDB -> every Dagster asset materialized for the run. The learning stages are
`app.learning`; this module adds the ledger, drift and Dagster end and the summary.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from dagster import DagsterInstance, materialize

from analysis import connect, drift_metrics
from app.learning import LearningConfig, LearningCurve, run_learning
from assets import all_assets, all_checks, defs
from pipeline.settings import StackSettings


@dataclass
class DemoSummary:
    run_id: str
    success_untrained: str
    success_after_sft: str
    success_after_rl: str
    rl_minus_sft: str
    """RL - SFT held-out success on the same instances, with its paired bootstrap 95% interval."""
    rl_minus_best_sft: str
    """RL - the best SFT sampling temperature (`LearningConfig.sharpening`), when that is not the SFT
    point itself ("-" otherwise): a gain counts only above it."""
    demonstrations: str
    sft_loss: str
    rl_trajectories: int
    rl_trajectories_per_hour: float
    rl_updates: int
    policy_version: int
    trainer_idle: float
    staleness_mean: float
    events_in_ledger: int
    screenshots_stored: int
    generic_key_ratio: float | None
    length_downweight: float | None
    dagster_assets_materialized: int
    dagster_checks_passed: str
    """"passed/run", and the names of any that failed (`assets.checks`)."""
    curve_png: str
    seconds: float


def run_demo(settings: StackSettings, config: LearningConfig, say=print) -> DemoSummary:
    start = time.perf_counter()
    curve = run_learning(settings, config, say)
    con = connect(settings)
    (events,) = con.execute(
        "SELECT count(*) FROM step_recorded WHERE run_id LIKE $r || '%'", {"r": curve.run_id}
    ).fetchone()
    (shots,) = con.execute(
        "SELECT count(DISTINCT screenshot_sha256) FROM steps WHERE run_id LIKE $r || '%'", {"r": curve.run_id}
    ).fetchone()
    drift = drift_metrics(con, curve.run_id)
    say("materializing the Dagster assets of the RL run")
    materialized, checks = _materialize(curve.run_id)
    rl, sft = curve.rl, curve.sft
    return DemoSummary(
        run_id=curve.run_id,
        success_untrained=_rate(curve, "untrained"),
        success_after_sft=_rate(curve, "sft"),
        success_after_rl=_rate(curve, "rl"),
        rl_minus_sft=_difference(curve, 0),
        rl_minus_best_sft=_difference(curve, 1),
        demonstrations=f"{curve.demo_successes}/{curve.demo_episodes} succeeded",
        sft_loss=f"{sft.losses[0]:.2f} -> {sft.losses[-1]:.2f}" if sft else "-",
        rl_trajectories=rl.episodes,
        rl_trajectories_per_hour=rl.trajectories_per_hour,
        rl_updates=rl.updates,
        policy_version=rl.version,
        trainer_idle=rl.trainer_idle,
        staleness_mean=rl.staleness_mean,
        events_in_ledger=events,
        screenshots_stored=shots,
        generic_key_ratio=drift.generic_key_ratio,
        length_downweight=drift.length_downweight,
        dagster_assets_materialized=materialized,
        dagster_checks_passed=checks,
        curve_png=str(config.out_dir / curve.run_id / "curve.png"),
        seconds=time.perf_counter() - start,
    )


def _rate(curve: LearningCurve, stage: str) -> str:
    p = curve.point(stage)
    return "-" if p is None else f"{p.rate:.2f} [{p.ci95[0]:.2f}, {p.ci95[1]:.2f}] n={p.episodes}"


def _difference(curve: LearningCurve, i: int) -> str:
    if len(curve.differences) <= i:
        return "-"
    d = curve.differences[i]
    return (
        f"{d.diff:+.2f} [{d.ci95[0]:+.2f}, {d.ci95[1]:+.2f}]"
        + (f" vs {d.subtrahend}" if i else "")
        + f", {d.instances} instances"
    )


def _materialize(run_id: str) -> tuple[int, str]:
    """Materialize every asset for this run in-process, with its checks, as `dagster dev` does on the
    sensor's request: (assets materialized, "passed/run" checks and the names of those that failed).

    The assets read the stack through `StackSettings()` (environment / `.env`), like `dagster dev`."""

    instance = DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("runs", [run_id])
    quiet = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}
    result = materialize(
        [*all_assets, *all_checks],
        partition_key=run_id,
        instance=instance,
        resources=defs.resources,
        run_config=quiet,
        raise_on_error=False,
    )
    checks = result.get_asset_check_evaluations()
    failed = sorted(c.check_name for c in checks if not c.passed)
    passed = f"{len(checks) - len(failed)}/{len(checks)}" + (f" (failed: {', '.join(failed)})" if failed else "")
    return len(result.get_asset_materialization_events()), passed
