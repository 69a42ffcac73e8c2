-- `awrl ledger verify` and the Dagster checks: published versions out of sequence, one row per break.
-- Each run's versions are 0, 1, 2, ... with no gap or repeat, each one's parent the one before: the
-- lineage replay walks. A NULL parent is lineage not recorded (events from before the field), not a
-- break. $run_id NULL: every run.
WITH published AS (
    SELECT
        run_id,
        version,
        parent_version,
        lag(version) OVER (PARTITION BY run_id ORDER BY version) AS previous_version
    FROM policy_version_published
    WHERE $run_id IS NULL OR run_id = $run_id
)
SELECT run_id, version, previous_version, parent_version
FROM published
WHERE version <> coalesce(previous_version + 1, 0) OR parent_version <> version - 1
ORDER BY run_id, version;
