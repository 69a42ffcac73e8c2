"""Asset checks that guard the data the trainer and the analyses read.

Each check reads the materialized table of one run. Checks on training data are blocking: when one
fails, no asset downstream of its table materializes in that run, so a broken ledger never reaches a
curve or a drift report unnoticed. Each has a test that plants the violation (`tests/test_assets.py`).
"""

import dagster as dg
import pyarrow as pa

from assets.io import sql
from assets.tables import groups, policy_versions, steps, trajectories, updates


def _result(bad: list, what: str, severity=dg.AssetCheckSeverity.ERROR) -> dg.AssetCheckResult:
    return dg.AssetCheckResult(passed=not bad, severity=severity,
                               metadata={"violations": len(bad), "examples": dg.MetadataValue.json(bad[:5]),
                                         "rule": what})


def _unique(table: pa.Table, key: str) -> dg.AssetCheckResult:
    bad = sql(f"select {key}, count(*) as n from t group by {key} having n > 1 order by {key}", t=table).to_pylist()
    return _result(bad, f"{key} unique")


def _event_id_unique(asset: dg.AssetsDefinition, why: str) -> dg.AssetChecksDefinition:
    @dg.asset_check(asset=asset, name=f"{asset.key.to_user_string()}_event_id_unique", blocking=True, description=why)
    def check(table: pa.Table) -> dg.AssetCheckResult:
        return _unique(table, "event_id")

    return check


event_ids_unique = [_event_id_unique(a, why) for a, why in (
    (steps, "Every step event once: the ledger dedupes by `event_id`, so a duplicate means a broken writer."),
    (groups, "Every group once: a group counted twice would be trained twice."),
    (updates, "Every optimizer step once."),
    (policy_versions, "Every published version once."),
)]
"""`event_id` unique in each table that carries it, one check per table."""


@dg.asset_check(asset=trajectories, blocking=True)
def trajectories_one_row_each(trajectories: pa.Table) -> dg.AssetCheckResult:
    """One row per trajectory: a trajectory id started or finished twice is a duplicated episode."""
    return _unique(trajectories, "trajectory_id")


@dg.asset_check(asset=steps, blocking=True)
def steps_numbered_without_gaps(steps: pa.Table) -> dg.AssetCheckResult:
    """Each trajectory's steps are 0..n-1: a gap is a lost step (the trainer would align tokens wrongly)."""
    bad = sql("""select trajectory_id, count(*) as steps, min(step) as first, max(step) as last
                 from s group by trajectory_id
                 having min(step) <> 0 or max(step) <> count(*) - 1 or count(distinct step) <> count(*)
                 order by trajectory_id""", s=steps).to_pylist()
    return _result(bad, "steps 0..n-1 per trajectory")


@dg.asset_check(asset=policy_versions, blocking=True)
def policy_versions_contiguous(policy_versions: pa.Table) -> dg.AssetCheckResult:
    """Versions 0..n with no gap, each one's parent the one before: the lineage replay walks. (A NULL
    parent is lineage not recorded, as in events from before the field existed; not a violation.)"""
    bad = sql("""select version, parent_version from (
                     select version, parent_version, row_number() over (order by version) - 1 as expected
                     from v)
                 where version <> expected or parent_version <> version - 1
                 order by version""", v=policy_versions).to_pylist()
    return _result(bad, "versions 0..n, parent = version - 1")


@dg.asset_check(asset=groups, blocking=True)
def group_advantages_sum_to_zero(groups: pa.Table) -> dg.AssetCheckResult:
    """Group-normalised advantages (GRPO) sum to 0 within each group, to float precision."""
    bad = [{"group_id": g, "sum": s} for g, a in zip(groups.column("group_id").to_pylist(),
                                                     groups.column("advantages").to_pylist(), strict=True)
           if a and abs(s := sum(a)) > 1e-6 * max(1, len(a))]
    return _result(bad, "sum(advantages) = 0 per group")
