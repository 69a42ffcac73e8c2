-- One row per agent step (StepRecorded) with the columns analyses reach for most.
-- The token arrays stay in `step_recorded`; `response_tokens` counts them. It reads
-- `token_policy_versions`, which has the same length as `response_token_ids` (the event validates
-- it) but is run-length encoded in Parquet, so counting it decodes ~2x less.
CREATE OR REPLACE VIEW steps AS
SELECT
    run_id,
    trajectory_id,
    group_id,
    task_id,
    step,
    policy_version,
    len(token_policy_versions)      AS response_tokens,
    list_min(token_policy_versions) AS min_token_version,
    list_max(token_policy_versions) AS max_token_version,
    memory,
    list_sort(map_keys(memory))     AS memory_keys,
    cardinality(memory)             AS num_keys,
    action.kind                     AS action_kind,
    action,
    url,
    response_text,
    env_feedback,
    error_class,
    timings.policy_s                AS policy_s,
    timings.browser_s               AS browser_s,
    timings.wait_s                  AS wait_s,
    screenshot_sha256,
    marks,
    marks_drawn,
    emitted_at,
    event_id
FROM step_recorded;
