-- One row per optimizer step (UpdateApplied). `clip_frac` is NULL when the loss did not report it.
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
    stats,
    duration_s,
    wait_s,
    compute_s,
    world_size,
    group_ids,
    trajectory_ids,
    config_json,
    weights_sha256,
    emitted_at              AS applied_at,
    event_id
FROM update_applied;
