-- One row per GroupCompleted. `advantages` and `informative` call pipeline.advantages through
-- Python UDFs registered by analysis.views.connect, so they equal what the trainer computed.
CREATE OR REPLACE VIEW groups AS
SELECT
    run_id,
    group_id,
    task_id,
    len(trajectory_ids)               AS group_size,
    trajectory_ids,
    rewards,
    awrl_group_advantages(rewards)    AS advantages,
    awrl_informative(rewards)         AS informative,
    list_avg(rewards)                 AS mean_reward,
    num_steps,
    outcomes,
    min_policy_version,
    max_policy_version,
    emitted_at                        AS completed_at,
    event_id
FROM group_completed;
