-- Clip-trigger rate of every update of the run: UpdateApplied.stats[$clip_key], NULL when the loss
-- did not report it.
SELECT update_step, stats[$clip_key] AS clip_rate
FROM update_applied
WHERE run_id = $run_id
ORDER BY update_step;
