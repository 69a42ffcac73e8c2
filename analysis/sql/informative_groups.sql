-- Dynamic sampling's yield for run $run_id: its completed groups, the informative ones (rewards not
-- all equal: what the trainer keeps, `groups.informative`), their share, and informative groups per
-- minute of the run's sampling span (its first dispatched group to its last completed one).
WITH completed AS (
    SELECT count(*) AS groups, count_if(informative) AS informative, max(completed_at) AS last_at
    FROM groups
    WHERE run_id = $run_id
),
dispatched AS (
    SELECT min(emitted_at) AS first_at FROM task_group_dispatched WHERE run_id = $run_id
)
SELECT
    groups,
    informative,
    informative / greatest(groups, 1)                                   AS informative_share,
    epoch(last_at - coalesce(first_at, last_at)) / 60                   AS minutes,
    informative / greatest(epoch(last_at - coalesce(first_at, last_at)) / 60, 1e-9) AS informative_per_minute
FROM completed, dispatched;
