-- Trajectory lengths (steps) of finished successes and failures, for the histogram.
SELECT outcome, num_steps
FROM episode_finished
WHERE run_id = $run_id AND outcome IN ('success', 'failure');
