-- `awrl ledger verify` and the Dagster checks: trajectories with a step missing, one row each. Either
-- its step indices are not 0..n-1 (a gap, or one index under two event ids: the trainer would align
-- tokens wrongly), or it has fewer steps than its GroupCompleted names (a lost last step leaves no gap,
-- and the trainer must never train such a group). `steps_named` is NULL for a trajectory no completed
-- group names yet. $run_id NULL: every run.
WITH recorded AS (
    SELECT run_id, trajectory_id, count(*) AS steps_recorded, count(DISTINCT step) AS distinct_steps,
           min(step) AS first_step, max(step) AS last_step
    FROM step_recorded
    WHERE $run_id IS NULL OR run_id = $run_id
    GROUP BY run_id, trajectory_id
),
named AS (
    SELECT run_id, group_id, unnest(trajectory_ids) AS trajectory_id, unnest(num_steps) AS steps_named
    FROM group_completed
    WHERE $run_id IS NULL OR run_id = $run_id
)
SELECT
    run_id,
    trajectory_id,
    n.group_id,
    n.steps_named,
    coalesce(r.steps_recorded, 0) AS steps_recorded,
    r.first_step,
    r.last_step
FROM recorded AS r
FULL JOIN named AS n USING (run_id, trajectory_id)
WHERE r.first_step <> 0 OR r.last_step <> r.steps_recorded - 1 OR r.distinct_steps <> r.steps_recorded
   OR coalesce(r.steps_recorded, 0) < n.steps_named
ORDER BY run_id, trajectory_id;
