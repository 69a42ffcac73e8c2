-- One row per optimizer step (UpdateApplied); the one definition of the table (the Dagster asset
-- `updates` is its rows for one run). `clip_frac` is NULL when the loss did not report it; the memory
-- columns are the largest rank's (NULL for events from before per-rank memory was recorded). The
-- `mismatch_*` columns compare the sampler's and the trainer's log-probs of the same tokens (defined in
-- `trainer/mismatch.py`): those of the fresh tokens are NULL when the update had no finite one (or
-- predates them), `mismatch_stale_k3` when it had no stale token.
CREATE OR REPLACE VIEW updates AS
SELECT
    run_id,
    update_step,
    version_before,
    version_after,
    len(group_ids)          AS num_groups,
    len(trajectory_ids)     AS num_trajectories,
    loss,
    grad_norm,
    stats['clip_frac']      AS clip_frac,
    stats['staleness_mean'] AS staleness_mean,
    stats['staleness_max']  AS staleness_max,
    stats['mismatch_tokens'] AS mismatch_tokens,
    if(mismatch_tokens > 0, stats['mismatch_nonfinite'], NULL)   AS mismatch_nonfinite,
    if(mismatch_nonfinite < 1, stats['mismatch_k1'], NULL)        AS mismatch_k1,
    if(mismatch_nonfinite < 1, stats['mismatch_k2'], NULL)        AS mismatch_k2,
    if(mismatch_nonfinite < 1, stats['mismatch_k3'], NULL)        AS mismatch_k3,
    if(mismatch_nonfinite < 1, stats['mismatch_ratio_min'], NULL) AS mismatch_ratio_min,
    if(mismatch_nonfinite < 1, stats['mismatch_ratio_max'], NULL) AS mismatch_ratio_max,
    if(mismatch_nonfinite < 1, stats['mismatch_ratio_tail'], NULL) AS mismatch_ratio_tail,
    stats['mismatch_stale_tokens'] AS mismatch_stale_tokens,
    if(mismatch_stale_tokens > 0, stats['mismatch_stale_k3'], NULL) AS mismatch_stale_k3,
    stats,
    duration_s,
    wait_s,
    compute_s,
    world_size,
    list_max(list_transform(memory, lambda m: m.peak_bytes)) AS peak_bytes_max_rank,
    list_max(list_transform(memory, lambda m: m.params_bytes + m.grads_bytes + m.optimizer_bytes))
                            AS state_bytes_max_rank,
    group_ids,
    trajectory_ids,
    config_json,
    weights_sha256,
    emitted_at              AS applied_at,
    event_id
FROM update_applied;
