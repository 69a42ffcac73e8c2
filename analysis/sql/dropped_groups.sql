-- Groups the trainer consumed without training on (GroupDropped): why, and how stale they were.
CREATE OR REPLACE VIEW dropped_groups AS
SELECT
    run_id,
    group_id,
    task_id,
    reason,
    trainer_version,
    min_policy_version,
    trainer_version - min_policy_version AS version_lag,
    emitted_at AS dropped_at,
    event_id
FROM group_dropped;
