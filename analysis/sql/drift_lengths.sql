-- Trajectory length in steps (|tau|, AsyncWebRL, arXiv 2606.05597) by outcome; env errors are neither.
SELECT outcome, count(*) AS trajectories, avg(num_steps) AS mean_steps
FROM episode_finished
WHERE run_id = $run_id AND outcome IN ('success', 'failure')
GROUP BY outcome;
