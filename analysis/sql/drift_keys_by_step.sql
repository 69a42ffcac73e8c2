-- Memory size against step index: the paper's "almost one key per step" under 1/|tau|.
SELECT step, count(*) AS steps, avg(num_keys) AS mean_keys, max(num_keys) AS max_keys
FROM drift_step_keys
GROUP BY step
ORDER BY step;
