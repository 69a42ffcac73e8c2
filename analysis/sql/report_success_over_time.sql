-- Success rate of finished trajectories in $bins equal slices of the run's wall-clock span
-- (env errors count as not successful: the agent did not finish the task).
WITH finished AS (
    SELECT epoch(emitted_at) AS t, (outcome = 'success')::INT AS ok
    FROM episode_finished
    WHERE run_id = $run_id
),
span AS (
    SELECT min(t) AS t0, greatest(max(t) - min(t), 1e-9) AS width FROM finished
)
SELECT
    least(floor((t - t0) / width * $bins), $bins - 1)::INT AS bin,
    (bin + 0.5) * any_value(width) / $bins / 60            AS minutes,
    count(*)                                               AS trajectories,
    avg(ok)                                                AS success_rate
FROM finished, span
GROUP BY bin
ORDER BY bin;
