-- One trajectory's steps in order, for the viewer's trajectory page: what the agent saw, thought, did
-- and kept, with the memory keys added and dropped since its previous step (the key sets the drift
-- metrics compare, `drift_step_keys.sql`: keys only, values aside), and its token-version span.
WITH ordered AS (
    SELECT
        step,
        policy_version,
        min_token_version,
        max_token_version,
        response_tokens,
        screenshot_sha256,
        marks,
        marks_drawn,
        url,
        action,
        response_text,
        env_feedback,
        error_class,
        memory,
        memory_keys,
        num_keys,
        coalesce(lag(memory_keys) OVER (ORDER BY step), []::VARCHAR[]) AS previous_keys,
        policy_s,
        browser_s
    FROM steps
    WHERE run_id = $run_id AND trajectory_id = $trajectory_id
)
SELECT
    *,
    list_filter(memory_keys, lambda k: NOT list_contains(previous_keys, k)) AS keys_added,
    list_filter(previous_keys, lambda k: NOT list_contains(memory_keys, k)) AS keys_dropped
FROM ordered
ORDER BY step;
