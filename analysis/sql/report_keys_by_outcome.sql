-- Mean memory keys at each step index, per trajectory outcome (NULL: not finished), for the report.
SELECT f.outcome, s.step, count(*) AS steps, avg(cardinality(s.memory)) AS mean_keys
FROM step_recorded AS s
LEFT JOIN episode_finished AS f USING (run_id, trajectory_id)
WHERE s.run_id = $run_id
GROUP BY ALL
ORDER BY f.outcome, s.step;
