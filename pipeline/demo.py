"""`awrl demo`: the main job on the embedded stack, end to end.

Stack up -> an everlasting pool of real browsers runs our sites' tasks (oracle policy, Set-of-Mark)
-> every step on the event log, every screenshot in S3 by hash -> the ledger writer folds the log into
Parquet -> DuckDB computes the run's drift metrics -> Dagster materializes the run's tables. The
training stages (SFT, RL) plug in between rollout and ledger as their issues land.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from pipeline.ledger import LedgerWriter
from pipeline.settings import StackSettings


@dataclass
class DemoSummary:
    run_id: str
    episodes: int
    success_rate: float
    steps: int
    steps_per_s: float
    events_in_ledger: int
    ledger_files: int
    screenshots_stored: int
    generic_key_ratio: float | None
    length_downweight: float | None
    dagster_assets_materialized: int
    seconds: float


def run_demo(settings: StackSettings, episodes: int = 8, workers: int = 2) -> DemoSummary:
    from analysis import connect, drift_metrics
    from rollout.episode import EpisodeConfig
    from rollout.run import RolloutRequest, run_rollout

    start = time.perf_counter()
    run_id = f"demo-{uuid.uuid4().hex[:8]}"
    req = RolloutRequest(suite="sites", policy="oracle", workers=workers, group_size=4, episodes=episodes,
                         run_id=run_id, episode=EpisodeConfig(som=True))
    stats = run_rollout(settings, req)
    writer = LedgerWriter(settings)
    ledger = writer.sync(idle_exit_s=3.0)
    con = connect(settings)
    (written,) = con.execute("SELECT count(*) FROM step_recorded WHERE run_id = $r", {"r": run_id}).fetchone()
    (shots,) = con.execute("SELECT count(DISTINCT screenshot_sha256) FROM steps WHERE run_id = $r",
                           {"r": run_id}).fetchone()
    drift = drift_metrics(con, run_id)
    materialized = _materialize(run_id)
    return DemoSummary(
        run_id=run_id, episodes=stats.episodes, success_rate=stats.successes / max(stats.episodes, 1),
        steps=stats.steps, steps_per_s=stats.steps_per_s, events_in_ledger=ledger.written,
        ledger_files=ledger.files, screenshots_stored=shots, generic_key_ratio=drift.generic_key_ratio,
        length_downweight=drift.length_downweight, dagster_assets_materialized=materialized,
        seconds=time.perf_counter() - start,
    )


def _materialize(run_id: str) -> int:
    """Materialize every asset for this run in-process, as `dagster dev` does on the sensor's request.

    The assets read the stack through `StackSettings()` (environment / `.env`), like `dagster dev`."""
    from dagster import DagsterInstance, materialize

    from assets import all_assets, defs

    instance = DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("runs", [run_id])
    result = materialize(all_assets, partition_key=run_id, instance=instance, resources=defs.resources)
    return len(result.get_asset_materialization_events())
