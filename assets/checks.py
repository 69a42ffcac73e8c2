"""Asset checks that guard the data the trainer and the analyses read.

Each check reads the materialized table of one run, or that run's events. Checks on training data are blocking: when one
fails, no asset downstream of its table materializes in that run, so a broken ledger never reaches a
curve or a drift report unnoticed. One is a warning, not a guard: `dead_letters`, the messages the
consumers refused, which lose nothing but are missing from the tables. Each check has a test that
plants the violation (`tests/test_assets.py`). The ledger's own promises (each event stored once, no
step missing, no version gap) are `analysis.verify`'s queries, the ones `awrl ledger verify` runs.
"""

from collections import Counter

import dagster as dg
import pyarrow as pa

from analysis.verify import check
from analysis.views import connect
from assets.io import Ledger, run_query
from assets.tables import groups, policy_versions, steps, trajectories, updates


def _result(bad: list, what: str, severity=dg.AssetCheckSeverity.ERROR) -> dg.AssetCheckResult:
    return dg.AssetCheckResult(
        passed=not bad,
        severity=severity,
        metadata={"violations": len(bad), "examples": dg.MetadataValue.json(bad[:5]), "rule": what},
    )


def _unique(table: pa.Table, key: str) -> dg.AssetCheckResult:
    bad = run_query(
        f"select {key}, count(*) as n from t group by {key} having n > 1 order by {key}", t=table
    ).to_pylist()
    return _result(bad, f"{key} unique")


def _ledger_check(ledger: Ledger, run: str, kind: str, event_type: str | None = None) -> dg.AssetCheckResult:
    """`analysis.verify.check` over the run's events: the very query `awrl ledger verify` runs."""
    with connect(ledger.settings(), run_id=run) as con:
        finding = check(con, kind, run)
    rows = finding.rows if event_type is None else [r for r in finding.rows if r["event_type"] == event_type]
    return _result(rows, finding.what)


def _event_id_unique(asset: dg.AssetsDefinition, event_type: str, why: str) -> dg.AssetChecksDefinition:
    # The views (so the tables) read each event id once: a copy is found in the stored rows, not in the table.
    @dg.asset_check(asset=asset, name=f"{asset.key.to_user_string()}_event_id_unique", blocking=True, description=why)
    def check(context: dg.AssetCheckExecutionContext, ledger: Ledger) -> dg.AssetCheckResult:
        return _ledger_check(ledger, context.partition_key, "duplicates", event_type)

    return check


event_ids_unique = [
    _event_id_unique(a, t, why)
    for a, t, why in (
        (
            steps,
            "StepRecorded",
            "Every step event stored once: the ledger dedupes by `event_id`, so a copy means a "
            "broken writer (the table shows it once).",
        ),
        (groups, "GroupCompleted", "Every group stored once: a group counted twice would be trained twice."),
        (updates, "UpdateApplied", "Every optimizer step stored once."),
        (policy_versions, "PolicyVersionPublished", "Every published version stored once."),
    )
]
"""No event of the table's type stored twice in the run's files, one check per table."""


@dg.asset_check(asset=trajectories, blocking=True)
def trajectories_one_row_each(trajectories: pa.Table) -> dg.AssetCheckResult:
    """One row per trajectory: a trajectory id started or finished twice is a duplicated episode."""
    return _unique(trajectories, "trajectory_id")


@dg.asset_check(asset=steps, blocking=True)
def steps_numbered_without_gaps(context: dg.AssetCheckExecutionContext, ledger: Ledger) -> dg.AssetCheckResult:
    """Each trajectory's steps are 0..n-1, as many as its completed group names: a gap or a short
    trajectory is a lost step (the trainer would align tokens wrongly, or train an incomplete group)."""
    return _ledger_check(ledger, context.partition_key, "missing_steps")


@dg.asset_check(asset=policy_versions, blocking=True)
def policy_versions_contiguous(context: dg.AssetCheckExecutionContext, ledger: Ledger) -> dg.AssetCheckResult:
    """Versions 0..n with no gap, each one's parent the one before: the lineage replay walks. (A NULL
    parent is lineage not recorded, as in events from before the field existed; not a violation.)"""
    return _ledger_check(ledger, context.partition_key, "version_gaps")


@dg.asset_check(asset=groups, blocking=True)
def group_advantages_sum_to_zero(groups: pa.Table) -> dg.AssetCheckResult:
    """Group-normalised advantages (GRPO) sum to 0 within each group, to float precision."""
    bad = [
        {"group_id": g, "sum": s}
        for g, a in zip(groups.column("group_id").to_pylist(), groups.column("advantages").to_pylist(), strict=True)
        if a and abs(s := sum(a)) > 1e-6 * max(1, len(a))
    ]
    return _result(bad, "sum(advantages) = 0 per group")


@dg.asset_check(asset=steps, blocking=True)
def token_versions_match_their_step(
    context: dg.AssetCheckExecutionContext, steps: pa.Table, ledger: Ledger
) -> dg.AssetCheckResult:
    """Each step's tokens come from its own version or a later one that was published. A step names the
    version its policy held when sampling began (`rollout.episode`); an in-place refresh can only move
    the tokens after it forward, never back, so a token older than its step, or newer than any version
    the run published, is a mislabelled token (the trainer would weigh it with the wrong staleness)."""
    published = ledger.events(context.partition_key, "PolicyVersionPublished", ["version"]).column("version")
    newest = max(published.to_pylist(), default=0)
    bad = run_query(
        f"""select trajectory_id, step, policy_version, min_token_version, max_token_version from s
                  where min_token_version < policy_version or max_token_version > {int(newest)}
                  order by trajectory_id, step""",
        s=steps,
    ).to_pylist()
    return _result(bad, f"policy_version <= token versions <= {newest} (the newest published)")


@dg.asset_check(asset=updates, blocking=True)
def staleness_within_eta(updates: pa.Table) -> dg.AssetCheckResult:
    """No optimizer step trained on a token more than its config's eta versions old: the bounded
    staleness the admission rule (`trainer.staleness`) promises, checked on what was recorded."""
    bad = run_query(
        """select update_step, version_before, staleness_max, json_extract(config_json, '$.eta')::int as eta
                 from u where staleness_max > json_extract(config_json, '$.eta')::int
                 order by update_step""",
        u=updates,
    ).to_pylist()
    return _result(bad, "stats.staleness_max <= config eta")


@dg.asset_check(asset=steps)
def dead_letters(context: dg.AssetCheckExecutionContext, ledger: Ledger) -> dg.AssetCheckResult:
    """Messages the consumers refused (`pipeline.consumer`: malformed, or on the wrong topic) that name this
    run or no run at all, with their reasons: a warning, since nothing was lost (the ledger keeps each,
    `pipeline.ledger.read_dead_letters`), but each is an event the tables above do not show. Read from
    the ledger's durable copy, not the broker's topic (in memory on the local stack)."""
    from pipeline.consumer import message_run_id
    from pipeline.ledger import read_dead_letters

    rows = read_dead_letters(ledger.settings()).select(["source_topic", "reason", "value"]).to_pylist()
    letters = [r for r in rows if message_run_id(r["value"]) in (context.partition_key, None)]
    reasons = Counter(f"{r['source_topic']}: {r['reason'][:160]}" for r in letters)
    return dg.AssetCheckResult(
        passed=not letters,
        severity=dg.AssetCheckSeverity.WARN,
        metadata={
            "checked": True,
            "dead_letters": len(letters),
            "reasons": dg.MetadataValue.json(dict(reasons.most_common(10))),
        },
    )
